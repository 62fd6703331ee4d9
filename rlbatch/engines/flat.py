"""Parameters laid out back to back in one buffer, so a run of them is one slice of memory.

An inference engine that flattens its parameters can hand weight sync that slice
(``span``) to receive a bucket into directly, instead of receiving into a staging buffer and
copying every tensor into the model.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def flatten_parameters(module: torch.nn.Module) -> None:
    """Move every parameter into one contiguous buffer per (device, dtype), in
    ``named_parameters`` order. Tied parameters stay tied (they are one Parameter)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
    for _, p in module.named_parameters():
        groups.setdefault((p.device, p.dtype), []).append(p)
    for (device, dtype), params in groups.items():
        flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
        pos = 0
        for p in params:
            view = flat[pos : pos + p.numel()].view(p.shape)
            view.copy_(p.data)
            p.data = view
            pos += p.numel()


def span(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor | None:
    """One 1-D tensor over ``tensors`` when they have this dtype and lie back to back in one
    storage in this order (writing to it writes them); otherwise None."""
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage()
    pos = first.storage_offset()
    for t in tensors:
        if (t.dtype != dtype or not t.is_contiguous() or t.storage_offset() != pos
                or t.untyped_storage().data_ptr() != storage.data_ptr()):
            return None
        pos += t.numel()
    total = pos - first.storage_offset()
    return torch.empty(0, dtype=dtype, device=first.device).set_(storage, first.storage_offset(), (total,), (1,))
