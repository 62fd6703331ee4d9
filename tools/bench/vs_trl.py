"""rlbatch against TRL's GRPOTrainer: the same GRPO workload, one after the other, one machine.

    python tools/bench/vs_trl.py [--steps 80] [--ranks 1,2] [--out .bench-runs/vs_trl] [--baseline ../rlbatch-old]
    python tools/bench/vs_trl.py --workload long --engine vllm   # long responses, both sides on vLLM

Needs the `bench` extra (`pip install -e ".[bench]"`: trl, matplotlib). Both frameworks get
the same random-initialised Qwen2 weights and character tokenizer (saved once as an ordinary
Hugging Face directory), the same prompts in the same order, samples per prompt,
max_new_tokens, batch and mini-batch sizes, optimiser, learning-rate schedule, clip range, KL
coefficient, reward function and number of steps. The workload is rlbatch's default
experiment (single-digit addition mod 10, learned from scratch) unless overridden.

``--workload long`` is the same task at length, on a wider model (hidden 256, 4 layers, head_dim 64,
~4M parameters): up to 64 new tokens, 16 prompts x 8 samples per step, scored by
``answer_repeated`` (the share of the 64 characters that repeat the answer: every token counts,
and stopping early only loses reward, so responses stay long). Both frameworks start from the same
warm start (``--warm-start-steps``, not timed): rlbatch first trains the model on the 2-token task
with ``leading_number_match``, so it knows the answer but not to repeat it; the comparison then
learns to repeat it.
``--engine vllm`` makes both sides generate with vLLM: rlbatch's ``vllm`` engine on its
actor_infer ranks (colocated with training), TRL's ``use_vllm=True, vllm_mode="colocate"``
(vLLM in the trainer's process, weights loaded into it after every step). Both get the same
KV-cache space (``--kv-cache-gb``); TRL's vLLM importance-sampling correction is off, as
rlbatch's synchronous loop has none. Both run vLLM's compiled model (TRL leaves vLLM's default;
rlbatch's engine gets ``cpu_compile=true``, since on CPU it runs eager by default).

Each framework runs in its own process; start-up (imports, model load, process launch) is
reported but kept out of the throughput: samples/s = samples generated and trained on ÷
the time of the training steps. Prints each framework's samples/s, generated tokens/s and
median seconds per phase, the reward at the start and the end (both must learn), the exact
settings, writes results.json and reward_curves.png (with matplotlib) under --out, and ends
with one line: `speedup vs TRL: N.NNx` (rlbatch's best samples/s over TRL's).

Before that line, the arithmetic bound: the FLOPs of each framework's log-prob and training passes
(from the model's shape and the step's tokens), the GFLOP/s each reached against this CPU's fp32
matmul peak, and `ceiling vs TRL at this arithmetic`: the speedup over TRL of a framework that
generated as fast as the fastest generate phase measured and ran those passes at the peak. On a
machine where that ceiling is low, no framework doing the same work can be much faster than TRL.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # runnable from a checkout

PHASES = ("generate", "score", "logprobs", "train", "other")
"""Common phase names. rlbatch's ref_logprobs + old_logprobs are 'logprobs'; its weight sync,
offload/reload and control plane are 'other'. TRL computes reference and old log-probs inside
its generation step: they are timed on their own and reported as 'logprobs'."""

ONE_RANK = ["roles.actor_train.device_mapping=[0]", "roles.actor_train.backend=fsdp:d1",
            "roles.actor_infer.device_mapping=[0]", "roles.reference.device_mapping=[0]"]
"""The default colocated placement on one GPU rank instead of two."""

WORKLOADS = {
    "default": {"prompts": 32, "samples": 32, "max_new_tokens": 2, "overrides": [], "warm_start_steps": 0},
    "long": {"prompts": 16, "samples": 8, "max_new_tokens": 64, "warm_start_steps": 60,
             "overrides": ["model.hidden_size=256", "model.intermediate_size=1024", "model.num_layers=4",
                           "model.num_heads=4", "model.num_kv_heads=1", "model.max_position_embeddings=128",
                           "model.initializer_range=0.02", "algo.lr=3e-4",
                           "data.reward_fn=rlbatch.rewards.rules:answer_repeated"]},
}
"""Per workload: the defaults of --prompts/--samples/--max-new-tokens/--warm-start-steps and its
Hydra overrides. The long workload's model is 4x wider than the default's: HF's initializer_range
and a 5x lower learning rate (at the default's 0.1 and 1.5e-3 its policy collapses, entropy 0,
without learning)."""

WARM_START = ["algo.prompts_per_step=32", "algo.samples_per_prompt=32", "algo.max_new_tokens=2",
              "data.reward_fn=rlbatch.rewards.rules:leading_number_match"]
"""The warm start's own overrides: the default experiment's batch and 2-token responses, scored on the
number a response starts with, so the model learns the answer but not to stop after it."""


# ----------------------------------------------------------------------------- the workload


def workload_overrides(args: argparse.Namespace) -> list[str]:
    """The Hydra overrides that define the workload (both frameworks read the composed config)."""
    return [f"seed={args.seed}", f"steps={args.steps}", f"algo.prompts_per_step={args.prompts}",
            f"algo.samples_per_prompt={args.samples}", f"algo.max_new_tokens={args.max_new_tokens}",
            *WORKLOADS[args.workload]["overrides"], *args.override]


def settings(cfg: Any) -> dict[str, Any]:
    """The workload as one flat dict, printed and handed to the TRL process."""
    a = cfg.algo
    return {
        "seed": int(cfg.seed), "steps": int(cfg.steps), "prompts_per_step": int(a.prompts_per_step),
        "samples_per_prompt": int(a.samples_per_prompt), "max_new_tokens": int(a.max_new_tokens),
        "temperature": float(a.temperature), "top_p": float(a.top_p), "lr": float(a.lr),
        "warmup_optimizer_steps": int(a.warmup_steps), "weight_decay": float(a.weight_decay),
        "grad_clip": float(a.grad_clip), "mini_batches": int(a.mini_batches), "epochs": int(a.epochs),
        "clip_low": float(a.clip_low), "clip_high": float(a.clip_high), "kl_coef": float(a.kl_coef),
        "reward_fn": str(cfg.data.reward_fn), "model": f"qwen2 random-init, hidden {cfg.model.hidden_size}, "
        f"{cfg.model.num_layers} layers, {cfg.model.num_heads} heads ({cfg.model.num_kv_heads} kv), "
        f"initializer_range {cfg.model.initializer_range}",
        "max_model_len": int(cfg.model.max_position_embeddings),
    }


def warm_start(args: argparse.Namespace, out: Path) -> Path | None:
    """The starting model of a workload with warm-start steps: rlbatch trains the workload's model on
    the 2-token task (WARM_START) and exports it. Both frameworks then start from that directory."""
    if args.warm_start_steps <= 0:
        return None
    run_dir, model_dir = out / "warm-start", out / "warm-start-model"
    # The workload's overrides, then the warm start's: Hydra's later value of a key wins.
    cmd = [sys.executable, "-m", "rlbatch.launch", *workload_overrides(args), f"steps={args.warm_start_steps}", *WARM_START,
           *ONE_RANK, "roles.actor_infer.backend=hf:d1", f"run_dir={run_dir}", "resume=never",
           f"cluster.cpus_per_task={args.threads}"]
    print(f"\n== warm start: {args.warm_start_steps} rlbatch steps on the 2-token task, not timed\n$ {' '.join(cmd[1:])}",
          flush=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    subprocess.run([sys.executable, "-m", "rlbatch.export", str(run_dir), str(model_dir)], check=True, cwd=ROOT,
                   env=env, stdout=subprocess.DEVNULL)
    rewards = [json.loads(line)["reward_mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print(f"warm start: reward {rewards[0]:.3f} -> {rewards[-1]:.3f}; both frameworks start from {model_dir}")
    return model_dir


def prepare(args: argparse.Namespace, out: Path, start: Path | None) -> tuple[dict[str, Any], Path, Path]:
    """Compose the config, save the initial weights and tokenizer (random-initialised, or ``start``'s),
    and write the prompt order."""
    from rlbatch.config.compose import compose
    from rlbatch.data.source import make_stream
    from rlbatch.engines.model import load_model, load_tokenizer

    cfg = compose(workload_overrides(args))
    s = settings(cfg)
    if s["epochs"] != 1 or int(cfg.algo.grad_accum) != 1 or cfg.algo.loss_agg != "token" or cfg.algo.kl_estimator != "k3":
        sys.exit("vs_trl: the TRL mapping covers epochs=1, grad_accum=1, loss_agg=token and kl_estimator=k3 only")
    s["start"] = f"warm start: {args.warm_start_steps} steps of {' '.join(WARM_START)}" if start else "random init"
    model_dir = start or out / "model"
    if start is None:
        tok = load_tokenizer(cfg.model)
        load_model(cfg.model, tok, seed=int(cfg.seed)).save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    stream, _ = make_stream(cfg.data, seed=int(cfg.seed))
    prompts = [{"prompt": x.prompt, "answer": x.answer} for x in stream.next_batch(s["steps"] * s["prompts_per_step"])]
    prompt_file = out / "prompts.json"
    prompt_file.write_text(json.dumps(prompts))
    return s, model_dir, prompt_file


# ----------------------------------------------------------------------------- rlbatch


def _variant(text: str) -> tuple[str, tuple[str, ...]]:
    label, sep, overrides = text.partition(":")
    if not sep or not label.strip() or not overrides.strip():
        raise argparse.ArgumentTypeError(f"expected LABEL:OVERRIDE[,OVERRIDE...], got {text!r}")
    return label.strip(), tuple(o.strip() for o in overrides.split(",") if o.strip())


def run_rlbatch(args: argparse.Namespace, out: Path, model_dir: Path, ranks: int, root: Path = ROOT,
                label: str = "rlbatch", extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """rlbatch from the checkout ``root`` (this one, or --baseline's) on the workload, with
    ``extra`` overrides (a ``--variant``'s)."""
    run_dir = out / f"{label}-{ranks}rank"
    placement = ONE_RANK if ranks == 1 else [] if ranks == 2 else None
    if placement is None:
        sys.exit(f"--ranks: 1 or 2 GPU ranks, got {ranks}")
    threads = max(1, args.threads // ranks)
    engine = [f"roles.actor_infer.backend={args.engine}:d{ranks}"]
    if args.engine == "vllm":  # compiled, as TRL's vLLM runs (vLLM's default; rlbatch's CPU default is eager)
        engine += [f"+roles.actor_infer.engine_args.kv_cache_mb={args.kv_cache_gb * 1024}",
                   "+roles.actor_infer.engine_args.cpu_compile=true"]
    cmd = [sys.executable, "-m", "rlbatch.launch", *workload_overrides(args), *placement, *engine,
           "model=hf_local", f"model.path={model_dir}", f"run_dir={run_dir}", "resume=never",
           f"cluster.cpus_per_task={threads}", *extra]
    print(f"\n== {label} ({root}), {ranks} GPU rank(s), {threads} thread(s) each\n$ {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=root, env=dict(os.environ, PYTHONPATH=str(root)))
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = []
    for r in rows:
        known = {"generate": r["time/generate"], "score": r["time/score"],
                 "logprobs": r.get("time/ref_logprobs", 0.0) + r.get("time/old_logprobs", 0.0), "train": r["time/train"]}
        known["other"] = max(0.0, r["time/step"] - sum(known.values()))
        steps.append({"seconds": r["time/step"], "reward": r["reward_mean"], "gen_tokens": r["tokens/generated"],
                      "tokens": r["tokens/total"], "phases": known})
    return {"name": f"{label} {ranks} rank{'s' if ranks > 1 else ''}", "wall": wall, "steps": steps}


# ----------------------------------------------------------------------------- TRL


def trl_worker(spec_path: Path) -> None:
    """Train with TRL's GRPOTrainer (runs in its own process); write per-step records."""
    spec = json.loads(spec_path.read_text())
    s, out = spec["settings"], Path(spec["out"])
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlbatch.rewards.rules import load_reward_fn

    score_one = load_reward_fn(s["reward_fn"])
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    batch = s["prompts_per_step"] * s["samples_per_prompt"]
    log: dict[str, Any] = {"rewards": [], "gen_tokens": [], "t": defaultdict(float), "steps": []}

    def reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]], answer: list[str],
               **_: Any) -> list[float]:
        # Decoded as rlbatch decodes for its reward (special tokens kept, the rule cuts at <eos>).
        texts = [tok.decode(ids, skip_special_tokens=False) for ids in completion_ids]
        values = [score_one(t, a) for t, a in zip(texts, answer, strict=True)]
        log["rewards"].append(sum(values) / len(values))
        log["gen_tokens"].append(sum(len(ids) for ids in completion_ids))
        return values

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                log["t"][name] += time.perf_counter() - t0
        return wrapper

    class Timed(GRPOTrainer):
        """GRPOTrainer with its generation, scoring and whole generation step timed."""

        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            self._generate = timed("generate", self._generate)  # type: ignore[method-assign]
            self._calculate_rewards = timed("score", self._calculate_rewards)  # type: ignore[method-assign]
            self._generate_and_score_completions = timed("gen_step", self._generate_and_score_completions)  # type: ignore[method-assign]

    class StepClock(TrainerCallback):
        """One record per RL step (mini_batches optimizer steps), from the clock and the timers."""

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, a: Any, state: Any, *_: Any, **__: Any) -> None:
            if state.global_step % s["mini_batches"]:
                return
            now, t = time.perf_counter(), dict(log["t"])
            log["t"].clear()
            gen_step = t.get("gen_step", 0.0)
            phases = {"generate": t.get("generate", 0.0), "score": t.get("score", 0.0),
                      "logprobs": max(0.0, gen_step - t.get("generate", 0.0) - t.get("score", 0.0))}
            phases["train"] = max(0.0, (now - self.start) - gen_step)
            phases["other"] = 0.0
            log["steps"].append({"seconds": now - self.start, "reward": log["rewards"][-1],
                                 "gen_tokens": log["gen_tokens"][-1], "phases": phases})
            self.start = now

    config = GRPOConfig(
        output_dir=str(out / "trl"), seed=s["seed"], use_cpu=True, bf16=False, report_to=[],
        save_strategy="no", logging_steps=1, disable_tqdm=False, dataloader_num_workers=0,
        max_steps=s["steps"] * s["mini_batches"],
        per_device_train_batch_size=batch // s["mini_batches"], gradient_accumulation_steps=1,
        steps_per_generation=s["mini_batches"], num_iterations=s["epochs"],
        num_generations=s["samples_per_prompt"], max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"], top_p=s["top_p"], top_k=0, shuffle_dataset=False,
        learning_rate=s["lr"], lr_scheduler_type="constant_with_warmup", warmup_steps=s["warmup_optimizer_steps"],
        weight_decay=s["weight_decay"], max_grad_norm=s["grad_clip"] or 1e9,
        beta=s["kl_coef"], epsilon=s["clip_low"], epsilon_high=s["clip_high"],
        loss_type="dapo", scale_rewards="group", mask_truncated_completions=False,
        **vllm_settings(spec),
    )
    prompts = json.loads(Path(spec["prompts"]).read_text())
    trainer = Timed(model=model, reward_funcs=reward, args=config, processing_class=tok,
                    train_dataset=Dataset.from_list(prompts), callbacks=[StepClock()])
    if spec["engine"] == "vllm":
        layerwise_sync(trainer.vllm_generation)
    trainer.train()
    Path(spec["result"]).write_text(json.dumps(log["steps"]))


def vllm_settings(spec: dict[str, Any]) -> dict[str, Any]:
    """GRPOConfig's vLLM arguments: vLLM in the trainer's process (``colocate``), on-policy."""
    if spec["engine"] != "vllm":
        return {}
    return {"use_vllm": True, "vllm_mode": "colocate", "vllm_tensor_parallel_size": 1,
            "vllm_max_model_length": spec["settings"]["max_model_len"],
            "vllm_importance_sampling_correction": False}


def layerwise_sync(generation: Any) -> None:
    """Run TRL's colocated weight sync inside one vLLM layerwise reload, as vLLM's own ``reload_weights``
    does. TRL loads each parameter straight into vLLM's model (``model.load_weights([(name, p)])``).
    On a CPU where vLLM packs its linear layers for oneDNN (seen on an AVX-512 EPYC), packing drops their weight
    and its loader, and that call fails ("'Parameter' object has no attribute 'weight_loader'").
    initialize/finalize_layerwise_reload restore the layers and repack them; TRL's loop runs
    unchanged between them (closed as rlbatch's engine closes its reloads, tied lm_head included). This is the path rlbatch's vllm engine
    syncs through, so both frameworks pay the same repacking."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    from rlbatch.engines.vllm.engine import finish_layerwise_reload

    sync = generation.sync_weights

    def layerwise() -> None:
        worker = generation.llm.llm_engine.model_executor.driver_worker
        model = worker.model_runner.model
        with set_current_vllm_config(worker.vllm_config):
            initialize_layerwise_reload(model)
            sync()
            finish_layerwise_reload(model, worker.vllm_config)

    generation.sync_weights = layerwise


def run_trl(args: argparse.Namespace, out: Path, s: dict[str, Any], model_dir: Path, prompts: Path) -> dict[str, Any]:
    spec = out / "trl_spec.json"
    result = out / "trl_steps.json"
    spec.write_text(json.dumps({"settings": s, "out": str(out), "model_dir": str(model_dir), "prompts": str(prompts),
                                "threads": args.threads, "result": str(result), "engine": args.engine}))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(args.threads))
    if args.engine == "vllm":  # vLLM's CPU KV cache in whole GiB, which TRL has no argument for
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gb)
    print(f"\n== TRL GRPOTrainer, 1 process, {args.threads} thread(s), {args.engine} generation", flush=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--trl-worker", str(spec)], check=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - start
    return {"name": "TRL GRPOTrainer", "wall": wall, "steps": json.loads(result.read_text())}


# ----------------------------------------------------------------------------- report


def summarise(run: dict[str, Any], batch: int) -> dict[str, Any]:
    steps = run["steps"]
    seconds = sum(x["seconds"] for x in steps)
    k = max(1, min(5, len(steps) // 4))
    rewards = [x["reward"] for x in steps]
    return {
        "name": run["name"], "steps": len(steps), "train_seconds": seconds, "startup_seconds": run["wall"] - seconds,
        "samples_per_s": len(steps) * batch / seconds,
        "gen_tokens_per_s": sum(x["gen_tokens"] for x in steps) / seconds,
        "phase_median_s": {p: statistics.median(x["phases"][p] for x in steps) for p in PHASES},
        "step_median_s": statistics.median(x["seconds"] for x in steps),
        "reward_start": statistics.fmean(rewards[:k]), "reward_end": statistics.fmean(rewards[-k:]),
        "rewards": rewards, "gen_tokens_per_step": statistics.fmean(x["gen_tokens"] for x in steps),
        "prompt_tokens_per_step": statistics.fmean(x["tokens"] - x["gen_tokens"] for x in steps) if "tokens" in steps[0] else None,
    }


# ----------------------------------------------------------------------------- the arithmetic bound


def step_flops(shape: Any, s: dict[str, Any], tokens: float) -> float:
    """FLOPs of the log-prob and training passes one step of the workload needs, whoever runs it:
    a forward pass of the reference (kl_coef > 0) and of the policy before its updates over the
    mini-batches after the first (the first one's old log-probs are its training forward's), and
    forward + backward (3 forward passes) of every sample per epoch. ``tokens``: prompt and response
    tokens of the step. Per token ``shape.fwd_flops_per_token`` at half the mean sequence length
    (attention over the earlier tokens; the mean length undercounts it, so the bound stays a bound).
    Generation is left out: it is timed as it runs."""
    batch = s["prompts_per_step"] * s["samples_per_prompt"]
    forward = tokens * shape.fwd_flops_per_token(tokens / batch / 2)
    old = 1.0 if s["epochs"] > 1 else (s["mini_batches"] - 1) / s["mini_batches"]
    return forward * ((1.0 if s["kl_coef"] > 0 else 0.0) + old + 3.0 * s["epochs"])


def arithmetic(s: dict[str, Any], model_dir: Path, results: list[dict[str, Any]], threads: int) -> dict[str, Any]:
    """The arithmetic bound of the comparison: each framework's log-prob and training passes in
    GFLOP/s against this CPU's fp32 matmul peak (the best of square matmuls on one thread, times
    ``threads``: data parallelism at no cost), and the most any framework running that arithmetic
    could beat TRL by here, generating as fast as the fastest generate phase measured. Token counts
    are each run's own (TRL's prompts are rlbatch's: the same prompts in the same order)."""
    from rlbatch.models.shape import shape_from_hf_config
    from rlbatch.plan.measure import matmul_flops

    shape = shape_from_hf_config(json.loads((model_dir / "config.json").read_text()))
    batch = s["prompts_per_step"] * s["samples_per_prompt"]
    prompt = next(r["prompt_tokens_per_step"] for r in results if r["prompt_tokens_per_step"] is not None)
    peak = threads * max(matmul_flops(1).values())
    rows = {}
    for r in results:
        flops = step_flops(shape, s, prompt + r["gen_tokens_per_step"])
        busy = r["phase_median_s"]["logprobs"] + r["phase_median_s"]["train"]
        rows[r["name"]] = {"gflop": flops / 1e9, "seconds": busy, "gflop_per_s": flops / busy / 1e9}
    trl = next(r for r in results if r["name"].startswith("TRL"))
    fastest = min(r["phase_median_s"]["generate"] for r in results)
    least = min(v["gflop"] for v in rows.values()) * 1e9
    floor = fastest + least / peak
    return {"peak_gflop_per_s": peak / 1e9, "threads": threads, "runs": rows, "generate_s": fastest,
            "floor_step_s": floor, "ceiling": batch / floor / trl["samples_per_s"]}


