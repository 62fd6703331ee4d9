"""How much of the memory of some tensors is still allocated, without keeping any of it alive.

Weight-sync tests hand every tensor a consumer receives to ``Alive.saw`` and read ``peak``: the
most bytes those tensors' storages held at once, counted at each call. Storages are held weakly,
so a tensor the consumer dropped stops counting once freed, and so does an unsharded FSDP
parameter once resharded (its storage is resized to nothing). The memory of tensors never shown
to it is not counted.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef


class Alive:
    def __init__(self) -> None:
        self.refs: dict[int, StorageWeakRef] = {}
        self.peak = 0

    def saw(self, tensors: Iterable[torch.Tensor]) -> int:
        """Note these tensors; returns the bytes still allocated of all noted so far (one count per storage)."""
        for t in tensors:
            ref = StorageWeakRef(t.untyped_storage())
            self.refs[ref.cdata] = ref
        alive = 0
        for key, ref in list(self.refs.items()):
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if storage is None:
                del self.refs[key]
            else:
                alive += storage.nbytes()
        self.peak = max(self.peak, alive)
        return alive
