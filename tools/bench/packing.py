"""Padded against packed micro-batches on a ragged workload, in one run on this machine's CPU.

    python tools/bench/packing.py [--samples 512] [--max-response 384] [--micro-batch 8] [--max-tokens 0]
                                  [--hidden 64] [--layers 2] [--device cpu|cuda] [--dtype fp32|bf16]
                                  [--group 1] [--prompt-len 16,48] [--json PATH]

The workload: ``--samples`` samples with prompts of ``--prompt-len`` tokens (16..48 unless told),
each prompt shared by ``--group`` consecutive samples (1 unless told; a GRPO group of that size
otherwise), and response lengths drawn from a lognormal (sigma 1, cut at ``--max-response``, its median set so the mean is about a quarter of the
cut), random token ids over Qwen2.5's vocabulary (151936) and a random-init qwen2 model of
``--hidden`` / ``--layers`` with that vocabulary (``rlbatch.models.tiny.build_tiny_model``, as
tests/unit/test_packing_forward.py builds its large-vocabulary model), in ``--dtype`` (fp32 unless
told) on ``--device`` (the CPU unless told), sdpa attention (packed rows: varlen, as the engines run
them, where ``rlbatch.engines.attention.available``: bf16/fp16 on CUDA).

Two paths of ``rlbatch.engines.training``, each called as the fsdp engine calls it on one rank
(a plain transformers model, no process group):

- padded (``max_tokens_per_micro_batch`` 0): ``--micro-batch`` samples per forward, right-padded to
  the longest (``pack`` with ``share_prompts``, the engines' default: where a micro-batch's prompts
  repeat enough, each distinct prompt runs once and its responses continue from its cache), the LM
  head at every position, log-probs from fp32 logits; the train pass
  cuts the batch into ``grad_accum`` = samples / micro-batch micro-batches (``weighted_updates``).
- packed: ``--max-tokens`` prompt + response tokens per forward (0: micro-batch x the workload's
  mean tokens per sample, so both paths run about as many real tokens per forward), one ``Flat`` row
  with restarting positions, the LM head only where a response token is scored, chunked log-probs.

Per path, in a child process of its own (so each starts from the same memory and malloc state):
one log-prob pass over the workload (``common.logprobs``) and one train pass (forward and backward
of the GRPO policy loss of every micro-batch, ``weighted_updates`` + ``chunk_loss``; no optimizer
step, the same for both paths). Each pass is preceded by a warm-up forward of two samples. Peak
memory of the log-prob pass, on a GPU: the allocator's peak above what was allocated when the pass
began (``torch.cuda.max_memory_allocated``); on the CPU: the kernel's resident high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs`` after the model and samples are built and warmed) minus the RSS at the
reset; the children run with glibc returning blocks of 128 KiB and more to the OS when freed (as
tools/bench/memory.py's ranks do), so the mark is the memory the pass had in use at its peak, the
allocator's fragments included. The packed log-probs are checked against the padded ones.

Prints a table and ``packing speedup: N.NNx`` (padded seconds / packed seconds) for each pass and
``log-prob peak memory: N.NNx lower``. On CPU, sdpa attends within each sample of a packed row
through a dense [N, N] block-diagonal mask, so attention over a packed row costs as much as over an
unpadded square of its length; on a GPU in bf16/fp16 torch's varlen flash kernel
(``rlbatch.engines.attention``) takes the samples' boundaries instead, so a row costs what its
samples do (fp32 on a GPU keeps sdpa's dense mask). The table names each packed path's attention.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmark this checkout's rlbatch

VOCAB = 151936
"""Qwen2.5's vocabulary: the LM head and the log-softmax over it are most of a small model's cost."""
PAD = 0
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10), "MALLOC_TRIM_THRESHOLD_": str(128 << 10)}
PATHS = ("padded", "packed")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def workload(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(args.seed)
    sigma = 1.0
    # lognormal mean = median * e^(sigma^2 / 2); the cut at max-response lowers it a little
    median = args.max_response / 4 / math.exp(sigma**2 / 2)
    normal = torch.randn(args.samples, generator=g, dtype=torch.float64)
    rlen = (median * torch.exp(sigma * normal)).ceil().clamp(1, args.max_response).long().tolist()
    lo, hi = args.prompt_len
    prompts = [torch.randint(1, VOCAB, (int(torch.randint(lo, hi + 1, (), generator=g)),), generator=g)
               for _ in range(-(-args.samples // args.group))]
    return [{"prompt": prompts[i // args.group], "response": torch.randint(1, VOCAB, (r,), generator=g),
             "old_logprobs": -torch.rand(r, generator=g) * 12, "advantage": torch.randn((), generator=g)}
            for i, r in enumerate(rlen)]


def budget(args: argparse.Namespace, samples: list[dict[str, Any]]) -> int:
    """The packed path's token budget: as given, or micro-batch x the mean tokens of a sample."""
    if args.max_tokens:
        return int(args.max_tokens)
    mean = sum(len(s["prompt"]) + len(s["response"]) for s in samples) / len(samples)
    return int(round(args.micro_batch * mean))


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(",")
    try:
        pair = int(lo), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two integers), got {text!r}") from None
    if not sep or not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 1 <= LO <= HI, got {text!r}")
    return pair


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One path's passes, in this (child) process: seconds, tokens, peak memory, and the log-probs."""
    import torch

    from rlbatch.algos.objective import PolicyObjective
    from rlbatch.config.schema import AlgoConfig
    from rlbatch.engines import training as common
    from rlbatch.engines.attention import prefer_varlen
    from rlbatch.engines.batch import Flat, Shared, pack
    from rlbatch.models.spec import spec_from_model_config
    from rlbatch.models.tiny import build_tiny_model

    torch.set_num_threads(args.threads)
    samples = workload(args)
    packed = args.child == "packed"
    max_tokens = budget(args, samples) if packed else 0
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    spec = spec_from_model_config({"arch": "qwen2", "hidden_size": args.hidden, "intermediate_size": 4 * args.hidden,
                                   "num_layers": args.layers, "num_heads": 4, "num_kv_heads": 2,
                                   "max_position_embeddings": args.max_response + args.prompt_len[1]}, vocab=VOCAB)
    model = build_tiny_model(spec, seed=args.seed)
    torch.nn.Module.to(model, device=device, dtype=getattr(torch, DTYPES[args.dtype]))
    varlen = packed and prefer_varlen(model, device, getattr(torch, DTYPES[args.dtype]))  # as the engines do

    def pack_fn(chunk: list[Any]) -> Any:
        return pack(chunk, PAD, device, share_prompts=True, flat=packed)

    split = common.Split(samples=args.micro_batch, max_tokens=max_tokens)
    # what each forward computes: decoder positions and LM-head positions
    decoder = head = shared = 0
    for chunk in common.chunks(samples, split):
        x = pack_fn(chunk).inputs
        if isinstance(x, Flat):
            decoder += x.input_ids.numel()
            head += x.keep.numel()
        elif isinstance(x, Shared):
            shared += 1
            decoder += x.prefix_ids.numel() + x.suffix_ids.numel()
            head += x.prefix_ids.shape[0] + x.suffix_ids.numel()
        else:
            decoder += x.input_ids.numel()
            head += x.input_ids.numel()
    forwards = len(common.chunks(samples, split))

    model.eval()
    common.logprobs(model, samples[:2], split, pack_fn)  # warm-up: lazy initialisation out of the figures
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
    start = time.perf_counter()
    logp = common.logprobs(model, samples, split, pack_fn)
    if cuda:
        torch.cuda.synchronize()
    t_logprobs = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() if cuda else _status("VmHWM")) - base
    torch.save([x.float().cpu() for x in logp], args.out)
    del logp

    model.train()
    micro = math.ceil(len(samples) / args.micro_batch)
    algo = AlgoConfig(kl_coef=0.0, mini_batches=1, epochs=1, grad_accum=micro)
    objective = PolicyObjective(algo)

    def train(batch: list[Any]) -> int:
        n = 0
        for update in common.weighted_updates(batch, algo, objective, max_tokens):
            for m in update:
                loss, _ = common.chunk_loss(model, pack_fn(m.samples), m.objective)
                (loss / m.divisor).backward()
                n += 1
        return n

    train(samples[:2])
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    train_forwards = train(samples)
    if cuda:
        torch.cuda.synchronize()
    t_train = time.perf_counter() - start
    return {"path": args.child, "max_tokens": max_tokens, "attention": "varlen" if varlen else "sdpa", "micro_batch": 0 if packed else args.micro_batch,
            "forwards": forwards, "shared_prompt_forwards": shared, "train_forwards": train_forwards, "decoder_tokens": decoder, "head_positions": head,
            "logprob_s": t_logprobs, "train_s": t_train, "logprob_peak_bytes": peak}


