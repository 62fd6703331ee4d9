"""Pack variable-length samples for a forward pass, and read back per-response-token values.

A sample is a dict of 1-D tensors: ``prompt`` and ``response`` token ids, and optionally
per-response-token fields (``rlbatch.phases.PER_TOKEN_FIELDS``: ``old_logprobs``, ``ref_logprobs``,
per-token ``advantages``, ...) and a per-sequence scalar ``advantage``.
Everything a loss reads is response-aligned: ``[B, R]``, R the longest response, column j
the sample's response token j, right-padded and masked.

Two ways to compute the logits that score those tokens, the same numbers either way:

- ``Full``: one right-padded sequence per sample, prompt then response; position t's logits
  score token t+1, so response token j of a prompt of length P is scored at P-1+j.
- ``Shared``: GRPO samples a group of responses per prompt, so a batch repeats each prompt
  many times. Each distinct prompt is run once (left-padded, keeping its KV cache and only
  its last position's logits, which score response token 0); the cache rows are then
  selected for every sample, and the responses (all but their last token) run on top of it.
  Gradients flow back through the selection into the one shared prompt pass. A batch of 32
  prompts x 32 samples computes its prompt tokens 32 times less often.
- ``Flat`` (engine_args.max_tokens_per_micro_batch > 0): no padding. The samples are
  concatenated into one row, position ids restarting at 0 at each sample; with no attention
  mask and no cache, transformers reads the restarts as sequence boundaries and confines
  attention to each sample (``masking_utils.find_packed_sequence_indices``: an exact
  block-diagonal causal mask for sdpa/eager, flash-attention's varlen kernel on a GPU). The LM
  head runs only at the positions that score a response token (``logits_to_keep``), and the
  log-probs come from ``rlbatch.algos.core.chunked_logprobs``, which keeps no fp32 copy of
  those logits for the backward. A sequence-classification model (a reward model) scores whole
  sequences: ``flat_sequences`` keeps every token and reads each sample's last one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from rlbatch.algos.core import chunked_logprobs, token_logprobs
from rlbatch.data.images import model_inputs
from rlbatch.engines.defaults import worth_sharing
from rlbatch.phases import PER_TOKEN_FIELDS

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

    from rlbatch.engines.ulysses import Slice


RopeIndex = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""A vision-language model's ``get_rope_index(input_ids, mm_token_type_ids, image_grid_thw)``:
([3, 1, L] multimodal positions, rope deltas) of one sequence."""


@dataclass(frozen=True)
class Vision:
    """What packing needs of a vision-language model (Qwen2-VL, Qwen2.5-VL): where its image tokens
    are, and its own multimodal rotary positions."""

    image_token_id: int
    rope_index: RopeIndex


def _vlm_core(model: torch.nn.Module, method: str) -> Any:
    """The module of a transformers vision-language model that has ``method`` (its ``model``, one
    level deeper inside PEFT's wrapper), or None."""
    inner = getattr(model, "model", None)
    inner = getattr(inner, "model", inner) if not hasattr(inner, method) else inner  # PEFT: one more level
    return inner if hasattr(inner, method) else None


def vision_of(model: torch.nn.Module) -> Vision | None:
    """``Vision`` of a transformers vision-language model (inside PEFT's or FSDP's wrapper or not),
    None for a text model."""
    inner = _vlm_core(model, "get_rope_index")
    token = getattr(getattr(model, "config", None), "image_token_id", None)
    if inner is None or token is None:
        return None
    return Vision(int(token), inner.get_rope_index)


@dataclass
class Images:
    """The images of a batch's samples, in sample order, as the model's forward takes them."""

    pixel_values: torch.Tensor    # [patches, C*T*P*P]
    image_grid_thw: torch.Tensor  # [images, 3]
    image_token_id: int
    token_types: torch.Tensor | None = None
    """``mm_token_type_ids`` of the call's ``input_ids``: 1 at the prompts' image tokens, 0 elsewhere
    (a response may hold the image token too: the policy can sample it; it is no image there)."""

    def forward_kwargs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The image arguments of a call on ``input_ids``."""
        types = self.token_types if self.token_types is not None else (input_ids == self.image_token_id).long()
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw, "mm_token_type_ids": types}


def image_token_types(prompt: torch.Tensor, response_len: int, image_token_id: int) -> torch.Tensor:
    """A sample's ``mm_token_type_ids`` over its prompt and ``response_len`` response tokens: 1 at the
    prompt's image tokens only."""
    return torch.cat([(prompt == image_token_id).long(), torch.zeros(response_len, dtype=torch.long)])


