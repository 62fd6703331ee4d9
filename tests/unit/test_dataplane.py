"""The data plane: its buffer pool reuses a buffer only once nothing refers to its memory, and
both ends of a move agree on the transport."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlbatch.runtime.dataplane import BufferPool, Move, SampleStore

CPU = torch.device("cpu")


def test_a_buffer_is_reused_only_after_every_view_of_it_is_gone() -> None:
    pool = BufferPool()
    buf = pool.take(1, torch.long, CPU, 100)
    buf.copy_(torch.arange(100))
    sample = buf[10:20]  # what the store keeps
    derived = sample[2:]  # and a view of it somebody made and still holds
    del buf, sample
    other = pool.take(1, torch.long, CPU, 100)
    other.fill_(-1)  # a second message while the first one's data is still in use
    assert torch.equal(derived, torch.arange(12, 20))
    ptr = other.data_ptr()
    del other
    again = pool.take(1, torch.long, CPU, 80)  # the free buffer comes back (smaller is fine)
    assert again.data_ptr() == ptr and again.numel() == 80
    del derived, again
    pool.take(1, torch.long, CPU, 100)  # the first buffer is free again: nothing new is allocated
    assert len(pool._bufs[(1, torch.long, CPU)]) == 2


def test_buffers_are_kept_per_peer_and_dtype_and_grow() -> None:
    pool = BufferPool()
    ptr = pool.take(1, torch.long, CPU, 10).data_ptr()
    assert pool.take(2, torch.long, CPU, 10).data_ptr() != ptr
    assert pool.take(1, torch.float32, CPU, 10).data_ptr() != ptr
    assert pool.take(1, torch.long, CPU, 10).data_ptr() == ptr
    bigger = pool.take(1, torch.long, CPU, 1000)
    assert bigger.numel() == 1000
    del bigger
    assert pool.take(1, torch.long, CPU, 500).numel() == 500
    assert len(pool._bufs[(1, torch.long, CPU)]) == 1  # the small one was let go for the larger


def test_both_ends_of_a_move_post_cpu_buffers_whatever_their_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process group of a GPU job is "cpu:gloo,cuda:nccl": a message goes over the backend of
    its buffer's device, so a GPU rank that sends a CUDA buffer posts on NCCL while a CPU worker
    (the reward scorer) waits on gloo, and the step hangs. Every pair must choose alike: the
    runtimes of a GPU rank (device cuda:0, no CUDA touched here) and of a CPU worker exchange the
    samples of a GPU -> CPU and a GPU -> GPU move over an in-memory wire that records the device of
    every buffer posted."""
    from rlbatch.loop.rank_runtime import RankRuntime

    wire: dict[tuple[int, int], list[torch.Tensor]] = {}
    posted: list[tuple[str, int, int, torch.device]] = []

    def isend(buf: torch.Tensor, dst: int) -> None:
        posted.append(("send", rank, dst, buf.device))
        wire.setdefault((rank, dst), []).append(buf.clone())

    def irecv(buf: torch.Tensor, src: int) -> None:
        posted.append(("recv", src, rank, buf.device))
        buf.copy_(wire[(src, rank)].pop(0))

    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(torch.distributed, "isend", isend)
    monkeypatch.setattr(torch.distributed, "irecv", irecv)
    devices = {0: torch.device("cuda", 0), 1: torch.device("cuda", 1), 8: CPU}  # two GPU ranks, a reward worker
    runtimes = {}
    for r, dev in devices.items():
        rt = object.__new__(RankRuntime)  # only what a move touches: the store and the world
        rt.store, rt.world = SampleStore(), SimpleNamespace(rank=r, device=dev, timeout_s=60.0, data_comm=None)
        runtimes[r] = rt
    sample = {"prompt": torch.tensor([5, 6, 7]), "response": torch.tensor([8, 9]),
              "behaviour_logprobs": torch.tensor([-0.5, -1.5])}
    for name, value in sample.items():
        runtimes[0].store.put(3, name, value)
    fields = list(sample)
    moves = [Move(0, 8, [3], ["prompt", "response"], [[3, 2]]), Move(0, 1, [3], fields, [[3, 2, 2]])]
    for rank in (0, 1, 8):  # senders first: the wire holds what they posted
        runtimes[rank].phase("score", (), moves, None)
    assert {(kind, src, dst) for kind, src, dst, _ in posted} == {
        ("send", 0, 8), ("recv", 0, 8), ("send", 0, 1), ("recv", 0, 1)}
    assert {dev for *_, dev in posted} == {CPU}, posted
    assert torch.equal(runtimes[8].store.samples[3]["response"], sample["response"])
    for name, value in sample.items():
        assert torch.equal(runtimes[1].store.samples[3][name], value), name
