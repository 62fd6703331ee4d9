"""Weights that land in the middle of an SGLang generation (``algo.in_flight_updates``), on SGLang
itself (its CPU engine, with the stand-ins of tests/stand_ins): a look for a sync runs beside the
generation on SGLang's event loop; when one has begun the engine pauses SGLang's scheduler, receives
the sync on a thread of its own (in buckets, through ``load_weights``), labels the weights with the
sync's version and continues, so one sample holds tokens of both versions. With the KV cache kept
(``in_flight_kv=keep``, SGLang's ``in_place`` pause) the tokens after the load are sampled from the
new weights over the old weights' cache; with ``recompute`` (``retract``) the requests are prefilled
again and their log-probs are exactly the new weights'. Tokens before the load are the old weights'
either way. And the in-flight sync's receiving side in two parts (``pending``, then ``take``).

One engine, in a process of its own: the test sets how often SGLang's scheduler reports a request's
tokens so far (``SGLANG_FORCE_STREAM_INTERVAL``), which its processes read as they start."""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlbatch.config.compose import compose
from rlbatch.engines.base import EngineContext, Generation, SamplingParams
from rlbatch.engines.model import load_model, load_tokenizer
from rlbatch.engines.sglang import SGLangArgs
from tests.unit.in_flight_checks import check_landing
from tests.unit.infer_checks import run_in_a_process_of_its_own, sync_in_buckets

SEED = 1
STAND_INS = Path(__file__).resolve().parents[1] / "stand_ins"
LAND_AT = 4
"""The sync begins once a request has this many tokens (as SGLang's tokenizer manager has seen them)."""
pytestmark = pytest.mark.timeout(900)  # SGLang's start alone takes minutes on a loaded 2-core machine


def test_in_a_process_of_its_own() -> None:
    run_in_a_process_of_its_own(__file__, "sglang in-flight checks passed")


def test_a_notice_found_between_steps_is_received_by_the_sync_phase_when_the_generation_ends_first() -> None:
    """``pending`` keeps the notice it found; the sync phase takes that one, not the next."""
    from tests.unit.test_token_versions import _sides

    sender, infer, joined = _sides()
    engine = object()
    assert not infer.pending()
    sender.notify(version=4, bucket_bytes=64)
    sender.notify(version=5, bucket_bytes=32)
    assert infer.pending() and infer.pending() and joined == []  # found, not received: nothing joined yet
    assert infer.receive(engine) == (4, 100) and joined == [(1, 64)]
    assert infer.pending() and infer.take(engine) == 5 and joined[-1] == (1, 32)
    assert infer.receive(engine) == (5, 100) and not infer.pending()
    with pytest.raises(RuntimeError, match="without a pending sync"):
        infer.take(engine)


def test_validation_takes_sglang_workers_and_refuses_partial_rollouts(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from rlbatch.checks.validate import check
    from tests.unit.configs import default_config, problems, set_

    apart = set_(default_config(tmp_path), algo__in_flight_updates=True, algo__max_staleness=1,
                 roles__actor_train__device_mapping=[0], roles__actor_train__backend="fsdp:d1",
                 roles__reference__device_mapping=[0], roles__actor_infer__device_mapping=[1],
                 roles__actor_infer__backend="sglang:d1")
    check(apart, runnable=False)
    for kv in ("keep", "recompute"):
        check(set_(apart, algo__in_flight_kv=kv), runnable=False)
    tensor_parallel = set_(apart, roles__actor_infer__device_mapping=[1, 2], roles__actor_infer__backend="sglang:d1t2")
    check(tensor_parallel, runnable=False)  # the followers join each sync as it begins (SGLangFollower)
    # an engine that pauses between steps but whose tensor-parallel ranks could not all take a sync
    from rlbatch.engines import registry

    monkeypatch.setitem(registry.REGISTRY, "sglang", dataclasses.replace(registry.REGISTRY["sglang"], in_flight_tp=""))
    got = problems(tensor_parallel, runnable=False)
    assert got == ["algo.in_flight_updates: weights land mid-generation only into one-rank sglang workers: its 2 "
                   "tensor-parallel ranks have no engine step at which all of them can take a sync; use sglang:dN "
                   "(t=1), an engine that can (vllm), or set algo.in_flight_updates=false"], got
    monkeypatch.undo()
    got = problems(set_(apart, algo__max_staleness=2, algo__partial_rollouts=True), runnable=False)
    assert any(p.startswith("algo.partial_rollouts: the inference engine keeps unfinished samples across steps, but "
                            "roles.actor_infer.backend 'sglang:d1' generates each call's prompts to their end")
               for p in got), got
    got = problems(set_(apart, roles__actor_infer__backend="hf:d1"), runnable=False)
    assert any("roles.actor_infer's engine 'hf' generates each batch in one call with no point where weights can "
               "land: use one that pauses (sglang, vllm)" in p for p in got), got


class Landing:
    """``between_steps`` as ``rlbatch.loop.weightsync.landing`` gives it: a sync of version 4 begins
    once a request has ``LAND_AT`` tokens, and is received (in buckets, into one reused staging
    buffer, as a sync's receiving side loads it) when the engine asks."""

    def __init__(self, engine: Any, new: list[tuple[str, torch.Tensor]]) -> None:
        self.engine, self.new = engine, new
        self.looks, self.received_on = 0, None

    def pending(self) -> bool:
        self.looks += 1
        if self.received_on is not None:
            return False
        states = list(self.engine.engine.tokenizer_manager.rid_to_state.values())
        return any(len(s.output_ids) >= LAND_AT for s in states)

    def receive(self) -> int:
        self.received_on = threading.current_thread()
        sync_in_buckets(self.engine, self.new)
        return 4


def main() -> None:
    os.environ["SGLANG_FORCE_STREAM_INTERVAL"] = "2"  # a request's tokens so far reach the tokenizer manager every 2
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(STAND_INS), os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, str(STAND_INS))
    import cuda_only

    cuda_only.install()
    from rlbatch.engines.sglang.engine import SGLangEngine

    cfg = compose(["algo.in_flight_updates=true", "algo.max_staleness=1"])
    tok = load_tokenizer(cfg.model)
    engine = SGLangEngine(EngineContext("actor_infer", SGLangArgs(kv_cache_tokens=4096, max_num_seqs=64), cfg.model,
                                        cfg.algo, tok, torch.device("cpu"), seed=SEED))
    old = load_model(cfg.model, tok, SEED).eval()
    g = torch.Generator().manual_seed(11)
    new = [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=g)) for n, p in old.named_parameters()]
    check_landing(SimpleNamespace(cfg=cfg, tok=tok, engine=engine, old=old, new=new),
                  _generate_with_a_sync_landing, ("recompute", "keep"), SEED)
    engine.close()
    print("sglang in-flight checks passed", flush=True)


def _generate_with_a_sync_landing(engine: Any, prompts: list[list[int]],
                                  new: list[tuple[str, torch.Tensor]]) -> list[Generation]:
    """Generate at version 3; the sync of version 4 lands once a request has ``LAND_AT`` tokens."""
    hook = Landing(engine, new)
    engine.between_steps = hook
    try:
        gens = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=1.0, seed=5, version=3))
    finally:
        engine.between_steps = None
    assert hook.received_on is not None, f"the generation ended before the sync could land ({hook.looks} looks)"
    assert hook.received_on is not threading.main_thread()  # the loop went on serving SGLang meanwhile
    return gens


if __name__ == "__main__":
    main()