def _kwargs(images: Images | None, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return images.forward_kwargs(input_ids) if images is not None else {}


@contextlib.contextmanager
def image_placeholders(model: torch.nn.Module, images: Images | None) -> Iterator[None]:
    """Within it, ``model`` (a transformers vision-language model) puts its image features where
    ``images.token_types`` says, the prompts' image tokens, rather than at every image token of
    the ids: a sampled response may hold the image token too, which is text there (transformers
    would count it as a placeholder and refuse the call: more tokens than image features)."""
    inner = _vlm_core(model, "get_placeholder_mask")
    if images is None or images.token_types is None or inner is None:
        yield
        return
    types = images.token_types.bool()

    def placeholders(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor,
                     image_features: torch.Tensor | None = None, video_features: torch.Tensor | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        at = types.to(inputs_embeds.device)[..., None].expand_as(inputs_embeds)
        if image_features is not None and int(types.sum()) * inputs_embeds.shape[-1] != image_features.numel():
            raise ValueError(f"the prompts hold {int(types.sum())} image tokens and their images give "
                             f"{image_features.numel() // inputs_embeds.shape[-1]} image features")
        return at, torch.zeros_like(at)

    inner.get_placeholder_mask = placeholders
    try:
        yield
    finally:
        del inner.get_placeholder_mask


@dataclass
class Full:
    input_ids: torch.Tensor       # [B, L] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, L]
    index: torch.Tensor           # [B, R] the position whose logits score each response token
    images: Images | None = None
    """A vision-language batch's images: the model computes its multimodal positions from the ids,
    the right-padding mask and the grids."""


@dataclass
class Shared:
    prefix_ids: torch.Tensor      # [U, P] each distinct prompt once, left-padded
    prefix_mask: torch.Tensor     # [U, P]
    group: torch.Tensor           # [B] the row of prefix_ids holding sample b's prompt
    suffix_ids: torch.Tensor      # [B, R-1] response tokens but the last, right-padded
    suffix_mask: torch.Tensor     # [B, R-1]
    suffix_pos: torch.Tensor      # [B, R-1]


@dataclass
class Flat:
    input_ids: torch.Tensor       # [1, N] every sample back to back: prompt, then response but its last token
    position_ids: torch.Tensor    # [1, N] 0 at each sample's first token
    keep: torch.Tensor            # [K] the positions whose outputs score a response token
    where: torch.Tensor           # [K] b * R + j: the response token each kept position scores
    width: int                    # R
    cu_seq_lens: torch.Tensor     # [S + 1] int32: where each sample's run of the row starts, then N
    max_length: int               # the longest sample's run
    cp: Slice | None = None
    """``rlbatch.engines.ulysses.Slice`` when this is one rank's slice of a row split over a
    context-parallel group (``ulysses.split``): the forward runs inside ``ulysses.over`` and
    ``spread`` sums the group's kept outputs; None for a whole row."""
    images: Images | None = None
    """A vision-language row's images; its ``position_ids`` are then [4, 1, N]: row 0 the restarting
    text positions (what transformers reads the sample boundaries from), rows 1-3 each sample's
    multimodal positions (its model's ``get_rope_index``), back to back."""

    def forward_kwargs(self) -> dict[str, torch.Tensor | int | bool]:
        """What a model call on this row takes: the ids and restarting positions, no attention mask
        and no cache (so sdpa confines attention to each sample with transformers' block-diagonal
        mask), and the boundaries that a model on ``rlbatch.engines.attention.VARLEN`` reads instead."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False,
                "cu_seq_lens_q": self.cu_seq_lens, "cu_seq_lens_k": self.cu_seq_lens,
                "max_length_q": self.max_length, "max_length_k": self.max_length,
                **_kwargs(self.images, self.input_ids)}


@dataclass
class Packed:
    inputs: Full | Shared | Flat
    targets: torch.Tensor             # [B, R] response tokens, right-padded
    mask: torch.Tensor                # [B, R] float, 1 on response tokens
    fields: dict[str, torch.Tensor]   # per-token fields aligned with targets, [B, R]
    advantages: torch.Tensor | None   # [B] per-sequence advantages, when the samples carry them
    lengths: list[int]                # response lengths

    def token_advantages(self) -> torch.Tensor:
        """[B, R] advantages: the per-token field when the samples carry one, else each sequence's
        advantage over its tokens."""
        if "advantages" in self.fields:
            return self.fields["advantages"]
        if self.advantages is None:
            raise ValueError("the batch has no advantages (neither per-token 'advantages' nor 'advantage')")
        return self.advantages[:, None].expand_as(self.mask)


def _positions(lengths: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every element when row b holds lengths[b] values from column offsets[b]."""
    rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    cols = torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts - offsets, lengths)
    return rows, cols


def fill_rows(values: list[torch.Tensor], lengths: torch.Tensor, offsets: torch.Tensor, width: int,
              pad: float | int, dtype: torch.dtype) -> torch.Tensor:
    """A [len(values), width] tensor with values[b] written from column offsets[b], ``pad`` elsewhere."""
    out = torch.full((len(values), width), pad, dtype=dtype)
    if values:
        out[_positions(lengths, offsets)] = torch.cat(values).to(dtype)
    return out


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), [B, longest]: every prompt ends in the last column (generation starts there)."""
    lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max())
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    ids[_positions(lengths, width - lengths)] = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
    return ids, (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()


def distinct_prompts(prompts: Sequence[torch.Tensor | Sequence[int]],
                     images: Sequence[bytes] | None = None) -> tuple[list[int], torch.Tensor]:
    """The first sample of each distinct prompt, and for every sample its prompt's index there.
    ``images``: each prompt's images' key (``rlbatch.data.images.images_key``): prompts with equal
    ids and different images (of one size: the same number of image tokens) are distinct."""
    index: dict[tuple[tuple[int, ...], bytes], int] = {}
    firsts: list[int] = []
    group = []
    for b, p in enumerate(prompts):
        ids = tuple(p.tolist() if isinstance(p, torch.Tensor) else p)
        g = index.setdefault((ids, images[b] if images is not None else b""), len(firsts))
        if g == len(firsts):
            firsts.append(b)
        group.append(g)
    return firsts, torch.tensor(group, dtype=torch.long)


def pack(samples: list[dict[str, torch.Tensor]], pad_id: int, device: torch.device,
         share_prompts: bool = False, flat: bool = False, vision: Vision | None = None) -> Packed:
    """One batch built with a few vectorised writes (no per-sample tensor ops). With ``flat`` the
    inputs are one ``Flat`` row of all the samples: one model call, as for the padded forms, so
    every dp rank of a sharded model makes as many calls as the others (how many tokens a
    micro-batch holds is decided before, ``rlbatch.engines.training``). Else, with
    ``share_prompts``, ``Shared`` when prompts repeat enough to pay (``worth_sharing``), else ``Full``.

    ``vision`` (a vision-language model): samples carrying images (``rlbatch.data.images``) give
    their images to the forward and, flat, their multimodal positions; a batch with images is never
    ``Shared`` (its prompt pass would need the images' positions and rope deltas: not built)."""
    images, grids = _images(samples, vision)
    if images is not None:
        share_prompts = False
        images = Images(images.pixel_values.to(device), images.image_grid_thw.to(device), images.image_token_id)
    prompts, responses = [s["prompt"] for s in samples], [s["response"] for s in samples]
    plen = torch.tensor([t.shape[0] for t in prompts])
    rlen = torch.tensor([t.shape[0] for t in responses])
    B, R = len(samples), int(rlen.max()) if samples else 0
    zeros = torch.zeros_like(rlen)
    targets = fill_rows(responses, rlen, zeros, R, pad_id, torch.long)
    mask = (torch.arange(R)[None, :] < rlen[:, None]).float()
    fields = {f: fill_rows([s[f] for s in samples], rlen, zeros, R, 0.0, torch.float32)
              for f in PER_TOKEN_FIELDS if all(f in s for s in samples)}
    adv = (torch.stack([s["advantage"].float().reshape(()) for s in samples])
           if samples and all("advantage" in s for s in samples) else None)

    inputs: Full | Shared | Flat | None = None
    if flat:
        inputs = _flat(prompts, responses, plen, rlen, R, device)
        if images is not None:
            assert vision is not None
            inputs.position_ids = _mrope_positions(inputs, prompts, responses, grids, vision).to(device)
            types = [image_token_types(p, max(len(r) - 1, 0), vision.image_token_id)
                     for p, r in zip(prompts, responses, strict=True)]
            inputs.images = replace(images, token_types=torch.cat(types)[None].to(device))
    elif share_prompts:
        firsts, group = distinct_prompts(prompts)
        if worth_sharing(len(firsts), B):
            inputs = _shared(prompts, plen, rlen, targets, firsts, group, pad_id, device)
    if inputs is None:
        inputs = _full(prompts, responses, plen, rlen, pad_id, device)
        if images is not None:
            L = inputs.input_ids.shape[1]
            at_prompt = torch.arange(L, device=device)[None, :] < plen.to(device)[:, None]
            inputs.images = replace(images, token_types=((inputs.input_ids == images.image_token_id) & at_prompt).long())
    return Packed(inputs, targets.to(device), mask.to(device), {f: t.to(device) for f, t in fields.items()},
                  adv.to(device) if adv is not None else None, rlen.tolist())


def _images(samples: list[dict[str, torch.Tensor]], vision: Vision | None,
            ) -> tuple[Images | None, list[torch.Tensor | None]]:
    """The batch's images (None when no sample has any) and each sample's image grid (None: none)."""
    per = [model_inputs(s) for s in samples] if vision is not None else []
    found = [p for p in per if p is not None]
    if not found:
        return None, [None] * len(samples)
    assert vision is not None
    return (Images(torch.cat([p[0] for p in found]), torch.cat([p[1] for p in found]), vision.image_token_id),
            [p[1] if p is not None else None for p in per])


def _mrope_positions(x: Flat, prompts: list[torch.Tensor], responses: list[torch.Tensor],
                     grids: list[torch.Tensor | None], vision: Vision) -> torch.Tensor:
    """[4, 1, N] position ids of a flat row: row 0 its restarting text positions, rows 1-3 each
    sample's multimodal positions over its run (prompt, response but its last token): the model's
    own ``get_rope_index`` for a sample with images, its text positions on all three axes without."""
    text = x.position_ids.cpu()
    rows = []
    for p, r, grid in zip(prompts, responses, grids, strict=True):
        seq = torch.cat([p, r[:-1]]).long()[None]
        if grid is None:
            rows.append(torch.arange(seq.shape[1])[None, None].expand(3, 1, -1))
        else:
            types = image_token_types(p, seq.shape[1] - len(p), vision.image_token_id)[None].int()
            pos, _ = vision.rope_index(seq, mm_token_type_ids=types, image_grid_thw=grid)
            rows.append(pos.to(torch.long))
    mrope = torch.cat(rows, dim=2) if rows else torch.zeros(3, 1, 0, dtype=torch.long)
    return torch.cat([text[None], mrope], dim=0)


def _full(prompts: list[torch.Tensor], responses: list[torch.Tensor], plen: torch.Tensor, rlen: torch.Tensor,
          pad_id: int, device: torch.device) -> Full:
    total = plen + rlen
    L, R = (int(total.max()), int(rlen.max())) if prompts else (0, 0)
    ids = fill_rows(prompts, plen, torch.zeros_like(plen), L, pad_id, torch.long)
    if prompts:
        ids[_positions(rlen, plen)] = torch.cat(responses)
    attn = (torch.arange(L)[None, :] < total[:, None]).long()
    index = (plen[:, None] - 1 + torch.arange(R)[None, :]).clamp(max=max(L - 1, 0))
    return Full(ids.to(device), attn.to(device), index.to(device))


def _flat(prompts: list[torch.Tensor], responses: list[torch.Tensor], plen: torch.Tensor, rlen: torch.Tensor,
          width: int, device: torch.device) -> Flat:
    # A response's last token is scored but never read, so it is left out of the inputs. A sample
    # without a response keeps its prompt: scoring nothing, it still leaves the row non-empty.
    n = plen + (rlen - 1).clamp(min=0)
    starts = torch.cumsum(n, 0) - n
    parts = [t for p, r in zip(prompts, responses, strict=True) for t in (p, r[:-1])]
    ids = torch.cat(parts).long() if parts else torch.zeros(0, dtype=torch.long)
    pos = torch.arange(int(n.sum())) - torch.repeat_interleave(starts, n)
    # response token j of a sample starting at s with a prompt of p tokens is scored at s + p - 1 + j
    b, j = _positions(rlen, torch.zeros_like(rlen))
    keep = (starts + plen - 1)[b] + j
    return Flat(ids[None].to(device), pos[None].to(device), keep.to(device), (b * width + j).to(device), width,
                *_boundaries(n, device))


def _boundaries(n: torch.Tensor, device: torch.device | None) -> tuple[torch.Tensor, int]:
    """``Flat.cu_seq_lens`` and ``max_length`` of runs of ``n`` tokens (empty runs dropped)."""
    n = n[n > 0]
    cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(n, 0)]).to(device=device, dtype=torch.int32)
    return cu, int(n.max()) if len(n) else 0


