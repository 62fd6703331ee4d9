"""Weight sync across ranks: full weights broadcast from actor_train's first rank to actor_infer.

Weights travel as fp32 in buckets of about ``bucket_bytes``; receivers lay buckets out from
their own parameter list (same architecture, same order), so nothing but the tensors is sent.
Per bucket, the memory broadcast from and into is, in order of preference:

- the inference engine's own parameters, when ``weight_views`` gives them as one fp32 slice
  (the hf engine flattens its parameters so it can): no staging, no copy into the model;
- on the sender, a bucket's single tensor as it is, when it is already contiguous fp32 there;
- one staging buffer kept across buckets and syncs (grow-only), then ``load_weights`` from
  views into it. Keeping it saves allocating (and on CPU page-faulting) a bucket every sync;
  it holds at most one bucket.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlbatch.runtime.world import SYNC, World

WIRE_DTYPE = torch.float32
WIRE_BYTES = 4


def buckets(numels: list[int], bucket_bytes: int) -> list[tuple[int, int]]:
    """[start, stop) index ranges: consecutive tensors up to bucket_bytes, at least one each."""
    out, i = [], 0
    while i < len(numels):
        j, size = i, 0
        while j < len(numels) and (j == i or (size + numels[j]) * WIRE_BYTES <= bucket_bytes):
            size += numels[j]
            j += 1
        out.append((i, j))
        i = j
    return out


class WeightBroadcast:
    """Broadcasts full weights over the sync group; one per rank, reused for every sync."""

    def __init__(self) -> None:
        self._staging: torch.Tensor | None = None

    def staging(self, numel: int, device: torch.device) -> torch.Tensor:
        buf = self._staging
        if buf is None or buf.device != device or buf.numel() < numel:
            self._staging = None  # free the old buffer before allocating the larger one
            buf = self._staging = torch.empty(numel, dtype=WIRE_DTYPE, device=device)
        return buf[:numel]

    @torch.no_grad()
    def __call__(self, world: World, named: list[tuple[str, torch.Tensor]], infer: Any, src: int,
                 bucket_bytes: int) -> int:
        """Send ``named`` (on ``src``) or receive into ``infer``; returns the bytes broadcast."""
        dev, sender = world.device, world.rank == src
        if sender:
            names, shapes = [n for n, _ in named], [t.shape for _, t in named]
        else:
            names, shapes = list(infer.params), [p.shape for p in infer.params.values()]
        total = 0
        for i, j in buckets([s.numel() for s in shapes], bucket_bytes):
            numel = sum(s.numel() for s in shapes[i:j])
            flat = infer.weight_views(names[i:j], WIRE_DTYPE) if infer is not None else None
            loaded = as_is = False
            if flat is not None:
                loaded = True
            elif sender and j - i == 1 and _on_wire(named[i][1], dev):
                flat, as_is = named[i][1].reshape(-1), True
            else:
                flat = self.staging(numel, dev)
            if sender and not as_is:
                pos = 0
                for _, t in named[i:j]:
                    flat[pos : pos + t.numel()].view(t.shape).copy_(t)
                    pos += t.numel()
            world.check("broadcast weights", SYNC, dist.broadcast, flat, src=src, group=world.groups[SYNC])
            if infer is not None and not loaded:
                pos, chunk = 0, []
                for n, shape in zip(names[i:j], shapes[i:j], strict=True):
                    chunk.append((n, flat[pos : pos + shape.numel()].view(shape)))
                    pos += shape.numel()
                infer.load_weights(chunk)
            total += numel * WIRE_BYTES
        return total


def _on_wire(t: torch.Tensor, device: torch.device) -> bool:
    return t.dtype == WIRE_DTYPE and t.device == device and t.is_contiguous()
