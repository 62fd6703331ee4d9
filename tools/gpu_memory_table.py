"""The planner's expected memory of rlbatch's role presets with Qwen2.5-0.5B, -7B and -32B: the
table in docs/gpu.md, regenerated with

    python tools/gpu_memory_table.py                            # every preset, h100_sxm
    python tools/gpu_memory_table.py --hardware h200 --presets colocated,disaggregated

Nothing is downloaded: each model's config.json (the shapes of Qwen's published config.json files)
is written to a temporary directory, and for each preset and size this runs

    python -m rlbatch.plan roles=<preset> model.path=<dir> hardware=<profile> <WORKLOAD> --json

with WORKLOAD below: the gsm8k experiment's batch (32 prompts x 8 samples, 512-token prompts, up to
256 new tokens) in 2 mini-batches, activation checkpointing, training micro-batches of 4 sequences
per data-parallel rank (``algo.grad_accum`` = 32 / dp) and log-prob forwards of 8 sequences
(``engine_args.micro_batch``) on the training engines that pad (megatron); fsdp and deepspeed pack
at their GPU default (4096 tokens a row, ``rlbatch.engines.defaults``), where neither count is
used. A cell is the most
loaded GPU's peak over a step (and the phase of the peak), and the busiest node's host memory
(offloaded state and processes); a placement that does not fit is marked, with the planner's reason.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
QWEN2_5: dict[str, dict[str, Any]] = {
    # config.json of Qwen/Qwen2.5-0.5B, -7B and -32B (0.49B, 7.61B and 32.5B parameters).
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, max_position_embeddings=131072),
    "32B": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False, max_position_embeddings=131072),
}
COMMON = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", rms_norm_eps=1e-6,
              rope_theta=1000000.0, torch_dtype="bfloat16")
WORKLOAD = ["experiment=gsm8k", "data.path=/data/gsm8k.jsonl", "data.check_path=false", "algo.mini_batches=2",
            "algo.activation_checkpointing=true"]
SEQUENCES_PER_MINI_BATCH = 32 * 8 // 2
TRAIN_MICRO_BATCH = 4
"""Sequences per forward/backward on each data-parallel rank of actor_train."""
LOGPROB_MICRO_BATCH = 8
GIB = 2**30


def preset_args(preset: str) -> list[str]:
    """The overrides a preset needs beyond WORKLOAD: grad_accum for TRAIN_MICRO_BATCH at its
    actor_train's data parallelism, the log-prob micro-batch on each training engine role it
    enables, and PPO where it enables the critic."""
    import yaml

    from rlbatch.placement.backend import parse_backend

    roles = yaml.safe_load((REPO_ROOT / "rlbatch" / "conf" / "roles" / f"{preset}.yaml").read_text())
    train = parse_backend(roles["actor_train"]["backend"])
    dp = train.d * train.c  # the data-parallel shards validation splits a mini-batch over
    critic = bool((roles.get("critic") or {}).get("enabled", True)) and "critic" in roles
    trained = ["actor_train", "reference", *(["critic"] if critic else [])]
    return [f"algo.grad_accum={max(1, SEQUENCES_PER_MINI_BATCH // (dp * TRAIN_MICRO_BATCH))}",
            *(["algo=ppo"] if critic else []),
            *(f"+roles.{r}.engine_args.micro_batch={LOGPROB_MICRO_BATCH}" for r in trained)]


def plan(preset: str, model_dir: Path, hardware: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "rlbatch.plan", f"roles={preset}", f"model.path={model_dir}", f"hardware={hardware}",
           *WORKLOAD, *preset_args(preset), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT)
    if done.returncode not in (0, 1):  # 1: it does not fit, and the JSON says why
        lines = [line.strip(" -") for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        return {"refused": lines[1] if len(lines) > 1 else "; ".join(lines)}
    return json.loads(done.stdout)


def cell(p: dict[str, Any]) -> str:
    if "refused" in p:
        return f"refused: {p['refused']}"
    top = max(p["gpus"], key=lambda g: g["peak_bytes"])
    gpu = f"{top['peak_bytes'] / GIB:.1f} GiB ({top['peak_phase']})"
    if top["peak_bytes"] > p["usable_bytes_per_gpu"]:
        gpu = f"**{gpu} > {p['usable_bytes_per_gpu'] / GIB:.1f} GiB usable**"
    host = f"host {p['host_bytes_per_node'] / GIB:.0f} GiB"
    if any(x.startswith("host RAM") for x in p["problems"]):
        host = f"**{host}: more than a node has**"
    others = [x for x in p["problems"] if not x.startswith(("host RAM", "OOM on GPU"))]
    return f"{gpu}, {host}" + (f" ({'; '.join(others)})" if others else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hardware", default="h100_sxm", help="profile in rlbatch/conf/hardware/")
    ap.add_argument("--presets", help="comma-separated role presets (default: all of rlbatch/conf/roles/)")
    a = ap.parse_args(argv)
    presets = a.presets.split(",") if a.presets else sorted(p.stem for p in (REPO_ROOT / "rlbatch/conf/roles").glob("*.yaml"))
    print(f"| preset ({a.hardware}) | GPUs | " + " | ".join(f"Qwen2.5-{m}" for m in QWEN2_5) + " |")
    print("|---|---|" + "---|" * len(QWEN2_5))
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for name, shape in QWEN2_5.items():
            dirs[name] = Path(tmp) / f"qwen2.5-{name.lower()}"
            dirs[name].mkdir()
            (dirs[name] / "config.json").write_text(json.dumps(COMMON | shape))
        for preset in presets:
            results = [plan(preset, dirs[name], a.hardware) for name in QWEN2_5]
            gpus = next((sum(g["count"] for g in r["gpus"]) for r in results if "gpus" in r), "?")
            print(f"| {preset} | {gpus} | " + " | ".join(cell(r) for r in results) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
