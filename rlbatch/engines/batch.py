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


def _positions(lengths: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every element when row b holds lengths[b] values from column offsets[b]."""
    rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    cols = torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts - offsets, lengths)
    return rows, cols


def pack(samples: list[dict[str, torch.Tensor]], pad_id: int, device: torch.device) -> Packed:
    """One padded batch, built with a few vectorised writes (no per-sample tensor ops)."""
    prompts, responses = [s["prompt"] for s in samples], [s["response"] for s in samples]
    plen = torch.tensor([t.shape[0] for t in prompts])
    rlen = torch.tensor([t.shape[0] for t in responses])
    total = plen + rlen
    B, L = len(samples), int(total.max())
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    ids[_positions(plen, torch.zeros_like(plen))] = torch.cat(prompts)
    rows, cols = _positions(rlen, plen)
    ids[rows, cols] = torch.cat(responses)
    attn = (torch.arange(L)[None, :] < total[:, None]).long()
    target = (rows, cols - 1)  # logits at position t score token t+1
    mask = torch.zeros((B, L - 1))
    mask[target] = 1.0
    fields = {}
    for f in TOKEN_FIELDS:
        if all(f in s for s in samples):
            fields[f] = torch.zeros((B, L - 1))
            fields[f][target] = torch.cat([s[f] for s in samples]).float()
    spans = list(zip((plen - 1).tolist(), rlen.tolist(), strict=True))
    adv = torch.stack([s["advantage"].float().reshape(()) for s in samples]) if all("advantage" in s for s in samples) else None
    return Packed(
        ids.to(device), attn.to(device), mask.to(device), {f: t.to(device) for f, t in fields.items()},
        adv.to(device) if adv is not None else None, spans,
    )


def unpack(per_token: torch.Tensor, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Per-sample response-token values from a [B, L-1] tensor (views of one new tensor)."""
    out = per_token.detach().float().cpu()
    starts = torch.tensor([s for s, _ in spans])
    lengths = torch.tensor([n for _, n in spans])
    flat = out[_positions(lengths, starts)]
    return list(flat.split(lengths.tolist()))
