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


CONTROLLER_YOUNG = 100_000
"""The controller's generation-0 threshold (Python's default: 700 allocations)."""


def fewer_collections(young: int = CONTROLLER_YOUNG) -> None:
    """Collect the youngest generation every ``young`` net allocations instead of every 700, the
    older ones as before (every 10 collections of the one below).

    For the controller: its step allocates a few small objects per sample and per rank (where each
    field is held, each rank's command and record), nearly all freed by reference counting within
    the step. With the default threshold a collection ran every 700 of them, and every tenth
    of every tenth walked everything the step still held: collections a step grew with the samples,
    each one's work too, so the collector's share grew with the square of the world (at 1024 ranks,
    a fifth of the controller's CPU). Each collection now walks at most ``young`` new objects, a few
    milliseconds, a few times a step."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, old)