def flat_sequences(samples: Sequence[dict[str, torch.Tensor]], pad_id: int, device: torch.device | None) -> Flat:
    """Every sample's whole sequence (prompt, then all of its response) back to back in one row,
    positions restarting at each: ``keep`` holds the position where a sequence-classification head
    scores each sample, in sample order (``where`` is the sample, ``width`` 1). That is where
    transformers' pooling reads a padded row: the last token that is not ``pad_id`` (so a trailing
    EOS that is also the pad token is not read), the sequence's first when every token is."""
    seqs = [torch.cat([s["prompt"], s["response"]]).long() for s in samples]
    n = torch.tensor([len(t) for t in seqs], dtype=torch.long)
    starts = torch.cumsum(n, 0) - n
    ids = torch.cat(seqs) if seqs else torch.zeros(0, dtype=torch.long)
    pos = torch.arange(int(n.sum())) - torch.repeat_interleave(starts, n)
    last = torch.tensor([int(torch.nonzero(t != pad_id).max()) if bool((t != pad_id).any()) else 0 for t in seqs],
                        dtype=torch.long)
    return Flat(ids[None].to(device), pos[None].to(device), (starts + last).to(device),
                torch.arange(len(samples)).to(device), 1, *_boundaries(n, device))


def _shared(prompts: list[torch.Tensor], plen: torch.Tensor, rlen: torch.Tensor, targets: torch.Tensor,
            firsts: list[int], group: torch.Tensor, pad_id: int, device: torch.device) -> Shared:
    up = plen[firsts]
    P, S = int(up.max()), max(targets.shape[1] - 1, 0)
    prefix_ids = fill_rows([prompts[i] for i in firsts], up, P - up, P, pad_id, torch.long)
    prefix_mask = (torch.arange(P)[None, :] >= (P - up)[:, None]).long()
    suffix_mask = (torch.arange(S)[None, :] < (rlen - 1).clamp(min=0)[:, None]).long()
    suffix_pos = plen[:, None] + torch.arange(S)[None, :]
    return Shared(*(t.to(device) for t in (prefix_ids, prefix_mask, group, targets[:, :S].clone(),
                                           suffix_mask, suffix_pos)))