def run_child(args: argparse.Namespace, path: str, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", path, "--out", str(out), "--samples", str(args.samples),
           "--max-response", str(args.max_response), "--micro-batch", str(args.micro_batch),
           "--max-tokens", str(args.max_tokens), "--hidden", str(args.hidden), "--layers", str(args.layers),
           "--seed", str(args.seed), "--threads", str(args.threads), "--device", args.device, "--dtype", args.dtype,
           "--group", str(args.group), "--prompt-len", f"{args.prompt_len[0]},{args.prompt_len[1]}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT)) | MALLOC
    done = subprocess.run(cmd, env=env, cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--max-response", type=int, default=384)
    p.add_argument("--micro-batch", type=int, default=8, help="padded path: samples per forward")
    p.add_argument("--max-tokens", type=int, default=0, help="packed path: tokens per forward (0: micro-batch x mean)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    p.add_argument("--group", type=int, default=1, help="consecutive samples sharing a prompt (a GRPO group)")
    p.add_argument("--prompt-len", type=_range, default=(16, 48), help="LO,HI: prompt lengths drawn from LO..HI")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    for name in ("samples", "max_response", "micro_batch", "hidden", "layers", "threads", "group"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_tokens < 0:
        p.error(f"--max-tokens must be >= 0, got {args.max_tokens}")
    if args.hidden % 4 or (args.hidden // 4) % 2:
        p.error(f"--hidden {args.hidden} must be a multiple of 8 (4 heads of an even size)")
    if args.child:
        print(json.dumps(child(args)))
        return 0

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    samples = workload(args)
    rlen = [len(s["response"]) for s in samples]
    real = sum(len(s["prompt"]) + r for s, r in zip(samples, rlen, strict=True))
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        res = {path: run_child(args, path, Path(tmp) / f"{path}.pt") for path in PATHS}
        lp = {path: torch.load(Path(tmp) / f"{path}.pt") for path in PATHS}
    diff = max(float((a - b).abs().max()) for a, b in zip(lp["padded"], lp["packed"], strict=True) if a.numel())
    scale = max(float(a.abs().max()) for a in lp["padded"] if a.numel())
    pad, pk = res["padded"], res["packed"]
    speed = {k: pad[f"{k}_s"] / pk[f"{k}_s"] for k in ("train", "logprob")}
    mem = pad["logprob_peak_bytes"] / max(pk["logprob_peak_bytes"], 1)
    report = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": f"{platform.node()}, "
        f"{os.cpu_count()} CPUs, {_cpu_model()}, torch {torch.__version__}"
        + (f", {torch.cuda.get_device_name(0)}" if args.device == "cuda" else ""),
        "load_before": load, "load_after": os.getloadavg(), "samples": args.samples, "group": args.group,
        "prompt_len": list(args.prompt_len), "device": args.device, "dtype": args.dtype,
        "response_mean": sum(rlen) / len(rlen), "response_max": max(rlen), "max_response": args.max_response,
        "real_tokens": real, "response_tokens": sum(rlen), "paths": res, "logprob_max_abs_diff": diff,
        "logprob_max_abs": scale, "speedup": speed, "logprob_memory_lower": mem,
    }
    gib = float(1 << 30)
    print(f"packing bench: {report['date']}, {report['machine']}, {args.threads} threads, "
          f"load {load[0]:.2f} before, {report['load_after'][0]:.2f} after")
    lo, hi = args.prompt_len
    groups = f", groups of {args.group} sharing a prompt" if args.group > 1 else ""
    print(f"workload: {args.samples} samples, prompts {lo}..{hi} tokens{groups}, responses lognormal mean "
          f"{report['response_mean']:.0f} max {max(rlen)} (cut {args.max_response}), {real} real tokens; "
          f"qwen2 hidden {args.hidden}, {args.layers} layers, vocab {VOCAB}, {args.dtype} on {args.device}")
    print(f"  {'':8s} {'per forward':>18s} {'forwards':>9s} {'decoder tok':>12s} {'LM-head pos':>12s} "
          f"{'log-prob s':>11s} {'train s':>9s} {'log-prob peak':>14s}")
    for path, r in res.items():
        per = f"{r['micro_batch']} samples" if path == "padded" else f"<= {r['max_tokens']} tokens ({r['attention']})"
        print(f"  {path:8s} {per:>18s} {r['forwards']:9d} {r['decoder_tokens']:12d} {r['head_positions']:12d} "
              f"{r['logprob_s']:11.2f} {r['train_s']:9.2f} {r['logprob_peak_bytes'] / gib:10.3f} GiB")
    if pad["shared_prompt_forwards"]:
        print(f"  padded: {pad['shared_prompt_forwards']} of {pad['forwards']} forwards ran each distinct prompt once "
              f"(share_prompts); real tokens count each sample's prompt")
    print(f"  decoder tokens computed / real: padded {pad['decoder_tokens'] / real:.2f}x, packed "
          f"{pk['decoder_tokens'] / real:.2f}x (a response's last token is scored, never input)")
    print(f"  packed log-probs vs padded: max |diff| {diff:.2e} (largest |log-prob| {scale:.1f})")
    print(f"packing speedup: {speed['train']:.2f}x (train pass), {speed['logprob']:.2f}x (log-prob pass)")
    print(f"log-prob peak memory: {mem:.2f}x lower")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
