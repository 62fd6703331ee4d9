"""Ulysses context parallelism's row bookkeeping (the collectives run in tests/dist/scripts/ulysses.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rlbatch.engines import ulysses


def test_a_packed_rows_samples_are_found_from_their_positions() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]])
    assert ulysses._boundaries(positions).tolist() == [0, 3, 5, 6, 8]
    mask = ulysses._block_causal(positions)
    assert mask[2].tolist() == [True, True, True, False, False, False, False, False]
    assert mask[4].tolist() == [False, False, False, True, True, False, False, False]  # its own sample only
    assert mask[5].tolist() == [False] * 5 + [True, False, False]


def test_padded_length_rounds_up_to_the_group() -> None:
    assert [ulysses.padded_length(n, 4) for n in (1, 4, 5, 22)] == [4, 4, 8, 24]


def test_a_row_that_does_not_split_evenly_is_refused_with_the_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    assert ulysses.local(torch.arange(8)[None], None).tolist() == [[2, 3]]  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a row of 22 tokens does not split over 4 context-parallel ranks; pad it to 24"):
        ulysses.local(torch.zeros(1, 22), None)  # type: ignore[arg-type]


def test_attention_outside_a_split_forward_says_so() -> None:
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="outside ulysses.over"):
        ulysses.ulysses_attention(torch.nn.Identity(), q, q, q, None)
