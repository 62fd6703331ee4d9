"""The sglang inference engine on SGLang itself (its CPU engine here, with the stand-ins of
tests/stand_ins for the CUDA-only modules it imports): greedy output equals transformers' token for
token before and after a bucketed weight sync through one reused staging buffer, behaviour log-probs
equal a transformers forward's, a half-done sync is refused, and validation refuses what the engine
cannot run before start.

One engine serves the module (SGLang starts a scheduler and a detokenizer process: 20-120 s on a
loaded 2-core machine). ``make venv`` installs SGLang (docs/sglang.md): without it these tests
fail, they do not skip (but on a GPU machine, where SGLang has an environment of its own)."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlbatch.config.compose import compose
from rlbatch.engines.base import EngineContext, SamplingParams
from rlbatch.engines.hf import HFArgs
from rlbatch.engines.hf.engine import HFInferenceEngine
from rlbatch.engines.model import load_model, load_tokenizer
from rlbatch.engines.sglang import SGLangArgs
from rlbatch.engines.sglang import rules as sglang_rules
from rlbatch.engines.sglang.engine import SGLangEngine
from tests.unit.infer_checks import assert_behaviour_logprobs_match_transformers, sync_in_buckets

# On a GPU machine SGLang lives in an environment of its own, not beside vLLM (docs/sglang.md): there
# these tests run in that environment; everywhere else `make venv` installs it and they must run.
pytestmark = [pytest.mark.skipif(
    torch.cuda.is_available() and importlib.util.find_spec("sglang") is None,
    reason="a GPU machine's SGLang is in its own environment (docs/sglang.md)")]
SEED = 1
STAND_INS = Path(__file__).resolve().parents[1] / "stand_ins"


@contextmanager
def stand_ins() -> Iterator[None]:
    """The CUDA-only stand-ins in this process and, through ``PYTHONPATH``, in every process it
    starts (SGLang's scheduler and detokenizer); on exit the process is as before (the environment,
    ``sys.path``, the modules), so tests after these import without them."""
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "SGLANG_USE_CPU_ENGINE")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(STAND_INS), saved["PYTHONPATH"]) if p)
    sys.path.insert(0, str(STAND_INS))
    import cuda_only

    cuda_only.install()
    try:
        yield
    finally:
        cuda_only.uninstall()
        sys.path.remove(str(STAND_INS))
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def setup() -> Iterator[Any]:
    with stand_ins():
        cfg = compose([])
        tok = load_tokenizer(cfg.model)
        before = process_state()
        engine = SGLangEngine(EngineContext("actor_infer", SGLangArgs(kv_cache_tokens=4096, max_num_seqs=64),
                                            cfg.model, cfg.algo, tok, torch.device("cpu"), seed=SEED))
        yield SimpleNamespace(cfg=cfg, tok=tok, engine=engine, process_before=before, process_after=process_state())
        engine.close()


def _new_weights(model: Any) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=g)) for n, p in model.named_parameters()]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_are_those_of_a_transformers_forward(setup: Any, temperature: float) -> None:
    """Against the engine's start-up weights (this runs before the sync test, which changes them)."""
    tok = setup.tok
    assert_behaviour_logprobs_match_transformers(setup.engine, setup.cfg, tok, SEED,
                                                 [tok.encode(f"{k}+{k}=") for k in range(4)] * 2, temperature)


def test_each_call_samples_from_its_seed(setup: Any) -> None:
    """The scheduler's RNGs are reseeded with each call's seed (rlbatch's SGLang plugin): a call
    with a seed samples what an earlier call with that seed did, whatever ran between them, so a
    resumed run's samples are the uninterrupted run's."""
    tok = setup.tok
    prompts = [tok.encode(f"{k}+{k}=") for k in range(4)] * 2
    params = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=s) for s in (5, 6)]
    first = [g.tokens for g in setup.engine.generate(prompts, params[0])]
    other = [g.tokens for g in setup.engine.generate(prompts, params[1])]
    again = [g.tokens for g in setup.engine.generate(prompts, params[0])]
    assert again == first and other != first


