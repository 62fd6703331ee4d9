"""The data plane's buffer pool reuses a buffer only once nothing refers to its memory."""

from __future__ import annotations

import torch

from rlbatch.runtime.dataplane import BufferPool

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
