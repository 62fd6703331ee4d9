"""Each vllm engine starts vLLM with a cache root of its own, keyed by its world rank: vLLM keys its
torch.compile cache (``vllm/compilation/backends.py``: ``VLLM_CACHE_ROOT/torch_compile_cache/<hash>/
rank_<rank>_<dp rank>``, Inductor's and Triton's caches beneath it) by the rank in the engine's own
world, 0 for every one-rank engine of a node. vLLM is replaced by a stand-in that records the
environment it was started in (the real one takes ~30 s to import here)."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlbatch.config.compose import compose
from rlbatch.engines.base import EngineContext
from rlbatch.engines.model import load_tokenizer
from rlbatch.engines.vllm import VLLMArgs
from rlbatch.engines.vllm.engine import VLLMEngine, compile_cache_root


class StartedLLM:
    """``vllm.LLM`` as far as the engine's constructor goes; records ``VLLM_CACHE_ROOT`` at start."""

    started_in: list[str | None] = []

    def __init__(self, **kwargs: Any) -> None:
        StartedLLM.started_in.append(os.environ.get("VLLM_CACHE_ROOT"))
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(_finalizer=SimpleNamespace(detach=lambda: None)))


@pytest.fixture
def stand_in_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    modules = {name: types.ModuleType(name) for name in
               ("vllm", "vllm.v1", "vllm.v1.executor", "vllm.v1.executor.uniproc_executor")}
    modules["vllm"].LLM = StartedLLM  # type: ignore[attr-defined]
    modules["vllm.v1.executor.uniproc_executor"].UniProcExecutor = object  # type: ignore[attr-defined]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    StartedLLM.started_in = []


def engine_on(world_rank: int, cfg: Any) -> VLLMEngine:
    mesh = SimpleNamespace(mesh_dim_names=("dp",), get_rank=lambda: world_rank)
    return VLLMEngine(EngineContext("actor_infer", VLLMArgs(), cfg.model, cfg.algo, load_tokenizer(cfg.model),
                                    torch.device("cpu"), seed=0, mesh=mesh))


def test_an_engine_starts_vllm_with_the_cache_root_of_its_world_rank(
        stand_in_vllm: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    engine_on(3, compose(["model.num_heads=2", "model.num_kv_heads=1"]))
    assert StartedLLM.started_in == [str(tmp_path / "rank3")]
    assert os.environ["VLLM_CACHE_ROOT"] == str(tmp_path)  # the process's own, once vLLM has started


def test_the_engines_of_a_node_get_roots_of_their_own_under_the_jobs_or_vllms_default() -> None:
    assert compile_cache_root(3, {"VLLM_CACHE_ROOT": "/shared/vllm"}) == "/shared/vllm/rank3"
    assert compile_cache_root(5, {"VLLM_CACHE_ROOT": "/shared/vllm"}) == "/shared/vllm/rank5"
    assert compile_cache_root(2, {"XDG_CACHE_HOME": "/scratch/c"}) == "/scratch/c/vllm/rank2"
    assert compile_cache_root(0, {}) == os.path.expanduser("~/.cache/vllm/rank0")