def print_arithmetic(a: dict[str, Any]) -> None:
    print(f"\n== arithmetic of the log-prob and training passes (fp32 matmul peak here: {a['peak_gflop_per_s']:.0f} GFLOP/s"
          f" on {a['threads']} thread(s))")
    for name, r in a["runs"].items():
        print(f"{name:18} {r['gflop']:7.1f} GFLOP in {r['seconds']:.3f}s = {r['gflop_per_s']:6.1f} GFLOP/s "
              f"({100 * r['gflop_per_s'] / a['peak_gflop_per_s']:.0f}% of peak)")
    print(f"floor of a step: the fastest generate phase ({a['generate_s']:.3f}s) + the least arithmetic at peak "
          f"= {a['floor_step_s']:.3f}s")
    print(f"ceiling vs TRL at this arithmetic: {a['ceiling']:.2f}x (no framework doing these passes beats TRL by more here)")


def report(s: dict[str, Any], results: list[dict[str, Any]], out: Path, bound: dict[str, Any]) -> float:
    print("\n== settings (identical for every framework)")
    for key, value in s.items():
        print(f"  {key:24} {value}")
    print(f"  {'samples per step':24} {s['prompts_per_step'] * s['samples_per_prompt']}")
    head = f"{'':18} {'samples/s':>10} {'gen tok/s':>10} {'step s':>7} " + " ".join(f"{p:>8}" for p in PHASES)
    print("\n== throughput (training steps only; median seconds per step and phase)\n" + head)
    for r in results:
        ph = " ".join(f"{r['phase_median_s'][p]:8.3f}" for p in PHASES)
        print(f"{r['name']:18} {r['samples_per_s']:10.1f} {r['gen_tokens_per_s']:10.1f} {r['step_median_s']:7.3f} {ph}")
    print("(rlbatch scores on its reward rank while its actor ranks compute log-probs: its score time overlaps\n"
          " the logprobs column, and 'other' is what the step took beyond the phases: control plane, weight sync)")
    print("\n== learning (mean reward over the first and last steps) and start-up")
    for r in results:
        learned = r["reward_end"] > r["reward_start"] + 0.5
        print(f"{r['name']:18} reward {r['reward_start']:.3f} -> {r['reward_end']:.3f} "
              f"({'learns' if learned else 'DOES NOT LEARN'}); start-up and teardown {r['startup_seconds']:.1f}s, "
              f"{r['steps']} steps in {r['train_seconds']:.1f}s")
    print_arithmetic(bound)
    (out / "results.json").write_text(json.dumps({"settings": s, "results": results, "arithmetic": bound}, indent=1))
    plot(results, out / "reward_curves.png")
    trl = next(r for r in results if r["name"].startswith("TRL"))
    best = max((r for r in results if r["name"].startswith("rlbatch")), key=lambda r: r["samples_per_s"])
    speedup = best["samples_per_s"] / trl["samples_per_s"]
    print(f"\nresults: {out / 'results.json'}")
    base = [r for r in results if r["name"].startswith("baseline")]
    if base:
        best_base = max(base, key=lambda r: r["samples_per_s"])
        print(f"this checkout vs --baseline: {best['samples_per_s']:.1f} vs {best_base['samples_per_s']:.1f} samples/s "
              f"= {best['samples_per_s'] / best_base['samples_per_s']:.2f}x (TRL: {trl['samples_per_s']:.1f})")
    print(f"speedup vs TRL: {speedup:.2f}x")
    return speedup


