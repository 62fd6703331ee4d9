"""Keep Python's cyclic garbage collector out of the step loop.

A rank holds hundreds of thousands of long-lived objects once it is set up (torch, transformers,
the engines' modules and tensors), and every full (generation 2) collection walks all of them:
on the CPU dev VM that took 90-400 ms, about every 16 steps of the default experiment, in the
middle of whatever phase was running (a 0.2 s step became 0.3 s). ``settle()``, called once the
engines are built, collects once and freezes what is left: ``gc.freeze`` moves it to a permanent
generation that later collections skip, so they walk only what the loop itself allocates
(the same remedy torchtitan and Megatron apply by managing collections themselves). Frozen
objects are still freed by reference counting; only cycles among them stay until exit.
"""

from __future__ import annotations

import gc
import time


def settle() -> tuple[int, float]:
    """Collect, then freeze every surviving object. Returns (objects frozen, seconds taken)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count(), time.perf_counter() - t0
