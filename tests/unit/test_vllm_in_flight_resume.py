"""Partial rollouts across a checkpoint on vLLM itself (its CPU build here): the samples the engine
keeps between two ``generate_some`` calls are read (``kept_state``) and restored into an engine that
holds nothing (``restore_kept``), and the restored engine goes on exactly as the one that wrote
the state: the same samples returned by the same calls, with the same tokens, log-probs and token
versions, bit for bit, under the default ``algo.in_flight_kv=keep`` with weights that change between
the calls. Every sample started is returned once.

One engine, in a process of its own (vLLM takes ~30-60 s to start on a loaded 2-core machine): the
state is read after the first call, the run goes on to its end, and the same engine, now empty,
is restored and runs the same calls again."""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
import vllm  # noqa: F401  (installed by make venv: its absence is a broken install, not a skip)

from rlbatch.engines.base import Generation, SamplingParams
from rlbatch.engines.model import load_model
from rlbatch.engines.vllm.engine import VLLMEngine
from tests.unit.infer_checks import run_in_a_process_of_its_own
from tests.unit.test_vllm_in_flight import SEED, in_flight_engine

pytestmark = [pytest.mark.timeout(900), pytest.mark.full]  # vLLM starts slowly; the bookkeeping: test_in_flight_partial_resume.py
GROUP = 2
PROMPTS_PER_CALL = 4
MAX_NEW = 40


def test_in_a_process_of_its_own() -> None:
    run_in_a_process_of_its_own(__file__, "kept samples resume checks passed")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cfg, tok, engine = in_flight_engine(tmp, "algo.max_staleness=2", "algo.partial_rollouts=true")
        kept_samples_restored_go_on_bitwise(cfg, tok, engine)
        engine.close()
        print("kept samples resume checks passed", flush=True)
    os._exit(0)  # vLLM's one-rank world is left to process exit


def _later_weights(cfg: object, tok: object) -> list[tuple[str, torch.Tensor]]:
    """Version 4: the initial weights (version 3) plus noise."""
    m = load_model(cfg.model, tok, SEED).eval()  # type: ignore[attr-defined]
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return [(n, p.detach().clone()) for n, p in m.named_parameters()]


def _call(engine: VLLMEngine, tok: object, call: int, take: int) -> list[tuple[int, Generation]]:
    first = call * PROMPTS_PER_CALL * GROUP
    keys = list(range(first, first + PROMPTS_PER_CALL * GROUP))
    prompts = [tok.encode(f"{call}{i // GROUP}+{i // GROUP}=") for i in range(len(keys))]  # type: ignore[attr-defined]
    return engine.generate_some(keys, prompts, SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=5 + call,
                                                              version=3 + call), GROUP, take)


def _after_the_checkpoint(engine: VLLMEngine, tok: object, v4: list[tuple[str, torch.Tensor]],
                          ) -> list[list[tuple[int, Generation]]]:
    """The weights of version 4 (a sync between the calls), the second call, and calls with no new
    samples until the engine holds none: what each call returned."""
    engine.load_weights(v4)
    out = [_call(engine, tok, 1, 2)]
    drain = 0
    while engine.kept():
        out.append(engine.generate_some([], [], SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0,
                                                               seed=9 + drain, version=4), GROUP, 1))
        drain += 1
    return out


def kept_samples_restored_go_on_bitwise(cfg: object, tok: object, engine: VLLMEngine) -> None:
    v4 = _later_weights(cfg, tok)
    first = _call(engine, tok, 0, 1)
    assert engine._kept, "the first call answered with nothing left running: nothing to carry over a checkpoint"
    state = copy.deepcopy(engine.kept_state())
    running = [s for s in state["samples"] if not s["finished"]]
    assert running and any(s["tokens"] for s in running), "no sample in flight had tokens when the state was read"
    assert all(len(s["tokens"]) == len(s["logprobs"]) == len(s["versions"]) for s in state["samples"])
    assert sorted(s["key"] for s in state["samples"]) == sorted(
        set(range(PROMPTS_PER_CALL * GROUP)) - {k for k, _ in first}), "the state holds every sample not returned"
    uninterrupted = _after_the_checkpoint(engine, tok, v4)
    assert engine.kept() == 0
    engine.restore_kept(state)
    assert engine.kept() == len(state["samples"])
    resumed = _after_the_checkpoint(engine, tok, v4)

    order = [[k for k, _ in call] for call in uninterrupted], [[k for k, _ in call] for call in resumed]
    assert order[1] == order[0], order
    for a_call, b_call in zip(uninterrupted, resumed, strict=True):
        for (key, a), (_, b) in zip(a_call, b_call, strict=True):
            assert a.tokens == b.tokens, (key, a.tokens, b.tokens)
            assert a.versions == b.versions, (key, a.versions, b.versions)
            assert a.logprobs == b.logprobs, (key, [x - y for x, y in zip(a.logprobs, b.logprobs, strict=True)])
    returned = [k for k, _ in first] + [k for call in resumed for k, _ in call]
    assert sorted(returned) == list(range(2 * PROMPTS_PER_CALL * GROUP)), "every sample returned exactly once"
    carried = {s["key"] for s in running}
    spans = [g for call in resumed for k, g in call if k in carried and set(g.versions) == {3, 4}]
    assert spans, "no sample carried over the checkpoint has tokens of both versions"


if __name__ == "__main__":
    main()
