"""Where and in what dtype the deepspeed engine puts a role's model on a GPU rank, decided without
CUDA. It computes in one dtype per device, trainable or not: a forward-only role under ZeRO-1/2
(the bare module, no DeepSpeed engine) runs in bf16 on a GPU, as DeepSpeed's bf16 mode runs the
others; fp32 on CPU. A trainable role, and a forward-only one under ZeRO-3, reach DeepSpeed as the
host model in fp32: DeepSpeed casts it parameter by parameter, then moves or partitions it, so the
whole fp32 model is never on the GPU. Stand-ins: a module that records where it is sent, and a
``deepspeed`` module whose ``initialize`` records what it is handed (this build's
``deepspeed.initialize`` runs in tests/dist/test_deepspeed.py, on CPU)."""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rlbatch.config.compose import compose
from rlbatch.engines.base import EngineContext
from rlbatch.engines.deepspeed import DeepSpeedArgs
from rlbatch.engines.deepspeed import engine as engine_module
from rlbatch.engines.deepspeed.engine import DeepSpeedEngine, compute_dtype, ds_config, plain_module
from rlbatch.engines.model import load_model, load_tokenizer


class _Recorder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list[dict[str, Any]] = []

    def to(self, *args: Any, **kwargs: Any) -> _Recorder:
        self.sent.append({**dict(zip(("device", "dtype"), args, strict=False)), **kwargs})
        return self


def test_a_forward_only_zero12_role_runs_in_the_trainable_roles_compute_dtype() -> None:
    algo = compose([]).algo
    for device, want in ((torch.device("cuda", 3), torch.bfloat16), (torch.device("cpu"), torch.float32)):
        module = _Recorder()
        assert plain_module(module, device) is module and not module.training
        assert module.sent == [{"device": device, "dtype": want}], module.sent
        assert compute_dtype(device) is want
        for stage in (1, 2, 3):
            for trainable in (True, False):
                cfg = ds_config(DeepSpeedArgs(zero_stage=stage), algo, device, trainable)
                assert cfg["bf16"]["enabled"] is (want is torch.bfloat16), (device, stage, trainable)


class _Mesh:
    """A one-rank dp mesh (pp, dp, cp, tp all 1) whose groups are names: nothing here communicates."""

    mesh_dim_names = ("pp", "dp", "cp", "tp")
    mesh = torch.zeros(1, 1, 1, 1)

    def get_group(self, axis: str) -> str:
        return axis


@pytest.fixture
def handed(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What the engine hands ``deepspeed.initialize``: the model's devices and dtypes, and the config."""
    cfg = compose([])
    load_model(cfg.model, load_tokenizer(cfg.model), 3)  # transformers' imports done before the stand-in
    seen: list[dict[str, Any]] = []

    def initialize(model: torch.nn.Module, config: dict[str, Any], **kw: Any) -> tuple[Any, ...]:
        seen.append({"devices": {p.device for p in model.parameters()}, "dtypes": {p.dtype for p in model.parameters()},
                     "bf16": config["bf16"]["enabled"]})
        return types.SimpleNamespace(module=model, optimizer=None), None

    fake = types.ModuleType("deepspeed")
    fake.initialize = initialize  # type: ignore[attr-defined]
    fake.ops = types.SimpleNamespace(__compatible_ops__={})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deepspeed", fake)

    @contextlib.contextmanager
    def no_world(group: Any) -> Iterator[None]:
        yield

    monkeypatch.setattr(engine_module, "role_world", no_world)
    monkeypatch.setenv("LOCAL_RANK", "0")  # the engine sets it: restored after the test
    return seen


def test_deepspeed_gets_the_host_model_to_cast_and_place_itself(handed: list[dict[str, Any]],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = compose([])
    tok = load_tokenizer(cfg.model)
    gpu = torch.device("cuda", 0)
    placed: list[torch.device] = []
    monkeypatch.setattr(engine_module, "plain_module", lambda model, device: placed.append(device) or model)
    for stage, trainable in ((1, True), (2, True), (3, True), (3, False), (1, False), (2, False)):
        DeepSpeedEngine(EngineContext("actor_train" if trainable else "reference", DeepSpeedArgs(zero_stage=stage),
                                      cfg.model, cfg.algo, tok, gpu, seed=3, mesh=_Mesh(), trainable=trainable))
    want = {"devices": {torch.device("cpu")}, "dtypes": {torch.float32}, "bf16": True}
    assert handed == [want] * 4, handed  # trainable at stages 1-3, forward-only at stage 3
    assert placed == [gpu, gpu]  # forward-only at stages 1 and 2: the bare module, through plain_module


def test_deepspeed_is_imported_without_the_trackers_its_autotuner_would_import() -> None:
    """In a fresh interpreter: DeepSpeed's autotuner goes without MLflow (installed here by the trackers
    extra), which imports as usual afterwards; the shared-memory op is marked unavailable."""
    import subprocess

    code = ("import sys\nfrom rlbatch.engines.deepspeed.world import import_deepspeed\nds = import_deepspeed()\n"
            "from deepspeed.autotuning import autotuner\n"
            "assert 'mlflow' not in sys.modules and autotuner.has_mlflow is False\n"
            "assert ds.ops.__compatible_ops__['deepspeed_shm_comm'] is False\n"
            "import mlflow\nprint('ok', mlflow.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "ok mlflow", out.stdout + out.stderr[-2000:]
