"""tools/bench/gpu.py without a GPU: its models have Qwen2.5's parameter counts, --help imports
no torch, it refuses to run without CUDA, and --cpu-smoke runs every measurement end to end."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "tools" / "bench" / "gpu.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})})


@pytest.mark.parametrize(("size", "params", "non_embedding"), [
    # Qwen2.5-0.5B and -1.5B model cards: "Number of Parameters: 0.49B / 1.54B; Number of
    # Paramaters (Non-Embedding): 0.36B / 1.31B"; exact counts from transformers' num_parameters().
    ("0.5b", 494_032_768, 0.36e9),
    ("1.5b", 1_543_714_304, 1.31e9),
])
def test_gpu_bench_models_have_the_published_parameter_counts(size: str, params: int, non_embedding: float) -> None:
    torch = pytest.importorskip("torch")
    from rlbatch.engines.model import load_model
    from rlbatch.models.shape import shape_from_config, shape_from_hf_config

    cfg, vocab = _bench().model_config(size)
    with torch.device("meta"):  # the engines' own build path, without allocating the weights
        model = load_model(cfg, vocab, seed=0)
    built = sum(p.numel() for p in model.parameters())  # the tied lm head is the embedding Parameter
    shape = shape_from_config(vars(cfg), vocab=len(vocab))
    assert built == shape.params == params
    assert shape_from_hf_config(model.config.to_dict()).params == params
    assert shape.params - shape.embedding_params == pytest.approx(non_embedding, rel=0.01)
    # N of the MFU: every weight but the norms (the tied embedding does the lm head's matmul).
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert shape.matmul_params == params - norms


def test_gpu_bench_flops_of_the_default_train_step() -> None:
    from rlbatch.models.shape import shape_from_config

    cfg, vocab = _bench().model_config("0.5b")
    shape = shape_from_config(vars(cfg), vocab=len(vocab))
    n = 494_032_768 - (2 * 24 + 1) * 896
    # 6N + 12*L*H*Q*T with L = 24 layers, H = 14 heads, Q = 64 head dim, T = 1024 tokens.
    assert shape.train_flops_per_token(1024) == 6 * n + 12 * 24 * 14 * 64 * 1024 == 3_228_174_336
    # A default step (8 x 1024 tokens) is 26.4 TFLOP: 26.7 ms at the H100's 989.4 TFLOP/s peak.
    assert 8 * 1024 * shape.train_flops_per_token(1024) == pytest.approx(26.445e12, rel=1e-4)


def test_gpu_bench_help_does_not_import_torch() -> None:
    out = _run("-X", "importtime", str(SCRIPT), "--help")
    assert out.returncode == 0 and "--size {0.5b,1.5b}" in out.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()}
    assert "argparse" in imported and "torch" not in imported


def test_gpu_bench_exits_2_without_cuda() -> None:
    out = _run(str(SCRIPT), "--steps", "1", env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "needs a CUDA GPU" in out.stderr and out.stdout == ""


def test_gpu_bench_cpu_smoke_measures_everything(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = _run(str(SCRIPT), "--cpu-smoke", "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = json.loads((tmp_path / "r.json").read_text())
    # The whole training state went through the stashes: fp32 params, grads and two AdamW moments.
    assert r["offload"]["bytes"] == 16 * r["model"]["params"]
    # Each stash is one host arena holding every storage at a 512-byte-aligned offset.
    assert r["offload"]["bytes"] <= r["offload"]["stash_bytes"] < r["offload"]["bytes"] + 512 * r["offload"]["tensors"]
    assert r["train"]["mfu"] > 0 and r["train"]["flops_per_token"] == 3 * 2 * r["train"]["matmul_params"] + 12 * 2 * 4 * 16 * 32
    # decode_step_s is (full - prefill-only) / 15 steps, medians of 3. On a GPU decoding dominates;
    # here 15 steps of the tiny model are a few milliseconds, which a loaded shared CPU can invert
    # (it came out < 0 at load ~30 even with 15 steps): the smoke checks that it is computed.
    g = r["generate"]
    assert 0 < g["tokens"] <= 2 * 16 and g["seconds"] > 0 and math.isfinite(g["decode_step_s"])
    for line in ("train (FSDP2 bf16, AdamW)", "decode step", "offload (device -> host)", "reload (host -> device)"):
        assert line in out.stdout
