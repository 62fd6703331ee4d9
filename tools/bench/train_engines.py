"""The training engines side by side: one training step of the same model on the same batch with
fsdp, deepspeed (ZeRO-1, -2, -3) and megatron (TP=1, TP=2, PP=2), 2 ranks, in one run.

    python tools/bench/train_engines.py [--model-size 15m] [--batch 8 --seq 128] [--steps 3]
                                        [--engines fsdp,zero1,zero2,zero3,tp1,tp2,pp2] [--quick]

Starts itself under mpiexec (the mpich wheel's) with 2 processes. Each rank builds every engine in
turn through the engine contract (``build_engine`` with an ``EngineContext`` whose DeviceMesh has
the (pp, dp, cp, tp) axes ``rlbatch/runtime/world.py`` gives a role): fsdp and deepspeed on
``d2``, megatron on ``d2`` (TP=1), ``t2`` (TP=2) and ``p2`` (two pipeline stages, one
micro-batch per update: the schedule's cost without overlap). The model is a random-initialised Qwen2 of
``--model-size`` built from the same seed by every engine, so all start from the same weights.
The batch: ``--batch`` sequences of ``--seq`` tokens (``--prompt-len`` of them prompt), all of one
length so each dp rank's share has as many tokens as the others and every engine minimises the
same loss; split over dp (the tp peers of a replica get the same samples, as the scheduler sends
them). Old log-probs come from each engine's own log-prob pass before its first update, the
reference log-probs are those minus 0.05, the objective is the default GRPO one (PPO-clip + k3 KL).

Per engine it prints, as a table (rank 0): the median seconds of one training step (one optimizer
update, ``engine.train``) over ``--steps`` steps after ``--warmup`` warm-up steps, the slower
rank's time, and the CPU seconds of the busier rank's process in the step (all its threads: less
sensitive than wall time to other programs sharing the machine, blind to time spent waiting); the peak memory of the steps per rank (the larger rank's): on CPU the process's peak
RSS (its high-water mark is reset before each engine is built) and that peak minus the RSS before
the engine was built (the engine's own weights, gradients, optimizer state and activations; the
absolute peak also counts the libraries imported so far, megatron-core's among them), on a GPU
``torch.cuda.max_memory_allocated``; the loss of the first step (before any update) and the loss
of the batch after the last step (the objective on the final weights' log-probs), averaged over
the ranks' shares. The losses of all engines agree to float rounding (the first) and to
the rounding differences that the updates carry forward (the second).

On CPU megatron runs with the test-only shim (``tests.plugins.megatron_cpu``, loaded as a plugin
just before the first megatron engine; its function mode also adds some per-op cost to megatron's
steps). On CUDA (one GPU per rank, so 2 GPUs, NCCL; ``--cpu`` runs on the CPU anyway) the table also has MFU: model FLOPs of the step (PaLM's
6N + 12LHQT per token, ``ModelShape.train_flops_per_token``) over the seconds and the summed bf16
peak of the ranks' GPUs from ``rlbatch/conf/hardware/``. The CUDA path is untested.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmark this checkout's rlbatch

RANKS = 2
MODEL_SIZES: dict[str, dict[str, int]] = {
    # random-init Qwen2 shapes (tied embeddings); heads and kv heads even, for TP=2
    "quick": dict(hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, vocab=256),
    "5m": dict(hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4, num_kv_heads=2, vocab=4096),
    "15m": dict(hidden_size=384, intermediate_size=1536, num_layers=6, num_heads=6, num_kv_heads=2, vocab=8192),
    "25m": dict(hidden_size=512, intermediate_size=2048, num_layers=6, num_heads=8, num_kv_heads=4, vocab=8192),
    # Qwen2.5-0.5B's config.json shape (14 heads: no TP=2)
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2, vocab=151936),
}
QUICK = dict(model_size="quick", batch=4, seq=16, prompt_len=8, warmup=1, steps=2)


@dataclass(frozen=True)
class Config:
    """One row of the table: a registered engine, its engine_args and the role's mesh."""

    key: str
    engine: str
    label: str
    args: dict[str, Any]
    dp: int
    tp: int
    pp: int = 1
    lora: int = 0
    """model.lora.rank (0: every weight trained)."""


