"""Peak host memory of each phase of a colocated run, beside the planner's prediction and the floor.

    python tools/bench/memory.py [--size 0.5b|tiny] [--steps 3] [--no-offload] [--default-malloc] [--out DIR] [--json PATH]

Writes a model directory of Qwen2.5-0.5B's shape (tools/bench/gpu.py's QWEN2_5: hidden 896, FFN
4864, 24 layers, 14 heads, 2 KV heads, vocab 151936, tied embeddings; 494M parameters), random-
initialised and stored in bf16 as Qwen's own checkpoints are, with rlbatch's character tokenizer.
A directory, not the random-init fields of ``model``: a random-init model's vocabulary is its
tokenizer's (18 tokens), and Qwen2.5's 151936-row embedding is 27% of its parameters.

Then runs ``python -m rlbatch.launch`` on it with the default colocated preset (actor_train
fsdp:d2, actor_infer hf:d2 and reference fsdp:d2 on two CPU ranks, a CPU reward worker) for a few
small steps, and prints, per phase, the peak RSS of the busier of the two ranks (``host/peak/*``
in metrics.jsonl: the kernel's high-water mark, reset at every phase end, so exact; the ranks
return freed memory to the OS, see ``MALLOC``), beside:

- the planner's prediction for the same config on the ``cpu`` profile, per rank: the process
  itself, the state resident in the phase, the host copies offload keeps, the phase's transients
  (``rlbatch.plan.predict.rank_host_bytes``);
- the floor: the bytes the roles' state must take on a rank (fp32 on CPU): actor_train's shard of
  the weights, and from its first step of their gradients and AdamW moments, the reference's shard,
  actor_infer's whole replica.

Criteria, each printed with the numbers (exit code 1 when one fails): the start-up holds less than
a whole fp32 model beyond the floor; the weight sync peaks at most one FSDP unit (the largest: the
embedding) above the train phase; the planner is never below a measured peak.

On a CPU node offload copies host to host and keeps both copies (a reusable host buffer beside the
state in use), so offload costs the roles' state twice over; the planner counts that, and the
bench checks before it starts that the planner's figure for the node fits in the memory available
(``--no-offload`` runs the same placement with every role's ``offload=false``).
``--size tiny`` runs the same code on a 2-layer model in seconds (CI), where the fixed cost of a
process dwarfs the model: the start-up and sync criteria are reported, not enforced.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmark this checkout's rlbatch
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu import QWEN2_5  # noqa: E402  (tools/bench/gpu.py: the published configs)

GiB = float(1 << 30)
PHASES = ("startup", "generate", "ref_logprobs", "train", "sync")
WORKLOAD = ["algo.prompts_per_step=2", "algo.samples_per_prompt=2", "algo.max_new_tokens=4", "algo.mini_batches=1"]
"""Small on purpose: the peaks of the roles' state matter here, not speed (4 sequences of 9 tokens)."""
SEED = 1
MALLOC = {"MALLOC_MMAP_THRESHOLD_": 128 << 10, "MALLOC_TRIM_THRESHOLD_": 128 << 10}
"""glibc settings for the ranks (``cluster.env``). The launchers give CPU-device ranks thresholds that
keep every freed block below 4 GiB for reuse (``rlbatch.runtime.env.CPU_DEVICE_ENV``: an offload and
reload then reuse the same pages), so such a rank's RSS is its heap's high-water mark, fragments
included, not the memory it uses: at 0.5B it passed 13 GiB in the first step (live tensors: under 8)
and went on growing. With blocks of 128 KiB and more given back when freed, the RSS is the memory
in use, which is what the planner counts. ``--default-malloc`` keeps the launchers' settings."""


