"""Move an engine's device state to host memory and back, bit for bit (for engines whose state is
torch tensors: fsdp, hf; an engine with its own offload, such as vLLM's sleep mode, implements
``offload``/``reload`` its own way).

A ``TensorStash`` holds one host buffer per tensor, allocated on first offload and reused on
every later one (pinned when the device is a GPU, so copies are asynchronous DMA). Offload
copies every tensor into its buffer without waiting, synchronises once, then frees the device
storage with ``untyped_storage().resize_(0)`` — the tensor objects stay alive, so the module,
the optimizer and FSDP keep their references. Reload re-grows each storage and copies back.

The same code runs on a CPU-only machine (host to host), so CI exercises it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

KINDS = ("params", "grads", "optimizer", "kv_cache")
"""The kinds of device state an engine exposes."""


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The storage-owning local tensor of a DTensor (FSDP2 shard), or the tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return (local if local is not None else t).detach()


@dataclass
class Transfer:
    """What one offload or reload moved, and how long it took."""

    bytes: int = 0
    seconds: float = 0.0
    tensors: int = 0

    def __iadd__(self, other: Transfer) -> Transfer:
        self.bytes += other.bytes
        self.seconds += other.seconds
        self.tensors += other.tensors
        return self


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bytes_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over a whole storage: padding and every view into it included."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))


class TensorStash:
    """Host copies of a changing set of tensors' storages.

    ``tensors`` is a callable because the set changes (gradients appear after the first
    backward, optimizer states after the first step). Buffers are matched to storages by
    position in that (deterministic) order and reallocated only when a size changes, so
    steady-state steps allocate nothing. Whole storages are moved, not views: an FSDP2 shard
    can be a view into a padded storage that FSDP reads in full.
    """

    def __init__(self, name: str, tensors: Callable[[], Iterable[torch.Tensor]]) -> None:
        self.name = name
        self._tensors = tensors
        self._host: list[torch.Tensor] = []
        self._offloaded: list[tuple[torch.UntypedStorage, torch.device, int]] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._offloaded)

    def host_bytes(self) -> int:
        return sum(b.numel() for b in self._host)

    def _buffer(self, i: int, nbytes: int, device: torch.device) -> torch.Tensor:
        if i == len(self._host):
            self._host.append(torch.empty(0, dtype=torch.uint8))
        if self._host[i].numel() != nbytes:
            self._host[i] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        return self._host[i]

    def offload(self) -> Transfer:
        """Copy every storage to its host buffer, sync once, free the device storage."""
        if self._offloaded:
            return Transfer()
        start = time.perf_counter()
        seen: set[int] = set()
        moved: list[tuple[torch.UntypedStorage, torch.device, int]] = []
        for t in self._tensors():
            lt = local_tensor(t)
            storage = lt.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue  # freed already, or shared with a tensor stashed before
            seen.add(storage.data_ptr())
            if not storage.resizable():
                raise RuntimeError(f"offload {self.name}: a tensor of shape {tuple(lt.shape)} has storage that cannot be "
                                   f"freed (memory-mapped?); give the engine tensors that own their memory")
            i = len(moved)
            self._buffer(i, storage.nbytes(), lt.device).copy_(_bytes_view(storage, lt.device), non_blocking=True)
            moved.append((storage, lt.device, i))
        for d in {d for _, d, _ in moved}:
            _sync(d)
        nbytes = 0
        for storage, _, _ in moved:
            nbytes += storage.nbytes()
            storage.resize_(0)
        self._offloaded = moved
        return Transfer(nbytes, time.perf_counter() - start, len(moved))

    def reload(self) -> Transfer:
        """Re-grow every storage and copy its bytes back; the tensors are as before offload."""
        if not self._offloaded:
            return Transfer()
        start = time.perf_counter()
        nbytes = 0
        for storage, device, i in self._offloaded:
            buf = self._host[i]
            storage.resize_(buf.numel())
            _bytes_view(storage, device).copy_(buf, non_blocking=True)
            nbytes += buf.numel()
        for d in {d for _, d, _ in self._offloaded}:
            _sync(d)
        moved = len(self._offloaded)
        self._offloaded = []
        return Transfer(nbytes, time.perf_counter() - start, moved)


def optimizer_tensors(opt: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                yield v


def grad_tensors(module: torch.nn.Module) -> Iterable[torch.Tensor]:
    for p in module.parameters():
        if p.grad is not None:
            yield p.grad


class Stashes:
    """An engine's offloadable state by kind, each a ``TensorStash``: what an engine built on torch
    tensors delegates its ``offload(kinds)`` / ``reload(kinds)`` to."""

    def __init__(self, stashes: Mapping[str, TensorStash]) -> None:
        unknown = set(stashes) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown state kinds {sorted(unknown)}; kinds are {KINDS}")
        self.by_kind = dict(stashes)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.by_kind)

    def add(self, kind: str, stash: TensorStash) -> None:
        self.by_kind[kind] = stash

    def offload(self, kinds: Iterable[str]) -> Transfer:
        out = Transfer()
        for kind in kinds:
            if kind in self.by_kind:
                out += self.by_kind[kind].offload()
        return out

    def reload(self, kinds: Iterable[str]) -> Transfer:
        out = Transfer()
        for kind in kinds:
            if kind in self.by_kind:
                out += self.by_kind[kind].reload()
        return out


class StashedState:
    """``state_kinds`` / ``offload`` / ``reload`` of the engine contract for an engine whose device
    state is a ``Stashes`` in ``self.state``."""

    state: Stashes

    @property
    def state_kinds(self) -> tuple[str, ...]:
        return self.state.kinds

    def offload(self, kinds: Iterable[str]) -> Transfer:
        return self.state.offload(kinds)

    def reload(self, kinds: Iterable[str]) -> Transfer:
        return self.state.reload(kinds)
