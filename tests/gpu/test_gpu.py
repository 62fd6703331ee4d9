"""GPU checks (marked `gpu`, skipped without CUDA): the pipeline on one GPU with the CPU reward
worker, hf and vLLM colocated (sleep and wake), each through a checkpoint and a resume; offload
and reload bandwidth against a raw pinned copy of the same bytes.

The pipeline tests launch what ``tools/gpu_check.sh`` launches (``tests/gpu/check.py``), which
runs them as its pipeline steps and its ``--cpu`` mode runs on the CPU in CI."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu import check

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
VLLM_MISSING = check.vllm_missing()


def test_pipeline_on_one_gpu_in_bf16(run_root: Path) -> None:
    """2 steps with hf rollouts, a checkpoint after each, then a resumed third step: the state lives
    on the GPU (peak allocated > 0), colocated roles move it off and back every step."""
    check.run_pipeline("hf", "cuda", run_root)
    check.resume_pipeline("hf", "cuda", run_root)


@pytest.mark.skipif(VLLM_MISSING is not None, reason=f"needs vLLM's CUDA build: {VLLM_MISSING}")
def test_vllm_colocated_sleeps_and_wakes_around_a_checkpoint_and_resumes(run_root: Path) -> None:
    """vLLM colocated with actor_train and the reference on one GPU: it sleeps and wakes every step,
    never in a state vLLM is not in (its own warnings), through the checkpoint after step 0 and a
    resumed run."""
    check.run_pipeline("vllm", "cuda", run_root)
    check.resume_pipeline("vllm", "cuda", run_root)


def test_offload_reload_bandwidth_against_raw_pinned_copy() -> None:
    from rlbatch.engines.offload import TensorStash

    tensors = [torch.randn(64 << 20, device="cuda") for _ in range(4)]  # 4 x 256 MiB
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    stash = TensorStash("bench", lambda: tensors)
    stash.offload()
    stash.reload()  # allocate and pin the host buffers once
    torch.cuda.synchronize()
    start = time.perf_counter()
    stash.offload()
    stash.reload()
    ours = time.perf_counter() - start
    host = [torch.empty_like(t, device="cpu").pin_memory() for t in tensors]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for h, t in zip(host, tensors, strict=True):
        h.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    for h, t in zip(host, tensors, strict=True):
        t.copy_(h, non_blocking=True)
    torch.cuda.synchronize()
    raw = time.perf_counter() - start
    print(f"offload+reload {2 * nbytes / ours / 1e9:.1f} GB/s, raw pinned copy {2 * nbytes / raw / 1e9:.1f} GB/s")
    assert ours <= 2 * raw, f"offload+reload took {ours:.3f}s for {nbytes >> 20} MiB each way; raw pinned copies {raw:.3f}s"


def test_packed_rows_score_as_padded_rows_on_cuda() -> None:
    """The packed path on CUDA (sdpa's kernels there, not the CPU's): log-probs of an LM, values of
    a critic and scores of a reward model from packed rows equal the padded rows' to float32
    rounding (fp32 models, ragged samples, an empty response included)."""
    from rlbatch.engines.batch import pack
    from rlbatch.engines.model import reward_model, value_model
    from rlbatch.engines.training import Split, logprobs, scores, values
    from rlbatch.models.spec import spec_from_config
    from rlbatch.models.tiny import build_tiny_model
    from tests.unit.test_batch import make_samples

    cuda = torch.device("cuda")

    def model() -> torch.nn.Module:
        return build_tiny_model(spec_from_config({"arch": "qwen2", "initializer_range": 0.1}), seed=3)

    samples = make_samples([(3, 4), (5, 0), (1, 6), (6, 2), (2, 1), (4, 5), (3, 3)], seed=4)
    padded, packed = Split(samples=0), Split(max_tokens=12, device=cuda)

    def pk(split: Split):  # type: ignore[no-untyped-def]
        return lambda chunk: pack(chunk, 0, cuda, flat=split.max_tokens > 0)

    def close(a: list[torch.Tensor] | list[float], b: list[torch.Tensor] | list[float]) -> None:
        x = torch.cat([torch.as_tensor(t).flatten().float().cpu() for t in a])
        y = torch.cat([torch.as_tensor(t).flatten().float().cpu() for t in b])
        tol = 64 * torch.finfo(torch.float32).eps * max(float(y.abs().max()), 1.0)
        assert float((x - y).abs().max()) <= tol, (float((x - y).abs().max()), tol)

    lm = model().to(cuda)
    close(logprobs(lm, samples, packed, pk(packed)), logprobs(lm, samples, padded, pk(padded)))
    critic = value_model(model()).to(cuda)
    with torch.no_grad():  # a zero head (its start) would make any two paths agree
        critic.score.weight.normal_(0, 1.0, generator=torch.Generator(device=cuda).manual_seed(0))
    close(values(critic, samples, packed, pk(packed)), values(critic, samples, padded, pk(padded)))
    rm = reward_model(model(), seed=5).to(cuda)
    close(scores(rm, samples, packed, pk(packed), rm.score), scores(rm, samples, padded, pk(padded)))


def test_varlen_attention_runs_packed_rows_on_cuda() -> None:
    """torch's varlen flash kernel behind ``rlbatch.engines.attention``: on random bf16 q/k/v with
    grouped-query heads it equals sdpa run on each sample alone (in fp32, from the same bf16
    inputs) to bf16 rounding, and a packed bf16 LM's log-probs through it equal the padded rows'."""
    from rlbatch.engines import attention
    from rlbatch.engines.batch import pack
    from rlbatch.engines.training import Split, logprobs
    from rlbatch.models.spec import spec_from_config
    from rlbatch.models.tiny import build_tiny_model
    from tests.unit.test_batch import make_samples

    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert attention.available(cuda, bf16), f"torch {torch.__version__} has no varlen_attn: packed rows take a dense mask"
    g = torch.Generator(device=cuda).manual_seed(0)
    lengths = [5, 1, 17, 64, 3]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=cuda)
    n = sum(lengths)
    q = torch.randn(1, 8, n, 64, device=cuda, dtype=bf16, generator=g)
    k, v = (torch.randn(1, 2, n, 64, device=cuda, dtype=bf16, generator=g) for _ in range(2))
    out, _ = attention.varlen_attention(torch.nn.Module(), q, k, v, None, scaling=64 ** -0.5, cu_seq_lens_q=cu,
                                        cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
    want = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qs = q[0, :, a:b].float()
        ks, vs = (t[0, :, a:b].float().repeat_interleave(4, dim=0) for t in (k, v))
        want.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
    err = float((out[0].float() - torch.cat(want)).abs().max())
    assert out.shape == (1, n, 8, 64) and err <= 4 * 2 ** -8, err  # outputs are convex mixes of |v| <~ 4

    lm = build_tiny_model(spec_from_config({"arch": "qwen2", "initializer_range": 0.1}), seed=3).to(cuda, bf16)
    samples = make_samples([(3, 4), (5, 0), (1, 6), (6, 2), (2, 1), (4, 5), (3, 3)], seed=4)
    want_lp = logprobs(lm, samples, Split(samples=0), lambda c: pack(c, 0, cuda))
    assert attention.prefer_varlen(lm, cuda, bf16)
    calls: list[int] = []
    kernel = attention._kernel()
    assert kernel is not None

    @functools.wraps(kernel)  # the kernel's signature says which causal keyword it takes
    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return kernel(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "_kernel", lambda: counted)
        got = logprobs(lm, samples, Split(max_tokens=12, device=cuda), lambda c: pack(c, 0, cuda, flat=True))
    assert calls, "the packed rows did not reach the varlen kernel"
    x, y = torch.cat([t.float() for t in got]), torch.cat([t.float() for t in want_lp])
    assert float((x - y).abs().max()) <= 16 * 2 ** -8 * max(float(y.abs().max()), 1.0), float((x - y).abs().max())


def test_megatron_engine_on_cuda_matches_transformers_padded_and_packed_and_trains() -> None:
    """The megatron engine on CUDA (megatron-core's GPU paths: RoPE, the causal mask, NCCL in a
    1-rank world; no test shim): fp32 log-probs over padded rows and over packed ones
    (``pack_rows``, the engine's block-diagonal attention) equal transformers' of the same weights;
    then bf16 training steps with the default dtype move the weights and keep the loss finite."""
    import datetime
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from rlbatch import algos
    from rlbatch.algos.objective import PolicyObjective
    from rlbatch.config.compose import compose
    from rlbatch.engines.base import EngineContext
    from rlbatch.engines.batch import pack, response_logits, unpack
    from rlbatch.engines.megatron import MegatronArgs
    from rlbatch.engines.megatron.engine import MegatronEngine
    from rlbatch.engines.model import load_model, load_tokenizer

    cuda = torch.device("cuda", 0)
    torch.cuda.set_device(cuda)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    mesh = DeviceMesh("cuda", torch.zeros(1, 1, 1, 1, dtype=torch.int), mesh_dim_names=("pp", "dp", "cp", "tp"))
    g = torch.Generator().manual_seed(7)
    samples = [{"prompt": torch.randint(4, 18, (3 + k % 4,), generator=g),
                "response": torch.randint(4, 18, (1 + k % 5,), generator=g),
                "advantage": torch.tensor(float(k % 5) - 2.0)} for k in range(8)]

    def engine(dtype: str, trainable: bool, **args: Any) -> MegatronEngine:
        cfg = compose([f"model.dtype={dtype}", "model.initializer_range=0.1"])
        return MegatronEngine(EngineContext("actor_train", MegatronArgs(**args), cfg.model, cfg.algo,
                                            load_tokenizer(cfg.model), cuda, seed=3, mesh=mesh, trainable=trainable))

    cfg = compose(["model.dtype=fp32", "model.initializer_range=0.1"])
    tok = load_tokenizer(cfg.model)
    hf = load_model(cfg.model, tok, 3).to(cuda).float()
    b = pack(samples, tok.pad_token_id, cuda)
    with torch.no_grad():
        want = unpack(algos.token_logprobs(response_logits(hf, b).float(), b.targets), b.lengths)
    for name, e in (("padded", engine("fp32", False)),
                    ("packed", engine("fp32", False, max_tokens_per_micro_batch=20, pack_rows=True))):
        got = e.logprobs(samples)
        err = max(float((x.float().cpu() - y.float().cpu()).abs().max()) for x, y in zip(got, want, strict=True))
        assert err < 1e-4, f"{name} rows: log-probs differ from transformers by {err}"
    trained = engine("auto", True, max_tokens_per_micro_batch=20, pack_rows=True)
    before = {n: p.detach().float().clone() for n, p in trained.model.named_parameters()}
    objective = PolicyObjective(cfg.algo)
    for _ in range(2):
        for x, old in zip(samples, trained.logprobs(samples), strict=True):
            x["old_logprobs"], x["ref_logprobs"] = old, old - 0.05
        stats = trained.train(samples, objective)
        assert all(torch.isfinite(torch.tensor(v)) for v in stats.values()), stats
    moved = max(float((p.detach().float() - before[n]).abs().max()) for n, p in trained.model.named_parameters())
    assert moved > 0, "two bf16 updates left every weight where it was"
