"""Partial rollouts on vLLM itself (its CPU build here): the engine keeps its requests across
generate calls (``VLLMEngine.generate_some``), each call answers with the first whole groups to
finish while longer samples go on generating, and weights land between engine steps. A sample
started under version v ends in a later call's answer with tokens of versions v..v+k, each token's
log-prob that of its own version's weights (``algo.in_flight_kv=recompute``); no sample is lost or
returned twice.

One engine, in a process of its own (vLLM takes ~30-60 s to start on a loaded 2-core machine)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace

import pytest
import torch
import vllm  # noqa: F401  (installed by make venv: its absence is a broken install, not a skip)

from rlbatch.engines.base import Generation, SamplingParams
from rlbatch.engines.model import load_model
from rlbatch.engines.vllm.engine import VLLMEngine
from tests.unit.in_flight_checks import forward_logprobs
from tests.unit.infer_checks import run_in_a_process_of_its_own
from tests.unit.test_vllm_in_flight import SEED, in_flight_engine

pytestmark = pytest.mark.timeout(900)  # vLLM's start alone takes minutes on a loaded 2-core machine
GROUP = 2
PROMPTS_PER_CALL = 4
MAX_NEW = 40


def test_in_a_process_of_its_own() -> None:
    run_in_a_process_of_its_own(__file__, "partial rollout checks passed")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cfg, tok, engine = in_flight_engine(tmp, "algo.max_staleness=2", "algo.partial_rollouts=true",
                                            "algo.in_flight_kv=recompute")
        a_long_sample_spans_calls_and_versions_and_no_sample_is_lost_or_duplicated(cfg, tok, engine)
        a_group_that_can_no_longer_be_trained_is_stopped_and_returned_at_once(tok, engine)
        engine.close()
        print("partial rollout checks passed", flush=True)
    os._exit(0)  # vLLM's one-rank world is left to process exit


def _models(cfg: object, tok: object) -> dict[int, torch.nn.Module]:
    """Version 3: the initial weights; 4 and 5: each the one before plus noise."""
    models = {3: load_model(cfg.model, tok, SEED).eval()}  # type: ignore[attr-defined]
    g = torch.Generator().manual_seed(11)
    for v in (4, 5):
        m = load_model(cfg.model, tok, SEED).eval()  # type: ignore[attr-defined]
        with torch.no_grad():
            for (_, p), (_, q) in zip(m.named_parameters(), models[v - 1].named_parameters(), strict=True):
                p.copy_(q + 0.05 * torch.randn(p.shape, generator=g))
        models[v] = m
    return models


def a_long_sample_spans_calls_and_versions_and_no_sample_is_lost_or_duplicated(cfg: object, tok: object,
                                                                                engine: VLLMEngine) -> None:
    models = _models(cfg, tok)
    prompt_of: dict[int, list[int]] = {}
    started: dict[int, int] = {}  # sample id -> the call that added it
    returned: dict[int, tuple[int, Generation]] = {}  # sample id -> (the call that returned it, generation)
    steps = [0]
    land = {4: 4, 14: 5}  # engine step (counted over all calls) -> the version loaded before it
    version = [3]

    def between_steps() -> int | None:
        steps[0] += 1
        v = land.get(steps[0])
        if v is None:
            return None
        engine.load_weights(list(models[v].named_parameters()))
        version[0] = v
        return v

    engine.between_steps = between_steps
    still_running_at_return = []
    try:
        for call in range(3):  # each call: PROMPTS_PER_CALL new groups, the first whole group to finish back
            first = call * PROMPTS_PER_CALL * GROUP
            keys = list(range(first, first + PROMPTS_PER_CALL * GROUP))
            prompts = [tok.encode(f"{call}{i // GROUP}+{i // GROUP}=") for i in range(len(keys))]  # type: ignore[attr-defined]
            prompt_of |= dict(zip(keys, prompts, strict=True))
            started |= dict.fromkeys(keys, call)
            got = engine.generate_some(keys, prompts, SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0,
                                                                     seed=5 + call, version=version[0]), GROUP, 1)
            assert len(got) == GROUP and got[0][0] // GROUP == got[1][0] // GROUP, [k for k, _ in got]
            for sid, gen in got:
                assert sid not in returned, f"sample {sid} returned twice"
                returned[sid] = (call, gen)
            # the call answered while samples it holds are still generating
            still_running_at_return.append(len(engine._kept))
        drain = 3
        while engine.kept():
            left = engine.kept() // GROUP
            for sid, gen in engine.generate_some([], [], SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0,
                                                                        seed=9, version=version[0]), GROUP, left):
                assert sid not in returned, f"sample {sid} returned twice"
                returned[sid] = (drain, gen)
            drain += 1
    finally:
        engine.between_steps = None
    assert steps[0] > max(land), f"the calls ended after {steps[0]} engine steps, before every sync landed"
    assert sorted(returned) == sorted(started), "every sample added is returned exactly once"
    assert all(n > 0 for n in still_running_at_return), still_running_at_return
    spanning = [sid for sid, (call, gen) in returned.items() if call > started[sid] and len(set(gen.versions)) > 1]
    assert spanning, "no sample started in one call ended in a later one with tokens of several versions"
    assert any(set(returned[sid][1].versions) == {3, 4, 5} for sid in spanning), \
        {sid: sorted(set(returned[sid][1].versions)) for sid in spanning}
    for _, gen in returned.values():
        assert len(gen.versions) == len(gen.tokens) == len(gen.logprobs)
        assert gen.versions == sorted(gen.versions) and set(gen.versions) <= {3, 4, 5}
    # each token's behaviour log-prob is its own version's weights' (recompute: prefilled again at each load)
    ids = sorted(returned)
    gens = [returned[sid][1] for sid in ids]
    prompts = [prompt_of[sid] for sid in ids]
    for v, model in models.items():
        want = forward_logprobs(model, tok, prompts, gens)
        for i, g in enumerate(gens):
            for j, tv in enumerate(g.versions):
                if tv == v:
                    assert abs(g.logprobs[j] - float(want[i, j])) < 1e-4, (ids[i], j, v, g.logprobs[j], float(want[i, j]))


def a_group_that_can_no_longer_be_trained_is_stopped_and_returned_at_once(tok: object, engine: VLLMEngine) -> None:
    """max_staleness=2: once the engine holds version 8, a kept group whose tokens are of version 5
    can never be trained (the controller would drop it): the next call stops its requests and
    returns it as it is, beside the groups asked for (none here), instead of generating it on."""
    assert engine.kept() == 0 and engine.bound == 2
    keys = list(range(1000, 1000 + PROMPTS_PER_CALL * GROUP))
    prompts = [tok.encode(f"9{i // GROUP}+{i // GROUP}=") for i in range(len(keys))]  # type: ignore[attr-defined]
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=21, version=5)
    first = engine.generate_some(keys, prompts, params, GROUP, 1)
    left = {sid for sid in keys if sid not in dict(first)}
    running = {key for key, _ in engine._kept.values()}
    assert running, "every group finished in the first call: nothing was left to stop"
    assert all(stamps and set(stamps) == {5} for _, stamps in engine._kept.values())
    stopped = engine.generate_some([], [], replace(params, version=8), GROUP, 0)
    assert {sid for sid, _ in stopped} == left  # the groups still running, and any finished in them
    for sid, gen in stopped:
        assert set(gen.versions) == {5} and len(gen.versions) == len(gen.tokens) == len(gen.logprobs) > 0
        assert len(gen.tokens) < MAX_NEW or sid not in running
    assert engine.kept() == 0 and not engine.llm.llm_engine.has_unfinished_requests()


if __name__ == "__main__":
    main()
