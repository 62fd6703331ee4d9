"""Pack variable-length samples into padded tensors for a forward pass, and unpack the result.

A sample is a dict of 1-D tensors: ``prompt`` and ``response`` token ids, and optionally
per-response-token fields (``old_logprobs``, ``ref_logprobs``) and the scalar ``advantage``.
Sequences are right-padded; position t's logits predict token t+1, so response token j of a
prompt of length P is scored at shifted position P-1+j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOKEN_FIELDS = ("old_logprobs", "ref_logprobs")


@dataclass
class Packed:
    input_ids: torch.Tensor       # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    mask: torch.Tensor            # [B, L-1] float, 1 on response-token targets
    fields: dict[str, torch.Tensor]  # per-token fields aligned with mask, [B, L-1]
    advantages: torch.Tensor | None  # [B]
    spans: list[tuple[int, int]]  # (start, length) of each response in shifted positions


def pack(samples: list[dict[str, torch.Tensor]], pad_id: int, device: torch.device) -> Packed:
    lengths = [len(s["prompt"]) + len(s["response"]) for s in samples]
    B, L = len(samples), max(lengths)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L - 1))
    fields = {f: torch.zeros((B, L - 1)) for f in TOKEN_FIELDS if all(f in s for s in samples)}
    spans = []
    for b, s in enumerate(samples):
        p, r = len(s["prompt"]), len(s["response"])
        ids[b, :p] = s["prompt"]
        ids[b, p : p + r] = s["response"]
        attn[b, : p + r] = 1
        mask[b, p - 1 : p - 1 + r] = 1
        for f, t in fields.items():
            t[b, p - 1 : p - 1 + r] = s[f]
        spans.append((p - 1, r))
    adv = torch.tensor([float(s["advantage"]) for s in samples]) if all("advantage" in s for s in samples) else None
    return Packed(
        ids.to(device), attn.to(device), mask.to(device), {f: t.to(device) for f, t in fields.items()},
        adv.to(device) if adv is not None else None, spans,
    )


def unpack(per_token: torch.Tensor, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Per-sample response-token values from a [B, L-1] tensor."""
    out = per_token.detach().float().cpu()
    return [out[b, start : start + n].clone() for b, (start, n) in enumerate(spans)]