def prompt_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows: 0 at each row's first real token (pads get 0 too)."""
    return (mask.cumsum(1) - 1).clamp(min=0)


def prompt_cache(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                 group: torch.Tensor | None) -> tuple[torch.Tensor, Cache]:
    """Run each distinct prompt once (``ids``/``mask``: [U, P], left-padded): its last position's
    logits [U, V], and its KV cache with one row per sample (``group``: [B], the prompt of each;
    None: the cache is not needed, nothing selected). The row selection is an index_select per
    layer, whose backward sums into the shared rows."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=prompt_positions(mask), use_cache=True,
                logits_to_keep=1)
    cache = out.past_key_values
    if group is not None:
        cache.reorder_cache(group)
    return out.logits[:, -1], cache


def response_logits(model: torch.nn.Module, batch: Packed) -> torch.Tensor:
    """[B, R, V] logits scoring each response token, from a transformers causal LM (``Full`` or
    ``Shared`` inputs; ``Flat`` ones go through ``response_logprobs``)."""
    x = batch.inputs
    assert not isinstance(x, Flat), "flat inputs keep no [B, R, V] logits: use response_logprobs"
    if isinstance(x, Full):
        with image_placeholders(model, x.images):
            logits = model(input_ids=x.input_ids, attention_mask=x.attention_mask, **_kwargs(x.images, x.input_ids)).logits
        return logits.gather(1, x.index[:, :, None].expand(-1, -1, logits.shape[-1]))
    suffix = x.suffix_ids.shape[1] > 0
    last, cache = prompt_cache(model, x.prefix_ids, x.prefix_mask, x.group if suffix else None)
    first = last[x.group][:, None]  # scores response token 0
    if not suffix:
        return first[:, : batch.targets.shape[1]]  # responses of at most one token (or none)
    mask = torch.cat([x.prefix_mask[x.group], x.suffix_mask], dim=1)
    rest = model(input_ids=x.suffix_ids, attention_mask=mask, position_ids=x.suffix_pos,
                 past_key_values=cache, use_cache=True).logits
    return torch.cat([first, rest], dim=1)


def flat_outputs(model: torch.nn.Module, x: Flat, lm: bool) -> torch.Tensor:
    """[K, C] a model's outputs at the kept positions. ``lm``: a causal LM whose head runs only
    there (``logits_to_keep``); else a token-level head (a value model: one number per position,
    cheap everywhere) read there. One call through the model's own forward (FSDP's and DeepSpeed's
    hooks gather the parameters there) with no attention mask and no cache: what makes
    transformers confine attention to each sample."""
    with x.cp.over() if x.cp is not None else contextlib.nullcontext(), image_placeholders(model, x.images):
        if lm:
            return model(**x.forward_kwargs(), logits_to_keep=x.keep).logits[0]
        return model(**x.forward_kwargs()).logits[0, x.keep]


def spread(values: torch.Tensor, x: Flat, batch: int) -> torch.Tensor:
    """[B, R] float32 from per-kept-position values (``flat_outputs`` order), 0 on padding; the
    gradient flows back to ``values``. A context-parallel slice's values are summed over its
    group (each position is kept on exactly one rank), so every rank holds the whole [B, R]."""
    out = torch.zeros(batch * x.width, device=x.where.device).index_copy(0, x.where, values.float())
    return (out if x.cp is None else x.cp.sum(out)).view(batch, x.width)


def response_logprobs(model: torch.nn.Module, batch: Packed, entropy: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(log-probs [B, R], entropy [B, R] or None, logits [B, R, V] or None) of the response tokens.

    ``Flat`` inputs: the LM head only at the scoring positions and log-probs (and, with
    ``entropy``, the entropy) from ``chunked_logprobs``; no logits are returned. Else the
    logits of ``response_logits`` in fp32, returned for whoever needs the full distribution."""
    x, B = batch.inputs, batch.targets.shape[0]
    if isinstance(x, Flat):
        logits = flat_outputs(model, x, lm=True)
        logp, ent = chunked_logprobs(logits, batch.targets.reshape(-1)[x.where], entropy)
        return spread(logp, x, B), spread(ent, x, B) if ent is not None else None, None
    full = response_logits(model, batch).float()
    return token_logprobs(full, batch.targets), None, full


def unpack(per_token: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """Per-sample response-token values from a [B, R] tensor (views of one new tensor)."""
    out = per_token.detach().float().cpu()
    n = torch.tensor(lengths, dtype=torch.long)
    return list(out[_positions(n, torch.zeros_like(n))].split(lengths))
