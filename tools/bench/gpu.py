"""rlbatch's engines on one GPU, each figure next to its limit.

    python tools/bench/gpu.py [--size 0.5b|1.5b] [--batch 8 --seq 1024] [--json PATH]

Builds a random-initialised model of Qwen2.5-0.5B's (or 1.5B's) shape, nothing downloaded, and
measures on GPU 0, in a world-size-1 NCCL process group:
  train     FSDPEngine.train (FSDP2, bf16 compute, fp32 master weights, AdamW, the PPO-clip loss)
            on --batch sequences of --seq tokens. Limit: the GPU's dense bf16 peak; the
            fraction is MFU, with model FLOPs per token 6N + 12*L*H*Q*T (PaLM's form, N = matmul
            weights including the lm head; see ModelShape.train_flops_per_token).
  generate  HFInferenceEngine.generate of --gen-batch prompts of --prompt-len tokens, --new-tokens
            new tokens each: tokens/s and the decode-step time. Limit: the HBM floor of a decode
            step, (bf16 weights + KV cache at mean context) / HBM bandwidth.
  offload   the trained engine's state (params, grads, AdamW moments, all fp32) through its
            TensorStashes to host and back. Limit: raw copy_(non_blocking=True) of the same
            tensors to and from pinned buffers, measured in the same run (target: >= 80%).
Peak FLOP/s and HBM bandwidth come from rlbatch/conf/hardware/<profile>.yaml, picked by device name;
--hardware picks another profile and --peak-tflops overrides the peak. Without CUDA it exits
with code 2 (--cpu-smoke runs the same code on the CPU with a tiny model: the figures mean
nothing, the run checks the code path).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmark this checkout's rlbatch

QWEN2_5: dict[str, dict[str, Any]] = {
    # config.json of Qwen/Qwen2.5-0.5B and Qwen/Qwen2.5-1.5B (both tie the lm head to the embedding).
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2, vocab=151936),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2, vocab=151936),
    # --cpu-smoke only.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, vocab=256),
}
SMOKE = dict(size="tiny", batch=2, seq=32, prompt_len=8, new_tokens=16, gen_batch=2, warmup=1, steps=1, iters=3)


@dataclass
class Vocab:
    """What the engines need of a tokenizer when the model is random-initialised."""

    size: int
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2

    def __len__(self) -> int:
        return self.size


def model_config(size: str) -> tuple[Any, Vocab]:
    """rlbatch's ModelConfig for a random-init model of that shape, and its vocabulary."""
    from rlbatch.config.schema import ModelConfig

    fields = dict(QWEN2_5[size])
    vocab = Vocab(int(fields.pop("vocab")))
    return ModelConfig(arch="qwen2", tie_word_embeddings=True, max_position_embeddings=32768, **fields), vocab


_T0 = time.perf_counter()


