"""Weight sync across ranks: full weights broadcast from actor_train's first rank to actor_infer.

Weights travel in the inference engine's dtype (``wire_dtype``: bf16 for a bf16 engine on a GPU,
half the bytes of the trainer's fp32; the cast happens once, on the sender, as it would on load)
in buckets of about ``bucket_bytes``. The trainer exports ``(hf_name, tensor)`` pairs and the
inference engine loads them by name, whatever either does inside; the names and shapes (the
manifest) are broadcast once, on the first sync, and every later sync sends only tensors.
Per bucket, the memory broadcast from and into is, in order of preference:

- the inference engine's own parameters, when ``weight_views`` gives them as one slice of the
  wire dtype (the hf engine flattens its parameters so it can): no staging, no copy into the model;
- on the sender, a bucket's single tensor as it is, when it is already contiguous in the wire dtype;
- one staging buffer kept across buckets and syncs (grow-only), then ``load_weights`` from
  views into it. Keeping it saves allocating (and on CPU page-faulting) a bucket every sync;
  it holds at most one bucket.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlbatch.runtime.world import SYNC, World


def buckets(numels: list[int], bucket_bytes: int, element_bytes: int = 4) -> list[tuple[int, int]]:
    """[start, stop) index ranges: consecutive tensors up to bucket_bytes, at least one each."""
    out, i = [], 0
    while i < len(numels):
        j, size = i, 0
        while j < len(numels) and (j == i or (size + numels[j]) * element_bytes <= bucket_bytes):
            size += numels[j]
            j += 1
        out.append((i, j))
        i = j
    return out


class WeightBroadcast:
    """Broadcasts full weights over the sync group; one per rank, reused for every sync."""

    def __init__(self, wire_dtype: torch.dtype = torch.float32) -> None:
        self.wire_dtype = wire_dtype
        self._staging: torch.Tensor | None = None
        self._manifest: list[tuple[str, torch.Size]] | None = None

    def manifest(self, world: World, named: list[tuple[str, torch.Tensor]], src: int) -> list[tuple[str, torch.Size]]:
        """(hf_name, shape) of every tensor the sender exports, in order: broadcast on the first
        sync, then kept (the sender checks that its export has not changed)."""
        if world.rank == src:
            mine = [(n, t.shape) for n, t in named]
            if self._manifest is not None and mine != self._manifest:
                raise RuntimeError("weight sync: the exported weights changed names or shapes since the first sync")
        if self._manifest is None:
            box: list[Any] = [mine if world.rank == src else None]
            world.check("broadcast weight manifest", SYNC, dist.broadcast_object_list, box, src=src,
                        group=world.groups[SYNC])
            self._manifest = [(str(n), torch.Size(s)) for n, s in box[0]]
        return self._manifest

    def staging(self, numel: int, device: torch.device) -> torch.Tensor:
        buf = self._staging
        if buf is None or buf.device != device or buf.numel() < numel:
            self._staging = None  # free the old buffer before allocating the larger one
            buf = self._staging = torch.empty(numel, dtype=self.wire_dtype, device=device)
        return buf[:numel]

    @torch.no_grad()
    def __call__(self, world: World, named: list[tuple[str, torch.Tensor]], infer: Any, src: int,
                 bucket_bytes: int) -> int:
        """Send ``named`` (on ``src``) or receive into ``infer``; returns the bytes broadcast."""
        dev, sender = world.device, world.rank == src
        manifest = self.manifest(world, named, src)
        names, shapes = [n for n, _ in manifest], [s for _, s in manifest]
        total, wire, size = 0, self.wire_dtype, self.wire_dtype.itemsize
        for i, j in buckets([s.numel() for s in shapes], bucket_bytes, size):
            numel = sum(s.numel() for s in shapes[i:j])
            flat = infer.weight_views(names[i:j], wire) if infer is not None else None
            loaded = as_is = False
            if flat is not None:
                loaded = True
            elif sender and j - i == 1 and _on_wire(named[i][1], wire, dev):
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
            total += numel * size
        return total


def _on_wire(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> bool:
    return t.dtype == dtype and t.device == device and t.is_contiguous()