def model_dir(size: str, out: Path) -> Path:
    """The model directory (written once, in a child process so its memory is returned before the run)."""
    path = out / f"qwen2.5-{size}-random-bf16"
    if not (path / "config.json").is_file():
        subprocess.run([sys.executable, __file__, "--write-model", size, str(path)], check=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return path


def write_model(size: str, path: Path) -> None:
    import torch

    from rlbatch.config.schema import ModelConfig
    from rlbatch.data.tokenizer import build_char_tokenizer
    from rlbatch.models.spec import spec_from_model_config
    from rlbatch.models.tiny import build_tiny_model

    fields = dict(QWEN2_5[size])
    vocab = int(fields.pop("vocab"))
    tok = build_char_tokenizer()
    spec = spec_from_model_config(ModelConfig(arch="qwen2", tie_word_embeddings=True, max_position_embeddings=32768,
                                              **fields), vocab=vocab)
    model = build_tiny_model(spec, SEED, tok).to(torch.bfloat16)
    tmp = path.with_name(path.name + ".partial")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(path)


def overrides(path: Path, steps: int, offload: bool, malloc: bool = True) -> list[str]:
    out = [f"model.path={path}", f"steps={steps}", f"seed={SEED}", *WORKLOAD]
    if malloc:
        out += [f"+cluster.env.{k}={v}" for k, v in MALLOC.items()]
    if not offload:
        out += [f"roles.{r}.offload=false" for r in ("actor_train", "actor_infer", "reference")]
    return out


def planned(over: list[str]) -> dict[str, Any]:
    """The planner's per-rank host bytes by phase on the cpu profile, and its node total."""
    from rlbatch.checks.validate import check
    from rlbatch.config.compose import compose
    from rlbatch.config.hardware import load_hardware
    from rlbatch.config.parse import parsed
    from rlbatch.plan.fit import predict_config
    from rlbatch.plan.predict import rank_host_bytes

    cfg = compose(over)
    typed = parsed(cfg)
    # A random model over 151936 tokens almost never samples EOS: every response runs to the cap.
    pred = predict_config(typed, check(cfg, runnable=False), load_hardware("cpu"),
                          response_mean=float(typed.algo.max_new_tokens))
    gpu = next(g for g in pred.gpus if "actor_train" in g.roles)
    return {"per_rank": rank_host_bytes(pred, gpu), "node": pred.host_bytes, "params": pred.shape.params,
            "unit": 4.0 * max(pred.shape.layer_params, pred.shape.embedding_params)}


def available_bytes() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return float(line.split()[1]) * 1024
    return 0.0


def floors(params: float, d: int = 2) -> dict[str, float]:
    """Bytes the roles' state must take on one rank, fp32: actor_train's shard (and, once it has
    trained, its gradients and AdamW's two moments), the reference's shard, actor_infer's replica."""
    start = 4 * params / d + 4 * params / d + 4 * params
    steady = 16 * params / d + 4 * params / d + 4 * params
    return {"startup": start, "generate": steady, "ref_logprobs": steady, "train": steady, "sync": steady}


def measured(run_dir: Path) -> dict[str, float]:
    """Per phase, the highest peak over the run's steps (the busiest rank of each)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out: dict[str, float] = {}
    for row in rows:
        for phase in PHASES:
            v = row.get(f"host/peak/{phase}")
            if v:
                out[phase] = max(out.get(phase, 0.0), float(v))
    return out


def run(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    path = model_dir(args.size, out)
    over = overrides(path, args.steps, not args.no_offload, not args.default_malloc)
    plan = planned(over)
    avail = available_bytes()
    print(f"model {path.name}: {plan['params'] / 1e6:.1f}M parameters; the planner puts the node at "
          f"{plan['node'] / GiB:.1f} GiB, {avail / GiB:.1f} GiB available", flush=True)
    if plan["node"] > avail:
        print(f"not starting: {plan['node'] / GiB:.1f} GiB predicted > the {avail / GiB:.1f} GiB available"
              + ("" if args.no_offload else " (--no-offload keeps one copy of each role's state)"), file=sys.stderr)
        return 2
    run_dir = out / f"run-{args.size}-{'offload' if not args.no_offload else 'no-offload'}-{time.strftime('%Y%m%d-%H%M%S')}"
    cmd = [sys.executable, "-m", "rlbatch.launch", *over, f"run_dir={run_dir}"]
    print("$ " + " ".join(cmd[1:]), flush=True)
    when, load_before = time.strftime("%Y-%m-%d %H:%M"), os.getloadavg()
    start = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                         timeout=args.timeout)
    (out / "launch.log").write_text(res.stdout + res.stderr)
    if res.returncode:
        print(res.stdout[-2000:] + res.stderr[-3000:], file=sys.stderr)
        return res.returncode
    got = measured(run_dir)
    floor = floors(plan["params"])
    whole = 4.0 * plan["params"]
    rows, checks = [], []
    for phase in PHASES:
        m, p, f = got.get(phase, 0.0), plan["per_rank"].get(phase, 0.0), floor[phase]
        rows.append({"phase": phase, "measured": m, "planner": p, "floor": f, "beyond_floor": m - f})
        checks.append((f"planner >= measured, {phase}", p >= m, f"{p / GiB:.2f} GiB vs {m / GiB:.2f} GiB"))
    begin = got.get("startup", 0.0) - floor["startup"]
    checks.append(("start-up beyond the floor < a whole fp32 model", begin < whole,
                   f"{begin / GiB:.2f} GiB vs {whole / GiB:.2f} GiB"))
    extra = got.get("sync", 0.0) - got.get("train", 0.0)
    checks.append(("sync <= train + one FSDP unit", extra <= plan["unit"],
                   f"sync - train = {extra / GiB:+.2f} GiB vs {plan['unit'] / GiB:.2f} GiB (the embedding, fp32)"))
    load = f"load average {load_before[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    print(f"\n{when}, {os.cpu_count()} cores, {load}; peak RSS per rank (the busier of ranks 0-1), "
          f"{args.steps} steps in {time.perf_counter() - start:.0f} s, offload {'off' if args.no_offload else 'on'}:")
    print(f"{'phase':<14}{'measured':>14}{'planner':>14}{'floor':>14}{'beyond floor':>14}")
    for r in rows:
        print(f"{r['phase']:<14}" + "".join(f"{r[k] / GiB:10.2f} GiB" for k in ("measured", "planner", "floor", "beyond_floor")))
    failed = []
    for name, ok, detail in checks:
        enforced = args.size != "tiny" or name.startswith("planner")  # a tiny model is below the noise
        print(f"{'ok  ' if ok else ('FAIL' if enforced else 'n/a ')} {name}: {detail}")
        if not ok and enforced:
            failed.append(name)
    result = {"size": args.size, "steps": args.steps, "offload": not args.no_offload, "command": " ".join(cmd[1:]),
              "date": when, "load": load,
              "params": plan["params"], "rows": rows, "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in checks],
              "run_dir": str(run_dir)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=["0.5b", "tiny"], default="0.5b", help="Qwen2.5-0.5B's shape, or a 2-layer one (CI)")
    p.add_argument("--steps", type=int, default=3, help="RL steps to run")
    p.add_argument("--no-offload", action="store_true", help="every role's offload=false (one copy of each state)")
    p.add_argument("--out", default=str(ROOT / ".test-runs" / "bench-memory"), help="model directory and runs go here")
    p.add_argument("--timeout", type=float, default=3600, help="seconds the run may take")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    p.add_argument("--default-malloc", action="store_true", help="keep the launchers' glibc settings for CPU ranks (see MALLOC)")
    p.add_argument("--write-model", nargs=2, metavar=("SIZE", "PATH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.write_model:
        write_model(args.write_model[0], Path(args.write_model[1]))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
