"""Shared by the engine scripts: an engine's full weights, bitwise comparison, checkpoint round trips."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlbatch.checkpoint.dcp import load_state, save_state


def weights(e):  # type: ignore[no-untyped-def]
    """The engine's full HF-named weights, cloned."""
    with e.export_weights() as named:
        return {n: t.clone() for n, t in named}


def same(a, b, what):  # type: ignore[no-untyped-def]
    assert a.keys() == b.keys(), f"{what}: names differ: {sorted(a.keys() ^ b.keys())}"
    bad = [n for n in a if not torch.equal(a[n], b[n])]
    assert not bad, f"{what}: not bitwise equal: {bad[:5]}"


def checkpoint(e, path):  # type: ignore[no-untyped-def]
    save_state(path, e.checkpoint_state())
    dist.barrier()


def restore(e, path):  # type: ignore[no-untyped-def]
    e.load_checkpoint_state(load_state(path, e.checkpoint_state()))
