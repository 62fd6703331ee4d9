"""heap.settle(): what exists at set-up is frozen out of later garbage collections."""

from __future__ import annotations

import gc

from rlbatch.runtime import heap


def test_settled_objects_are_skipped_by_collections_and_new_ones_are_not() -> None:
    try:
        before = [{"i": i} for i in range(1000)]
        frozen, secs = heap.settle()
        assert frozen >= 1000 and secs >= 0
        after = [{"i": i} for i in range(10)]
        tracked = {id(o) for o in gc.get_objects()}
        assert id(before) not in tracked and all(id(d) not in tracked for d in before[:10])
        assert id(after) in tracked
        cycle: list[object] = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1  # what the loop allocates is still collected
    finally:
        gc.unfreeze()
