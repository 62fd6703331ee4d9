"""Offload/reload moves a role's state to host memory and back, bit for bit, in one host arena per
stash that is allocated once and reused."""

from __future__ import annotations

import gc
import mmap
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from rlbatch.engines import offload
from rlbatch.engines.offload import HostArena, TensorStash, grad_tensors, optimizer_tensors


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    model(torch.randn(4, 5)).sum().backward()  # leave gradients in place
    return model, opt


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.detach().clone() for t in [*model.parameters(), *grad_tensors(model), *optimizer_tensors(opt)]]


def test_round_trip_is_bit_exact_and_frees_storage() -> None:
    model, opt = _model_and_optimizer()
    before = _snapshot(model, opt)
    stashes = [TensorStash("params", model.parameters), TensorStash("grads", lambda: grad_tensors(model)),
               TensorStash("optimizer", lambda: optimizer_tensors(opt))]
    moved = [s.offload() for s in stashes]
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert moved[0].bytes == sum(p.numel() * 4 for p in model.parameters())
    assert moved[2].bytes == 2 * moved[0].bytes  # AdamW: exp_avg and exp_avg_sq
    back = [s.reload() for s in stashes]
    assert [m.bytes for m in moved] == [b.bytes for b in back]
    after = _snapshot(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_buffers_are_reused_and_training_continues() -> None:
    model, opt = _model_and_optimizer()
    stash = TensorStash("params", model.parameters)
    stash.offload()
    stash.reload()
    first = stash.arena.buffer.data_ptr()
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 5)).sum().backward()
        opt.step()
        stash.offload()
        stash.reload()
    assert stash.arena.buffer.data_ptr() == first, "the host arena must be reused across steps"


def test_offload_twice_and_reload_twice_are_no_ops() -> None:
    model, _ = _model_and_optimizer()
    stash = TensorStash("params", model.parameters)
    assert stash.offload().bytes > 0
    assert stash.offload().bytes == 0
    assert stash.reload().bytes > 0
    assert stash.reload().bytes == 0


@contextmanager
def _host_allocations() -> Iterator[list[int]]:
    """Sizes of the host tensors allocated inside the block (every torch.empty of at least a byte)."""
    sizes: list[int] = []
    real = torch.empty

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = real(*args, **kwargs)
        if t.device.type == "cpu" and t.numel():
            sizes.append(t.numel() * t.element_size())
        return t

    torch.empty = counting
    try:
        yield sizes
    finally:
        torch.empty = real


def _cycle(stash: TensorStash) -> int:
    """Offload and reload once; the number of host allocations that took."""
    with _host_allocations() as sizes:
        stash.offload()
        stash.reload()
    return len(sizes)


def test_one_host_allocation_per_stash_across_steps_and_one_more_when_the_state_grows() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stashes = {"params": TensorStash("params", model.parameters), "grads": TensorStash("grads", lambda: grad_tensors(model)),
               "optimizer": TensorStash("optimizer", lambda: optimizer_tensors(opt))}
    counts = {k: _cycle(s) for k, s in stashes.items()}  # before the first step: no gradients, no AdamW state
    assert counts == {"params": 1, "grads": 0, "optimizer": 0}, counts
    for _ in range(4):  # gradients and AdamW state appear at the first step, then keep their sizes
        opt.zero_grad()
        model(torch.randn(4, 5)).sum().backward()
        opt.step()
        for k, s in stashes.items():
            counts[k] += _cycle(s)
    assert counts == {"params": 1, "grads": 1, "optimizer": 1}, counts  # 4, 4 and 8 storages
    assert stashes["optimizer"].host_bytes() >= 2 * stashes["params"].host_bytes()

    grown = [torch.randn(3), torch.randn(5, dtype=torch.float64)]
    stash = TensorStash("grows", lambda: grown)
    allocations = _cycle(stash)
    grown.append(torch.arange(1000))  # the state grows: the arena is reallocated once, to the new total
    allocations += _cycle(stash)
    before = [t.clone() for t in grown]
    for _ in range(3):
        allocations += _cycle(stash)
    del grown[1:]  # and shrinks: it still fits
    allocations += _cycle(stash)
    assert allocations == 2 and stash.arena.allocations == 2
    assert torch.equal(grown[0], before[0])


def test_round_trip_of_storages_of_every_size_and_dtype_at_aligned_offsets_is_bit_exact() -> None:
    g = torch.Generator().manual_seed(1)
    base = torch.randn(11, generator=g)
    tensors = [torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g), torch.randn(5, generator=g).bfloat16(),
               base[2:7], base[8:], torch.randint(-9, 9, (7,), dtype=torch.int64, generator=g),
               torch.tensor([True, False, True]), torch.randn(2, 3, generator=g, dtype=torch.float64).t()]
    before = [t.clone() for t in tensors]
    stash = TensorStash("mixed", lambda: tensors)
    moved = stash.offload()
    assert moved.tensors == 6  # the two views of ``base`` share its storage: moved once
    assert moved.bytes == 3 + 10 + 44 + 56 + 3 + 48
    offsets = [offset for _, _, offset, _ in stash._offloaded]
    assert all(o % offload.ALIGN == 0 for o in offsets) and offsets == sorted(set(offsets))
    stash.reload()
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(tensors, before, strict=True))


class _FakeCudart:
    """Stands in for ``torch.cuda.cudart()`` on a machine without CUDA: records page-lock calls."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[str] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        assert ptr not in self.registered
        self.registered[ptr] = size
        self.calls.append("register")
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        del self.registered[ptr]
        self.calls.append("unregister")
        return 0


def test_a_pinned_arena_page_locks_whole_pages_of_its_own_once_per_growth(monkeypatch: pytest.MonkeyPatch) -> None:
    cudart = _FakeCudart()
    fake: Callable[[], _FakeCudart] = lambda: cudart  # noqa: E731
    monkeypatch.setattr(torch.cuda, "cudart", fake)
    page = mmap.PAGESIZE
    arena = HostArena()
    buf = arena.reserve(10_000, pin=True)
    (ptr, size), = cudart.registered.items()
    assert ptr == buf.data_ptr() and ptr % page == 0 and size % page == 0 and size >= 10_000
    assert buf.numel() == size  # the locked pages, all inside the arena's own allocation
    assert arena.reserve(size, pin=True).data_ptr() == ptr and arena.reserve(1, pin=True).data_ptr() == ptr
    arena.reserve(size + 1, pin=True)  # growth: the old pages are unlocked, the new ones locked
    assert cudart.calls == ["register", "unregister", "register"] and arena.allocations == 2
    (new_ptr, new_size), = cudart.registered.items()
    assert new_ptr == arena.buffer.data_ptr() and new_size >= size + 1
    del arena, buf
    gc.collect()
    assert cudart.registered == {}, "a collected arena unlocks its pages"