def test_greedy_after_a_bucketed_sync_equals_transformers(setup: Any) -> None:
    """Weight sync's receiving side: buckets broadcast into one staging buffer that the next bucket
    overwrites; SGLang gets each bucket before the next is written."""
    cfg, tok, engine = setup.cfg, setup.tok, setup.engine
    hf = HFInferenceEngine(EngineContext("actor_infer", HFArgs(), cfg.model, cfg.algo, tok, torch.device("cpu"), seed=SEED))
    prompts = [tok.encode(f"{k}*{k + 1}=") for k in range(6)]
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    before = [g.tokens for g in engine.generate(prompts, greedy)]
    assert before == [g.tokens for g in hf.generate(prompts, greedy)]
    named = _new_weights(hf.model)
    sync_in_buckets(engine, named)
    hf.load_weights(named)
    want = [g.tokens for g in hf.generate(prompts, greedy)]
    assert want != before  # the new weights change the answers: the check below sees the sync
    assert [g.tokens for g in engine.generate(prompts, greedy)] == want
    with pytest.raises(KeyError, match="not parameters"):
        engine.load_weights([("model.no_such.weight", torch.zeros(2))])


def test_generate_refuses_a_half_done_sync_and_offload_on_cpu_stays_resident(setup: Any) -> None:
    engine, named = setup.engine, _new_weights(load_model(setup.cfg.model, setup.tok, SEED))
    engine.load_weights(named[:3])
    with pytest.raises(RuntimeError, match="incomplete weight sync"):
        engine.generate([[1, 5]], SamplingParams(max_new_tokens=2))
    engine.load_weights(named[3:])
    assert engine.offload(engine.state_kinds).bytes == 0
    assert engine.reload(engine.state_kinds).bytes == 0
    assert engine.generate([[1, 5]], SamplingParams(max_new_tokens=2))[0].tokens


def process_state() -> dict[str, Any]:
    """What SGLang's Engine reconfigures in the process it starts in."""
    import asyncio
    import multiprocessing
    import signal

    root = logging.getLogger()
    return {"logging": (root.handlers[:], root.level), "start method": multiprocessing.get_start_method(),
            "loop policy": type(asyncio.get_event_loop_policy()),
            **{s.name: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGQUIT, signal.SIGINT, signal.SIGCHLD)}}


def test_the_ranks_process_is_left_as_it_was(setup: Any) -> None:
    """SGLang reconfigures the root logger as it starts (its level and format: a rank's log lines
    would change or stop), SIGTERM and SIGQUIT (its event loop's handlers), the asyncio loop policy
    and multiprocessing's start method (spawn: a vLLM engine started later in the process died of it)."""
    assert setup.process_after == setup.process_before


def test_validation_refuses_sglang_where_it_cannot_start(cfg: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from rlbatch.checks.validate import check
    from tests.unit.configs import problems, set_

    c = set_(cfg, cluster__device="cpu", roles__actor_infer__backend="sglang:d2")
    monkeypatch.setattr(sglang_rules, "_kernel_importable", lambda: False)
    assert problems(c) == [
        "roles.actor_infer.backend: 'sglang:d2' on CPU runs SGLang's CPU engine, which imports sgl_kernel's CPU "
        "kernels at start-up; no CPU build of sgl_kernel is published (its wheels link CUDA). Run on a GPU, or with "
        "tests/stand_ins on PYTHONPATH as the tests do (docs/sglang.md)"]
    check(c, runnable=False)  # the planner models it anywhere
    monkeypatch.setattr(sglang_rules, "_kernel_importable", lambda: True)
    check(c)
    real = sglang_rules.importlib.util.find_spec
    monkeypatch.setattr(sglang_rules.importlib.util, "find_spec", lambda n, *a: None if n == "sglang" else real(n, *a))
    assert problems(c)[0].startswith("roles.actor_infer.backend: 'sglang:d2' needs the sglang package, which is not "
                                     "installed")
