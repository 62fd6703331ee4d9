"""The planner's model of partial rollouts with in-flight weight updates (``algo.partial_rollouts``
with ``algo.in_flight_updates``, docs/async.md "Partial rollouts").

The inference engine keeps its requests across steps, and a step's batch is the first
``prompts_per_step`` whole groups to finish: the longest samples are not waited for, they go on
generating into a later step's batch. In the steady state each generate command therefore makes
one batch's worth of samples at the mean response length, with the engine's batch kept full by
the samples carried over: what the generation model gives for a workload whose every response is
the mean length (``tail_free``). The weights land between engine steps, so the sync pauses the
generation for as long as it takes and the trainer sends it after its own phases:

    step = max(generation without the tail, the rest of the step) + sync

(``step_time``): the inference side makes a batch and takes the sync, the trainer side trains and
sends it, each step. Generation-bound it is the tail-free generation plus the sync; train-bound
it is the trainer's phases plus the sync, whatever the tail. ``predict`` applies it where
asynchronous training runs ahead at all (actor_infer on GPUs of its own).
"""

from __future__ import annotations

import math
from dataclasses import replace

from rlbatch.plan.workload import Workload


def tail_free(w: Workload) -> Workload:
    """``w`` as one generate command of partial rollouts sees it: every response the mean length
    (the decode steps of one batch at the mean, the engine's batch full throughout)."""
    steps = max(1, math.ceil(w.response_mean))
    return replace(w, response_max=steps)


def step_time(generate_s: float, rest_s: float, sync_s: float) -> float:
    """One step of partial rollouts with in-flight updates: the generation of the next batch
    (``generate_s``, tail-free) beside the rest of the step (``rest_s``: the trainer's and the
    scorers' phases), then the sync, which both sides take part in."""
    if min(generate_s, rest_s, sync_s) < 0:
        raise ValueError(f"step_time: negative phase time (generate {generate_s}, rest {rest_s}, sync {sync_s})")
    return max(generate_s, rest_s) + sync_s
