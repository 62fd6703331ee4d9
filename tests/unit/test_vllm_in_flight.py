"""Weights that land in the middle of a vLLM generation (``algo.in_flight_updates``), on vLLM itself
(its CPU build here): the engine pauses between two engine steps, loads a sync, and goes on with
the same sequences; each token records the policy version that sampled it, so one sample holds
tokens of both versions. With the KV cache kept (the default) the tokens after the load are
sampled from the new weights over the old weights' cache; with ``in_flight_kv=recompute`` the
sequences are prefilled again and their log-probs are exactly the new weights'. Tokens before the
load are the old weights' either way.

One engine, in a process of its own (vLLM takes ~30-60 s to start on a loaded 2-core machine)."""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import vllm  # noqa: F401  (installed by make venv: its absence is a broken install, not a skip)

from rlbatch.config.compose import compose
from rlbatch.engines.base import EngineContext, Generation, SamplingParams
from rlbatch.engines.model import load_model, load_tokenizer
from rlbatch.engines.vllm import VLLMArgs
from rlbatch.engines.vllm.engine import VLLMEngine
from tests.unit.in_flight_checks import check_landing
from tests.unit.infer_checks import run_in_a_process_of_its_own  # noqa: E402

SEED = 1
MODEL = ["model.num_heads=2", "model.num_kv_heads=1"]  # vLLM's CPU attention needs head_dim >= 32
pytestmark = pytest.mark.timeout(900)  # vLLM's start alone takes minutes on a loaded 2-core machine
LAND_AT = 5
"""The engine step before which the sync lands."""


def test_in_a_process_of_its_own() -> None:
    """vLLM's one-rank world is left to process exit (``VLLMEngine.close``): a second engine in a
    process that built one before (tests/unit/test_vllm_engine.py's) cannot start, so this runs
    ``main`` in a fresh interpreter."""
    run_in_a_process_of_its_own(__file__, "in-flight checks passed")


def in_flight_engine(tmp: str, *overrides: str) -> tuple[Any, Any, VLLMEngine]:
    """(config, tokenizer, engine): the tiny model's vLLM engine with in-flight updates and
    ``overrides``, in a one-rank world (its store in ``tmp``) made first, as on a rank."""
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    cfg = compose([*MODEL, "algo.in_flight_updates=true", *overrides])
    tok = load_tokenizer(cfg.model)
    engine = VLLMEngine(EngineContext("actor_infer", VLLMArgs(kv_cache_mb=64), cfg.model, cfg.algo, tok,
                                      torch.device("cpu"), seed=SEED))
    return cfg, tok, engine


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cfg, tok, engine = in_flight_engine(tmp, "algo.max_staleness=1")
        old = load_model(cfg.model, tok, SEED).eval()
        g = torch.Generator().manual_seed(11)
        new = [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=g)) for n, p in old.named_parameters()]
        check_landing(SimpleNamespace(cfg=cfg, tok=tok, engine=engine, old=old, new=new),
                      _generate_with_a_sync_landing, ("keep", "recompute"), SEED)
        engine.close()
        print("in-flight checks passed", flush=True)
    os._exit(0)  # vLLM's one-rank world is left to process exit


def _generate_with_a_sync_landing(engine: VLLMEngine, prompts: list[list[int]],
                                  new: list[tuple[str, torch.Tensor]]) -> list[Generation]:
    """Generate at version 3; before engine step ``LAND_AT`` the sync of version 4 lands (loaded as a
    sync's receiving side loads it)."""
    calls = []

    def between_steps() -> int | None:
        calls.append(1)
        if len(calls) != LAND_AT:
            return None
        engine.load_weights(new)
        return 4

    engine.between_steps = between_steps
    try:
        gens = engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=1.0, seed=5, version=3))
    finally:
        engine.between_steps = None
    assert len(calls) > LAND_AT, "the generation ended before the sync could land"
    return gens


if __name__ == "__main__":
    main()