CONFIGS = [
    Config("fsdp", "fsdp", "FSDP2 d2", {}, 2, 1),
    Config("zero1", "deepspeed", "ZeRO-1 d2", {"zero_stage": 1}, 2, 1),
    Config("zero2", "deepspeed", "ZeRO-2 d2", {"zero_stage": 2}, 2, 1),
    Config("zero3", "deepspeed", "ZeRO-3 d2", {"zero_stage": 3}, 2, 1),
    Config("tp1", "megatron", "TP=1 d2", {}, 2, 1),
    Config("tp2", "megatron", "TP=2 t2", {}, 1, 2),
    Config("pp2", "megatron", "PP=2 p2", {}, 1, 1, pp=2),
    Config("fsdp_lora", "fsdp", "FSDP2 d2, LoRA r16", {}, 2, 1, lora=16),
]
BY_KEY = {c.key: c for c in CONFIGS}
COLUMNS = ["engine", "config", "s/step", "CPU s/step", "peak RSS MiB/rank", "engine MiB/rank", "trained params",
           "sync MiB", "sync s", "adapter sync MiB", "adapter sync s", "loss step 1", "loss after", "MFU"]


_T0 = time.perf_counter()


def progress(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


# -- memory -------------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def release_memory() -> None:
    """Free what the previous engine left (reference cycles) and hand glibc's free pages back."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> None:
    """Set the process's RSS high-water mark (VmHWM) to its current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


# -- one engine ---------------------------------------------------------------------------------
def batch(args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(args.seed + 1)
    return [{"prompt": torch.randint(3, vocab, (args.prompt_len,), generator=g),
             "response": torch.randint(3, vocab, (args.seq - args.prompt_len,), generator=g),
             "advantage": torch.randn((), generator=g)} for _ in range(args.batch)]


def world_mean(x: float, device: Any) -> float:
    """Mean over all ranks: the dp shares have equal token counts, tp peers hold the same value."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def world_max(x: float, device: Any) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64, device=device)  # NCCL reduces device tensors only
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def step_loss(stats: dict[str, float], algo: Any) -> float:
    return stats["pg_loss"] + float(algo.kl_coef) * stats.get("kl_ref", 0.0)


def loss_after(engine: Any, share: list[dict[str, Any]], objective: Any) -> float:
    """The objective on this share with the engine's current weights (what the next step would see)."""
    import torch

    from rlbatch.algos.objective import LossInput

    logp = torch.stack(engine.logprobs(share)).float().cpu()
    fields = {k: torch.stack([s[k] for s in share]).float().cpu() for k in ("old_logprobs", "ref_logprobs")}
    adv = torch.stack([s["advantage"] for s in share])[:, None].expand_as(logp)
    with torch.no_grad():
        loss, _ = objective(LossInput(logp, torch.ones_like(logp), adv, fields))
    return float(loss)


def bench_one(c: Config, args: argparse.Namespace, env: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from rlbatch.engines.base import EngineContext, build_engine
    from rlbatch.engines.registry import engine_args

    device, sync, cuda = env["device"], env["sync"], env["device"].type == "cuda"
    mesh = env["meshes"][(c.pp, c.dp, c.tp)]
    model = env["model"]
    if c.lora:
        import dataclasses

        from rlbatch.config.schema import LoraConfig

        model = dataclasses.replace(model, lora=LoraConfig(rank=c.lora, alpha=2.0 * c.lora))
    ctx = EngineContext("actor_train", engine_args(c.engine, c.args), model, env["algo"], env["vocab"], device,
                        seed=args.seed, mesh=mesh, trainable=True)
    release_memory()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base_kib = _status_kib("VmRSS")
    base_cuda = torch.cuda.memory_allocated(device) if cuda else 0
    reset_peak_rss()
    start = time.perf_counter()
    engine = build_engine(c.engine, ctx)
    dp_rank = mesh.get_local_rank("dp")
    per = len(env["samples"]) // c.dp
    share = [dict(s) for s in env["samples"][dp_rank * per : (dp_rank + 1) * per]]
    for s, old in zip(share, engine.logprobs(share), strict=True):
        s["old_logprobs"], s["ref_logprobs"] = old, old - 0.05
    say = env["say"]
    say(f"{c.engine} {c.label}: built in {time.perf_counter() - start:.1f} s; {args.warmup} warm-up + "
        f"{args.steps} timed steps")
    times, cpu_times, losses = [], [], []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        stats = engine.train(share, env["objective"])
        sync()
        dt = world_max(time.perf_counter() - t0, device)
        dc = world_max(time.process_time() - c0, device)
        losses.append(world_mean(step_loss(stats, env["algo"]), device))
        if i >= args.warmup:
            times.append(dt)
            cpu_times.append(dc)
        say(f"{c.engine} {c.label}: step {i + 1} {'(warm-up) ' if i < args.warmup else ''}{dt:.3f} s "
            f"({dc:.3f} s CPU), loss {losses[-1]:.6f}")
    after = world_mean(loss_after(engine, share, env["objective"]), device)
    if cuda:
        peak_b = torch.cuda.max_memory_allocated(device)
        peak, own = world_max(peak_b / 2**20, device), world_max((peak_b - base_cuda) / 2**20, device)
    else:
        peak_kib = _status_kib("VmHWM")
        peak, own = world_max(peak_kib / 1024, device), world_max((peak_kib - base_kib) / 1024, device)
    step_s = statistics.median(times)
    trained = sum(getattr(p, "ds_numel", p.numel()) for p in _module(engine).parameters() if p.requires_grad)
    sync_bytes, sync_s = sync_cost(engine, device, sync)
    adapter = sync_cost(engine, device, sync, adapters=True) if c.lora else None
    row = {"engine": c.engine, "config": c.label, "step_s": step_s, "cpu_s": statistics.median(cpu_times), "peak_mib": peak, "engine_mib": own,
           "trained": trained, "sync_mib": sync_bytes / 2**20, "sync_s": sync_s,
           "adapter_mib": adapter[0] / 2**20 if adapter else None, "adapter_s": adapter[1] if adapter else None,
           "loss_first": losses[0], "loss_after": after, "mfu": None}
    if cuda:
        flops = args.batch * args.seq * env["shape"].train_flops_per_token(args.seq)
        row["mfu"] = flops / step_s / (env["peak_flops"] * dist.get_world_size())
    del engine, share
    release_memory()
    return row


def _module(engine: Any) -> Any:
    """The engine's trained module: fsdp's and megatron's ``model`` (a list of stages: the first),
    deepspeed's ``module``."""
    m = next(m for m in (getattr(engine, "model", None), getattr(engine, "module", None)) if m is not None)
    return m[0] if isinstance(m, list) else m


def sync_cost(engine: Any, device: Any, sync: Any, adapters: bool = False) -> tuple[int, float]:
    """The weight sync's sending side: the bytes of the weights the engine streams (what an
    inference engine receives) and the seconds to stream them (the slower rank's), in the engine's
    wire dtype (bf16 on a GPU, fp32 on the CPU, as ``weightsync`` asks). ``adapters``: the adapters
    alone (``export_adapters``), what a sync into an engine that loads adapters streams."""
    import torch
    import torch.distributed as dist

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dist.barrier()
    sync()
    t0, total = time.perf_counter(), 0
    with (engine.export_adapters() if adapters else engine.export_weights()) as stream:
        for unit in stream.units(dtype):
            total += sum(t.numel() * t.element_size() for _, t in unit)
    sync()
    return total, world_max(time.perf_counter() - t0, device)


# -- the ranks ----------------------------------------------------------------------------------
PRELOAD = {
    # what each engine imports on its first build, imported before any engine is measured so that the
    # memory of an engine's row is its own (the libraries' memory is in every row's absolute peak)
    "fsdp": ["rlbatch.models.tiny", "transformers.models.qwen2.modeling_qwen2"],
    "deepspeed": ["deepspeed", "deepspeed.utils"],
    "megatron": ["megatron.core.models.gpt", "megatron.core.models.gpt.gpt_layer_specs",
                 "megatron.core.process_groups_config", "megatron.core.transformer.transformer_config"],
}


def preload(engines: list[str]) -> None:
    import importlib

    from rlbatch.engines.registry import spec_of

    for name in ["fsdp", *engines]:
        importlib.import_module(str(spec_of(name).implementation).partition(":")[0])
        for module in PRELOAD.get(name, []):
            importlib.import_module(module)


def model_config(size: str, seq: int) -> tuple[Any, Any]:
    from rlbatch.config.schema import ModelConfig
    from tools.bench.gpu import Vocab

    fields = dict(MODEL_SIZES[size])
    vocab = Vocab(int(fields.pop("vocab")))
    return ModelConfig(arch="qwen2", tie_word_embeddings=True, max_position_embeddings=max(128, seq), **fields), vocab


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.distributed.device_mesh import DeviceMesh

    from rlbatch.algos.objective import PolicyObjective
    from rlbatch.config.schema import AlgoConfig
    from rlbatch.models.shape import shape_from_config
    from rlbatch.plugins import import_plugins
    from rlbatch.runtime.world import teardown

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda and torch.cuda.device_count() < size:
        if rank == 0:
            print(f"train_engines.py: {size} ranks need {size} GPUs, this node has {torch.cuda.device_count()}; "
                  "pass --cpu to run on the CPU", file=sys.stderr, flush=True)
        return 2
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(args.threads)
    port = comm.bcast(29500 + os.getpid() % 2000 if rank == 0 else None, root=0)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)

    def say(msg: str) -> None:
        if rank == 0:
            progress(msg)

    model_cfg, vocab = model_config(args.model_size, args.seq)
    shape = shape_from_config(vars(model_cfg), vocab=len(vocab))
    algo = AlgoConfig(mini_batches=1, epochs=1, grad_accum=1, lr=args.lr, warmup_steps=0)
    env: dict[str, Any] = {"device": device, "model": model_cfg, "vocab": vocab, "algo": algo, "shape": shape,
                           "objective": PolicyObjective(algo), "samples": batch(args, len(vocab)), "say": say,
                           "sync": (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)}
    if cuda:
        from rlbatch.config.hardware import load_hardware, profile_for_device

        name = torch.cuda.get_device_name(device)
        profile = args.hardware or profile_for_device(name)
        env["peak_flops"] = load_hardware(profile).peak_flops if profile else float("nan")
        say(f"{name}, hardware profile {profile}")
    # Every mesh on every rank, in one order (as runtime/world.py creates a job's groups).
    names = ("pp", "dp", "cp", "tp")
    env["meshes"] = {(pp, dp, tp): DeviceMesh(device.type, torch.arange(size).reshape(pp, dp, 1, tp),
                                              mesh_dim_names=names) for pp, dp, tp in ((1, 2, 1), (1, 1, 2), (2, 1, 1))}
    say(f"{size} ranks ({'NCCL, ' + str(device.type) if cuda else f'gloo, CPU, {args.threads} thread(s) each'}), "
        f"Qwen2 {args.model_size}: {shape.params / 1e6:.2f}M parameters (hidden {model_cfg.hidden_size}, "
        f"{model_cfg.num_layers} layers, vocab {len(vocab)}), batch {args.batch} x {args.seq} tokens "
        f"({args.prompt_len} prompt), AdamW lr {args.lr}")
    preload([BY_KEY[k].engine for k in args.engines])
    say("engine modules imported")
    rows = []
    for key in args.engines:
        c = BY_KEY[key]
        if c.engine == "megatron" and not cuda:
            import_plugins(["tests.plugins.megatron_cpu"])  # CPU only: megatron-core calls CUDA directly
        rows.append(bench_one(c, args, env))
    if rank == 0:
        print(table(rows, args), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    teardown(comm)
    sys.stdout.flush()
    MPI.Finalize()
    os._exit(0)  # DeepSpeed and megatron-core keep gloo threads that abort interpreter finalization


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"train engines: {args.model_size} model, {RANKS} ranks, batch {args.batch} x {args.seq}, "
             f"median of {args.steps} steps after {args.warmup} warm-up",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        cells = [r["engine"], r["config"], f"{r['step_s']:.3f}", f"{r['cpu_s']:.3f}", f"{r['peak_mib']:.0f}", f"{r['engine_mib']:.0f}",
                 f"{r['trained'] / 1e6:.2f}M", f"{r['sync_mib']:.1f}", f"{r['sync_s']:.3f}",
                 "-" if r.get("adapter_mib") is None else f"{r['adapter_mib']:.1f}",
                 "-" if r.get("adapter_s") is None else f"{r['adapter_s']:.3f}",
                 f"{r['loss_first']:.7f}", f"{r['loss_after']:.7f}", mfu]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="15m", help="random-init Qwen2 shape")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (split over dp)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens of each sequence")
    p.add_argument("--warmup", type=int, default=1, help="steps before timing")
    p.add_argument("--steps", type=int, default=3, help="timed steps (the median is reported)")
    p.add_argument("--engines", default=",".join(BY_KEY), help=f"comma-separated subset of {','.join(BY_KEY)}")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="CPU: torch threads per rank")
    p.add_argument("--hardware", help="CUDA: profile in rlbatch/conf/hardware/ (default: by device name)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA is available")
    p.add_argument("--quick", action="store_true", help="a tiny model and batch (a smoke test of the code path)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    keys = [k for k in args.engines.split(",") if k]
    if unknown := [k for k in keys if k not in BY_KEY]:
        p.error(f"--engines: unknown {unknown}; choose from {','.join(BY_KEY)}")
    if not keys:
        p.error("--engines: empty")
    args.engines = keys
    for name in ("batch", "steps", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.batch % 2:
        p.error(f"--batch {args.batch} must be even (split over 2 data-parallel ranks)")
    if not 0 < args.prompt_len < args.seq:
        p.error(f"--prompt-len {args.prompt_len} must be between 0 and --seq {args.seq}")
    if args.worker:
        return worker(args)
    mpiexec = Path(sys.executable).parent / "mpiexec"
    forward = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--worker"]
    cmd = [str(mpiexec), "-n", str(RANKS), sys.executable, str(Path(__file__).resolve()), "--worker", *forward]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS=str(args.threads))
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
