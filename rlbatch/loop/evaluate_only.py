"""``program=eval``: evaluate a checkpoint, or ``model.path``, on the held-out set; no training.

    python -m rlbatch.launch program=eval eval.checkpoint=runs/a run_dir=runs/a-eval      # a run's newest checkpoint
    python -m rlbatch.launch program=eval eval.checkpoint=runs/a eval.all_checkpoints=true run_dir=runs/a-eval
    python -m rlbatch.launch program=eval model.path=/models/qwen2.5-0.5b-instruct experiment=gsm8k ...

The world is a training run's (the same placement, engines and scoring roles): the inference role
generates for every held-out prompt and the scoring roles score the responses, exactly as the
training loop's evaluation does (``rlbatch.loop.evaluation.Evaluation.run``), so a checkpoint
evaluated here gets the numbers the training run logged for its step (greedy, or sampled with the
run's seed). A checkpoint is loaded as a resume loads it, into the trainable roles' ranks
(actor_train's DCP shards, any data-parallel size), and its weights synced to the inference role;
nothing is trained and no checkpoint is written. Without ``eval.checkpoint`` the inference role
evaluates the weights it was built with (``model.path``).

Each evaluation is one line of ``<run_dir>/eval.jsonl`` (the checkpoint, its step and policy
version, ``eval/...`` as in a training row) and one summary line on the console. The run directory
is the evaluation's own: the launcher refuses one that holds a training run (docs/eval.md).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from rlbatch.checkpoint.files import read_controller
from rlbatch.checkpoint.store import Checkpoint, CheckpointStore, open_checkpoint
from rlbatch.config.schema import TRAINABLE_ROLES, RLBatchConfig
from rlbatch.loop.controller import Pipeline, Role
from rlbatch.loop.evaluation import ALL, Evaluation
from rlbatch.loop.rank_runtime import RankRuntime
from rlbatch.runtime.rundir import RunDir
from rlbatch.runtime.world import World

EVAL_FILE = "eval.jsonl"
"""Where ``program=eval`` writes its rows, in its own run directory (appended: a rerun adds rows)."""


def handlers(world: World, cfg: RLBatchConfig, run: RunDir) -> dict[str, Callable[..., object]]:
    return RankRuntime(world, cfg).handlers()


def checkpoints_to_evaluate(where: str, every: bool) -> list[Checkpoint]:
    """The checkpoints ``eval.checkpoint`` names: a checkpoint directory (that one), or a run or
    ``checkpoints/`` directory (its newest complete checkpoint; with ``every``
    (``eval.all_checkpoints``), each complete one, oldest first). Verified against their manifests."""
    path = Path(where).expanduser()
    newest = open_checkpoint(path)  # raises CheckpointError naming the file and the problem
    if not every or newest.path.resolve() == path.resolve():  # a checkpoint directory itself
        return [newest]
    store = CheckpointStore(newest.path.parent)
    return [open_checkpoint(p) for _, p in reversed(store.complete())]


def policy_version(ckpt: Checkpoint) -> int:
    """The updates the checkpoint's policy has had (``controller.json``'s ``policy_version``; a
    checkpoint written before it was recorded: one per step)."""
    state = read_controller(ckpt.path)
    return int(state.get("policy_version", ckpt.step + 1))


Row = dict[str, float | int | str]
"""A line of eval.jsonl."""


def summary(label: str, row: Mapping[str, float | int | str]) -> str:
    """One console line: the overall pass@1 and mean reward, then each data source's pass@1."""
    sources = sorted({k.split("/")[1] for k in row if k.startswith("eval/") and k.endswith("/pass@1")} - {ALL})
    by_source = "".join(f"; {s} pass@1 {float(row[f'eval/{s}/pass@1']):.3f}" for s in sources)
    return (f"eval: {label}: pass@1 {float(row[f'eval/{ALL}/pass@1']):.3f}, mean reward "
            f"{float(row[f'eval/{ALL}/mean_reward']):.3f} over {int(float(row[f'eval/{ALL}/prompts']))} prompts"
            f"{by_source} ({float(row['eval/seconds']):.1f}s)")


def controller(world: World, cfg: RLBatchConfig, run: RunDir) -> dict[str, str]:
    pipe = Pipeline(world, cfg)
    print(f"engines ready on every rank in {pipe.wait_ready():.1f}s", flush=True)
    e = cfg.eval
    ckpts: list[Checkpoint | None] = ([*checkpoints_to_evaluate(str(e.checkpoint), bool(e.all_checkpoints))]
                                      if e.checkpoint else [None])
    evaluation = Evaluation(pipe, cfg, 0, standalone=True)
    train, infer = Role(pipe, "actor_train"), Role(pipe, "actor_infer")
    trainable = tuple(r for r in TRAINABLE_ROLES if r in pipe.p.roles)
    out = run.path / EVAL_FILE
    for ckpt in ckpts:
        pipe.begin_step()
        meta: Row = {}
        if ckpt is None:
            label = f"model.path={cfg.model.path}" if cfg.model.path else "the seeded initial weights"
            updates = 0
        else:
            start = time.perf_counter()
            pipe.run("checkpoint", trainable, {r: {"op": "load", "path": str(ckpt.path)} for r in pipe.workers()})
            train.sync_weights(infer)
            updates = policy_version(ckpt)
            label = f"{ckpt.path} (step {ckpt.step}, {updates} updates)"
            meta = {"checkpoint": str(ckpt.path), "step": ckpt.step}
            print(f"loaded {ckpt.path} into {', '.join(trainable)} and synced it to actor_infer in "
                  f"{time.perf_counter() - start:.1f}s", flush=True)
        row: Row = {**meta, "model": str(cfg.model.path or ""), "time": time.time(), **evaluation.run(updates)}
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(summary(label, row), flush=True)
    pipe.ctl.shutdown(pipe.workers())
    print(f"done: {len(ckpts)} evaluation{'s' if len(ckpts) > 1 else ''}; rows in {out}", flush=True)
    return {}
