"""Move an engine's device state to host memory and back, bit for bit (for engines whose state is
torch tensors: fsdp, hf; an engine with its own offload, such as vLLM's sleep mode, implements
``offload``/``reload`` its own way).

A ``TensorStash`` holds one host arena (``HostArena``): a single host allocation that every
storage of the stash is copied into at its own aligned offset, allocated on the first offload,
reused on every later one, and grown (once, to the new total) only when the state grows, such as
the optimizer state that appears after the first step. On a GPU the arena is page-locked, so
copies are asynchronous DMA; one allocation per stash, not one per tensor, because each
page-locking call is slow and many small pinned blocks fragment host memory. Offload copies every
tensor into the arena without waiting, synchronises once, then frees the device storage with
``untyped_storage().resize_(0)`` — the tensor objects stay alive, so the module, the optimizer
and FSDP keep their references. Reload re-grows each storage and copies back.

The same code runs on a CPU-only machine (host to host, the arena not pinned), so CI exercises it.

An inference engine whose library offloads for it (vLLM, SGLang) measures what moved with
``free_device_bytes`` before and after, and where the library cannot release memory (on CPU) its
offload is a ``StaysResident``: nothing moves, and a warning says so once.
"""

from __future__ import annotations

import logging
import mmap
import time
import weakref
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


def free_device_bytes(device: torch.device) -> int:
    """Free memory of a CUDA device, PyTorch's cached blocks released first: vLLM's sleep and
    wake-up release them too (``CuMemAllocator``), which would otherwise count as the engine's own
    bytes."""
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info(device)[0])


class StaysResident:
    """The offload of an engine that cannot release its device memory where it runs: moves
    nothing, and logs ``warning`` to ``log`` the first time it is called."""

    def __init__(self, log: logging.Logger, warning: str) -> None:
        self.log = log
        self.warning = warning
        self.warned = False

    def __call__(self) -> Transfer:
        if not self.warned:
            self.log.warning(self.warning)
            self.warned = True
        return Transfer()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bytes_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over a whole storage: padding and every view into it included."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),), (1,))


ALIGN = 512
"""Byte alignment of each storage's place in an arena: a multiple of every element size, so a view
of any dtype could be taken there, and of the 512-byte granularity of CUDA's allocator."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _unregister(ptr: int, buffer: torch.Tensor) -> None:
    """Unlock the pages at ``ptr``; ``buffer`` (held until then) is the memory they belong to."""
    torch.cuda.cudart().cudaHostUnregister(ptr)


class HostArena:
    """One host buffer, grown only: ``reserve(nbytes)`` returns it, reallocated only when it is
    smaller than ``nbytes``. Pinned (page-locked) when asked: an ordinary allocation registered
    with CUDA in place, over whole pages that lie inside it (as torch's checkpoint stager pins its
    buffers, ``torch.distributed.checkpoint._state_dict_stager``). Not ``torch.empty(pin_memory=True)``:
    torch's pinned allocator rounds every allocation up to a power of two
    (``CachingHostAllocator``), which for one arena of a large model's state would lock up to twice
    its bytes."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.pinned = False
        self.allocations = 0
        """Host allocations made so far (one per growth)."""
        self._unpin: weakref.finalize | None = None

    def reserve(self, nbytes: int, pin: bool) -> torch.Tensor:
        if nbytes == 0 or (nbytes <= self.buffer.numel() and (self.pinned or not pin)):
            return self.buffer
        self.release()
        if pin:
            page = mmap.PAGESIZE
            span = -(-nbytes // page) * page
            raw = torch.empty(span + page, dtype=torch.uint8)
            start = -raw.data_ptr() % page
            buffer = raw[start : start + span]  # whole pages of this allocation only: none shared with another
            err = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), span, 1))  # 1: portable
            if err:
                raise RuntimeError(f"page-locking a host buffer of {span} bytes failed with CUDA error {err}")
            # Unregistered before the memory goes: on a growth, or when the arena is collected.
            self._unpin = weakref.finalize(self, _unregister, buffer.data_ptr(), buffer)
            self._unpin.atexit = False  # at exit the driver releases it with the process
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.buffer, self.pinned = buffer, pin
        self.allocations += 1
        return buffer

    def release(self) -> None:
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        self.buffer, self.pinned = torch.empty(0, dtype=torch.uint8), False


class TensorStash:
    """Host copies of a changing set of tensors' storages, in one ``HostArena``.

    ``tensors`` is a callable because the set changes (gradients appear after the first
    backward, optimizer states after the first step). Each offload lays the storages out in that
    (deterministic) order at aligned offsets; the arena is reallocated only when the total
    exceeds it, so steady-state steps allocate nothing. Whole storages are moved, not views: an
    FSDP2 shard can be a view into a padded storage that FSDP reads in full.
    """

    def __init__(self, name: str, tensors: Callable[[], Iterable[torch.Tensor]]) -> None:
        self.name = name
        self._tensors = tensors
        self.arena = HostArena()
        self._offloaded: list[tuple[torch.UntypedStorage, torch.device, int, int]] = []
        """(storage, its device, offset in the arena, bytes) of every storage offloaded."""

    @property
    def offloaded(self) -> bool:
        return bool(self._offloaded)

    def host_bytes(self) -> int:
        return int(self.arena.buffer.numel())

    def offload(self) -> Transfer:
        """Copy every storage to its place in the arena, sync once, free the device storage."""
        if self._offloaded:
            return Transfer()
        start = time.perf_counter()
        seen: set[int] = set()
        moved: list[tuple[torch.UntypedStorage, torch.device, int, int]] = []
        total = 0
        for t in self._tensors():
            lt = local_tensor(t)
            storage = lt.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue  # freed already, or shared with a tensor stashed before
            seen.add(storage.data_ptr())
            if not storage.resizable():
                raise RuntimeError(f"offload {self.name}: a tensor of shape {tuple(lt.shape)} has storage that cannot be "
                                   f"freed (memory-mapped?); give the engine tensors that own their memory")
            moved.append((storage, lt.device, total, storage.nbytes()))
            total = _aligned(total + storage.nbytes())
        arena = self.arena.reserve(total, pin=any(d.type == "cuda" for _, d, _, _ in moved))
        for storage, device, offset, n in moved:
            arena[offset : offset + n].copy_(_bytes_view(storage, device), non_blocking=True)
        for d in {d for _, d, _, _ in moved}:
            _sync(d)
        nbytes = 0
        for storage, _, _, n in moved:
            nbytes += n
            storage.resize_(0)
        self._offloaded = moved
        return Transfer(nbytes, time.perf_counter() - start, len(moved))

    def reload(self) -> Transfer:
        """Re-grow every storage and copy its bytes back; the tensors are as before offload."""
        if not self._offloaded:
            return Transfer()
        start = time.perf_counter()
        nbytes = 0
        arena = self.arena.buffer
        for storage, device, offset, n in self._offloaded:
            storage.resize_(n)
            _bytes_view(storage, device).copy_(arena[offset : offset + n], non_blocking=True)
            nbytes += n
        for d in {d for _, d, _, _ in self._offloaded}:
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