def plot(results: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no reward_curves.png)")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for r in results:
        ax.plot(range(len(r["rewards"])), r["rewards"], label=f"{r['name']} ({r['samples_per_s']:.0f} samples/s)")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title("GRPO on the same workload")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="default",
                   help="default: the default experiment; long: a wider model and up to 64 new tokens")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="what generates, on both sides")
    p.add_argument("--kv-cache-gb", type=int, default=1,
                   help="vLLM's KV-cache space in GiB, the same on both sides (--engine vllm; TRL takes whole GiB)")
    p.add_argument("--prompts", type=int, help="prompts per step (default: the workload's)")
    p.add_argument("--samples", type=int, help="samples per prompt (default: the workload's)")
    p.add_argument("--max-new-tokens", type=int, help="default: the workload's")
    p.add_argument("--warm-start-steps", type=int,
                   help="rlbatch steps on the 2-token task before the comparison, 0: none (default: the workload's)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ranks", default="1,2", help="rlbatch GPU-rank counts to run (comma-separated: 1, 2)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="CPU threads per framework (split between rlbatch's GPU ranks)")
    p.add_argument("--out", type=Path, default=ROOT / ".bench-runs" / "vs_trl")
    p.add_argument("--override", action="append", default=[], help="extra Hydra override for the workload")
    p.add_argument("--variant", type=_variant, action="append", default=[],
                   help="LABEL:OVERRIDE[,OVERRIDE...]: rlbatch again (this checkout) with these overrides, e.g. "
                        "packed:+roles.actor_train.engine_args.max_tokens_per_micro_batch=1024 (repeatable)")
    p.add_argument("--baseline", type=Path, help="another rlbatch checkout to run on the same workload, "
                   "alternating with this one (e.g. a worktree of the previous release): before/after in one run")
    p.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_worker:
        trl_worker(args.trl_worker)
        return 0
    for name in ("prompts", "samples", "max_new_tokens", "warm_start_steps"):
        if getattr(args, name) is None:
            setattr(args, name, WORKLOADS[args.workload][name])
    try:
        import trl  # noqa: F401
    except ImportError:
        print("vs_trl: TRL is not installed; pip install -e '.[bench]'", file=sys.stderr)
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    s, model_dir, prompts = prepare(args, out, warm_start(args, out))
    batch = s["prompts_per_step"] * s["samples_per_prompt"]
    runs = [run_trl(args, out, s, model_dir, prompts)]
    for n in args.ranks.split(","):
        runs.append(run_rlbatch(args, out, model_dir, int(n)))
        if args.baseline:
            runs.append(run_rlbatch(args, out, model_dir, int(n), args.baseline.resolve(), "baseline"))
        for label, extra in args.variant:
            runs.append(run_rlbatch(args, out, model_dir, int(n), label=f"rlbatch-{label}", extra=extra))
    results = [summarise(r, batch) for r in runs]
    report(s, results, out, arithmetic(s, model_dir, results, args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