def progress(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


def _timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def bench_train(args: argparse.Namespace, model_cfg: Any, vocab: Vocab, device: Any, mesh: Any, shape: Any,
                peak_flops: float, sync: Callable[[], None]) -> tuple[dict[str, Any], Any]:
    import torch

    from rlbatch.algos.objective import PolicyObjective
    from rlbatch.config.schema import AlgoConfig
    from rlbatch.engines.base import EngineContext
    from rlbatch.engines.fsdp import FSDPArgs
    from rlbatch.engines.fsdp.engine import FSDPEngine

    progress(f"train: building FSDPEngine ({shape.params / 1e6:.1f}M parameters, fp32 master weights)")
    algo = AlgoConfig(mini_batches=1, epochs=1, grad_accum=1, kl_coef=0.0, lr=1e-6,
                      activation_checkpointing=args.grad_ckpt)
    engine = FSDPEngine(EngineContext("actor_train", FSDPArgs(max_tokens_per_micro_batch=args.max_tokens), model_cfg,
                                      algo, vocab, device, seed=0, mesh=mesh, trainable=True))
    objective = PolicyObjective(algo)
    g = torch.Generator().manual_seed(0)
    samples = [{"prompt": torch.randint(3, vocab.size, (args.prompt_len,), generator=g),
                "response": torch.randint(3, vocab.size, (args.seq - args.prompt_len,), generator=g),
                "advantage": torch.randn((), generator=g)} for _ in range(args.batch)]
    progress(f"train: {args.warmup} warm-up steps of {args.batch} x {args.seq} tokens")
    for _ in range(args.warmup):
        engine.train(samples, objective)
    progress(f"train: {args.steps} timed steps")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step_s = _timed(lambda: [engine.train(samples, objective) for _ in range(args.steps)], sync) / args.steps
    tokens = args.batch * args.seq
    flops_token = shape.train_flops_per_token(args.seq)
    achieved = tokens * flops_token / step_s
    if args.profile:
        print(profile_step(lambda: engine.train(samples, objective), device), flush=True)
    out = {"max_tokens": engine.max_tokens, "varlen": engine.varlen, "step_s": step_s, "tokens_per_s": tokens / step_s, "flops_per_token": flops_token,
           "matmul_params": shape.matmul_params, "model_flops_per_s": achieved, "mfu": achieved / peak_flops,
           "peak_allocated_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else 0}
    progress(f"train: {step_s * 1e3:.1f} ms/step, {achieved / 1e12:.1f} TFLOP/s = {out['mfu']:.1%} MFU "
             f"(6N + 12LHQT = {flops_token / 1e9:.2f} GFLOP/token, N = {shape.matmul_params / 1e6:.1f}M), "
             f"peak {out['peak_allocated_bytes'] / 1e9:.1f} GB allocated")
    return out, engine


def profile_step(step: Callable[[], Any], device: Any, rows: int = 15) -> str:
    """One ``step`` under torch.profiler: the ops with the most self time on the device."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
        if cuda:
            torch.cuda.synchronize(device)
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return str(prof.key_averages().table(sort_by=key, row_limit=rows))


def bench_offload(args: argparse.Namespace, engine: Any, device: Any, sync: Callable[[], None]) -> dict[str, Any]:
    import torch

    from rlbatch.engines.offload import grad_tensors, local_tensor, optimizer_tensors

    stashes = list(engine.state.by_kind.values())
    # The raw side copies the same storages the stashes move, whole, as one uint8 view each.
    views, seen = [], set()
    for t in [*engine.model.parameters(), *grad_tensors(engine.model), *optimizer_tensors(engine.optimizer)]:
        st = local_tensor(t).untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            views.append(torch.empty(0, dtype=torch.uint8, device=device).set_(st, 0, (st.nbytes(),), (1,)))
    nbytes = sum(v.numel() for v in views)
    progress(f"offload: {nbytes / 1e9:.2f} GB in {len(views)} tensors ({', '.join(engine.state_kinds)}); "
             "allocating pinned host buffers")
    pinned = device.type == "cuda"
    host = [torch.empty(v.numel(), dtype=torch.uint8, pin_memory=pinned) for v in views]

    def ours() -> tuple[float, float, int]:
        t_off = _timed(lambda: [s.offload() for s in stashes], sync)
        after = torch.cuda.memory_allocated() if pinned else 0
        t_on = _timed(lambda: [s.reload() for s in stashes], sync)
        return t_off, t_on, after

    def raw() -> tuple[float, float]:
        t_off = _timed(lambda: [h.copy_(v, non_blocking=True) for h, v in zip(host, views, strict=True)], sync)
        t_on = _timed(lambda: [v.copy_(h, non_blocking=True) for h, v in zip(host, views, strict=True)], sync)
        return t_off, t_on

    ours()  # the stashes allocate and pin their buffers on the first offload
    raw()
    before = torch.cuda.memory_allocated() if pinned else 0
    runs_ours, runs_raw = [], []
    for i in range(args.iters):
        t_off, t_on, after = ours()
        runs_ours.append((t_off, t_on))
        runs_raw.append(raw())
        if i == 0 and pinned:
            progress(f"offload: device memory {before / 1e9:.2f} GB -> {after / 1e9:.2f} GB offloaded -> "
                     f"{torch.cuda.memory_allocated() / 1e9:.2f} GB reloaded")
    med = {k: statistics.median(r[j] for r in runs) for k, j, runs in
           [("offload_s", 0, runs_ours), ("reload_s", 1, runs_ours), ("raw_d2h_s", 0, runs_raw), ("raw_h2d_s", 1, runs_raw)]}
    out: dict[str, Any] = {"bytes": nbytes, "tensors": len(views), "stash_bytes": sum(s.host_bytes() for s in stashes), **med}
    for way, ours_s, raw_s in (("offload", med["offload_s"], med["raw_d2h_s"]), ("reload", med["reload_s"], med["raw_h2d_s"])):
        out[f"{way}_gbps"], out[f"raw_{way}_gbps"], out[f"{way}_ratio"] = nbytes / ours_s / 1e9, nbytes / raw_s / 1e9, raw_s / ours_s
        progress(f"offload: {way} {out[f'{way}_gbps']:.1f} GB/s vs raw pinned {out[f'raw_{way}_gbps']:.1f} GB/s "
                 f"= {out[f'{way}_ratio']:.0%}")
    return out


def bench_generate(args: argparse.Namespace, model_cfg: Any, vocab: Vocab, device: Any, shape: Any, hbm_bw: float,
                   sync: Callable[[], None]) -> dict[str, Any]:
    import dataclasses

    import torch

    from rlbatch.config.schema import AlgoConfig
    from rlbatch.engines.base import EngineContext, SamplingParams
    from rlbatch.engines.hf import HFArgs
    from rlbatch.engines.hf.engine import HFInferenceEngine

    progress("generate: building HFInferenceEngine (bf16)")
    engine = HFInferenceEngine(EngineContext("actor_infer", HFArgs(max_batch=args.gen_batch),
                                             dataclasses.replace(model_cfg, dtype="bf16"), AlgoConfig(), vocab, device,
                                             seed=0))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab.size, (args.prompt_len,), generator=g).tolist() for _ in range(args.gen_batch)]
    full, first = SamplingParams(max_new_tokens=args.new_tokens), SamplingParams(max_new_tokens=1)
    progress(f"generate: warm-up, {args.gen_batch} prompts x {args.prompt_len} tokens -> {args.new_tokens} new")
    engine.generate(prompts, full)
    t_prefill: list[float] = []
    t_full: list[float] = []
    responses: list[Any] = []
    for _ in range(args.iters):
        t_prefill.append(_timed(lambda: engine.generate(prompts, first), sync))
        responses.clear()
        t_full.append(_timed(lambda: responses.extend(engine.generate(prompts, full)), sync))
    tokens = sum(len(r.tokens) for r in responses)  # rows that sampled EOS stopped early
    prefill_s, total_s = statistics.median(t_prefill), statistics.median(t_full)
    step_s = (total_s - prefill_s) / max(1, args.new_tokens - 1)
    ctx = args.prompt_len + args.new_tokens / 2
    floor_bytes = shape.decode_read_bytes(args.gen_batch, ctx, 2)
    floor_s = floor_bytes / hbm_bw
    res = {"seconds": total_s, "tokens": tokens, "tokens_per_s": tokens / total_s, "prefill_s": prefill_s,
           "decode_step_s": step_s, "decode_floor_s": floor_s, "decode_read_bytes": floor_bytes,
           "weight_bytes": shape.decode_read_bytes(0, 0, 2), "hbm_bw": hbm_bw,
           "tokens_per_s_limit": args.gen_batch / floor_s, "decode_fraction": floor_s / step_s}
    progress(f"generate: {res['tokens_per_s']:.0f} tokens/s, decode step {step_s * 1e3:.2f} ms vs HBM floor "
             f"{floor_s * 1e3:.3f} ms ({res['weight_bytes'] / 1e9:.2f} GB weights + "
             f"{(floor_bytes - res['weight_bytes']) / 1e9:.2f} GB KV at {hbm_bw / 1e12:.2f} TB/s)")
    return res


def summary(r: dict[str, Any]) -> str:
    t, g, o = r["train"], r["generate"], r["offload"]
    rows = [
        ("train (FSDP2 bf16, AdamW)", f"{t['model_flops_per_s'] / 1e12:.1f} TFLOP/s", f"{r['peak_flops'] / 1e12:.1f} TFLOP/s peak",
         f"{t['mfu']:.1%} MFU"),
        ("generate tokens/s", f"{g['tokens_per_s']:.0f}", f"{g['tokens_per_s_limit']:.0f} (HBM floor)", f"{g['tokens_per_s'] / g['tokens_per_s_limit']:.1%}"),
        ("decode step", f"{g['decode_step_s'] * 1e3:.2f} ms", f"{g['decode_floor_s'] * 1e3:.3f} ms (HBM floor)", f"{g['decode_fraction']:.1%}"),
        ("offload (device -> host)", f"{o['offload_gbps']:.1f} GB/s", f"{o['raw_offload_gbps']:.1f} GB/s raw pinned", f"{o['offload_ratio']:.0%} (target 80%)"),
        ("reload (host -> device)", f"{o['reload_gbps']:.1f} GB/s", f"{o['raw_reload_gbps']:.1f} GB/s raw pinned", f"{o['reload_ratio']:.0%} (target 80%)"),
    ]
    a = r["args"]
    head = (f"rlbatch GPU benchmark: {r['device']} (profile {r['hardware']}), Qwen2.5-{a['size']} shape "
            f"({r['model']['params'] / 1e6:.1f}M params), train {a['batch']}x{a['seq']}, generate "
            f"{a['gen_batch']}x{a['prompt_len']}->{a['new_tokens']}, offload {o['bytes'] / 1e9:.2f} GB; medians")
    lines = [head, f"  {'measurement':28s} {'value':>16s}   {'limit':28s} fraction"]
    lines += [f"  {n:28s} {v:>16s}   {lim:28s} {f}" for n, v, lim, f in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import gc
    import tempfile

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rlbatch.config.hardware import DEVICE_PROFILES, load_hardware, profile_for_device
    from rlbatch.errors import ConfigError
    from rlbatch.models.shape import shape_from_config

    cuda = not args.cpu_smoke
    if cuda and not torch.cuda.is_available():
        print("gpu.py: needs a CUDA GPU and torch.cuda.is_available() is False here "
              f"(torch {torch.__version__}); run it on a GPU node", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    profile = args.hardware or (profile_for_device(name) if cuda else "cpu")
    if profile is None:
        print(f"gpu.py: no hardware profile for {name!r} (known: {DEVICE_PROFILES}); pass --hardware "
              "with a profile from rlbatch/conf/hardware/ or a .yaml path", file=sys.stderr)
        return 2
    try:
        hw = load_hardware(profile, {"peak_flops": args.peak_tflops * 1e12} if args.peak_tflops else None)
    except ConfigError as e:
        print(f"gpu.py: {e}", file=sys.stderr)
        return 2
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    model_cfg, vocab = model_config(args.size)
    shape = shape_from_config(vars(model_cfg), vocab=len(vocab))
    progress(f"{name}, profile {profile} (peak {hw.peak_flops / 1e12:.1f} TFLOP/s, HBM {hw.hbm_bw / 1e12:.2f} TB/s, "
             f"PCIe {hw.pcie_bw / 1e9:.0f} GB/s each way), torch {torch.__version__}")
    if cuda:
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp",))
            train, engine = bench_train(args, model_cfg, vocab, device, mesh, shape, hw.peak_flops, sync)
            if args.train_only:
                print(json.dumps({"train": train}), flush=True)
                return 0
            offload = bench_offload(args, engine, device, sync)
            del engine
            gc.collect()  # the engine's stashes close over it: a cycle that only gc frees
            if cuda:
                torch.cuda.empty_cache()
            generate = bench_generate(args, model_cfg, vocab, device, shape, hw.hbm_bw, sync)
        finally:
            dist.destroy_process_group()
    results = {"device": name, "hardware": profile, "peak_flops": hw.peak_flops, "torch": torch.__version__,
               "args": {k: v for k, v in vars(args).items() if k != "json"}, "model": shape.to_dict(),
               "train": train, "generate": generate, "offload": offload}
    print(summary(results), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        progress(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=["0.5b", "1.5b"], default="0.5b", help="Qwen2.5 shape of the random-init model")
    p.add_argument("--batch", type=int, default=8, help="train: sequences per step")
    p.add_argument("--seq", type=int, default=1024, help="train: tokens per sequence")
    p.add_argument("--grad-ckpt", action="store_true", help="train: activation checkpointing (not counted in MFU)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="train: engine_args.max_tokens_per_micro_batch (0: padded rows; default: the device's)")
    p.add_argument("--train-only", action="store_true", help="only the train figures (no offload, no generate)")
    p.add_argument("--profile", action="store_true", help="train: print the device's top ops of one profiled step")
    p.add_argument("--warmup", type=int, default=3, help="train: steps before timing")
    p.add_argument("--steps", type=int, default=10, help="train: timed steps")
    p.add_argument("--gen-batch", type=int, default=64, help="generate: prompts")
    p.add_argument("--prompt-len", type=int, default=128, help="generate: prompt tokens (train: of --seq)")
    p.add_argument("--new-tokens", type=int, default=256, help="generate: new tokens per prompt")
    p.add_argument("--iters", type=int, default=3, help="generate, offload: timed repetitions (median)")
    p.add_argument("--hardware", help="profile in rlbatch/conf/hardware/ (or .yaml path); default: by device name")
    p.add_argument("--peak-tflops", type=float, help="override the profile's dense bf16 peak, TFLOP/s")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    p.add_argument("--cpu-smoke", action="store_true", help="run on the CPU with a tiny model (checks the code path)")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        vars(args).update(SMOKE)
    if not 0 < args.prompt_len < args.seq:
        p.error(f"--prompt-len {args.prompt_len} must be between 0 and --seq {args.seq} (train sequences are prompt + response)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
