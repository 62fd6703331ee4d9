"""A step's training batch as the trainer read it, kept for ``python -m rlbatch.inspect``.

With ``watch.batch_every = N`` the controller reads step 0's samples, and every N-th step's,
off actor_train's ranks right after the step trained (each shard's first rank holds what its
shard trained on) and writes them with what the controller knows of them to
``<run_dir>/batches/step_<step>.pt``:

    {"step": 3, "policy_version": 3, "algo": "grpo", "samples": [     # the version that generated them
        {"id": 96, "reward": 1.0, "answer": "7", "source": "", "end": "done", "detail": "",
         "prompt": LongTensor, "response": LongTensor, "behaviour_logprobs": FloatTensor,
         "loss_mask": FloatTensor,            # a trajectory's (env tokens 0) or DAPO's overlong filter
         "advantage": FloatTensor[]  or "advantages": FloatTensor[len(response)],
         "old_logprobs"/"ref_logprobs"/"returns": ...   # where the step computed them
        }, ...]}

Tokens, not text: ``rlbatch.inspect`` decodes them with the run's tokenizer. A resumed run writes
the file of a step it trains again anew.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlbatch.loop.controller import Ledger, Role, Rollouts

if TYPE_CHECKING:
    from rlbatch.config.schema import WatchConfig

BATCHES = "batches"
FIELDS = ("prompt", "response", "behaviour_logprobs", "loss_mask", "advantage", "advantages", "returns",
          "old_logprobs", "ref_logprobs", "values")
"""The sample fields read off the trainer's ranks, those a rank holds (the others are absent)."""


def batch_path(run_dir: Path, step: int) -> Path:
    return run_dir / BATCHES / f"step_{step}.pt"


def due(step: int, every: int) -> bool:
    """Whether ``watch.batch_every`` keeps step ``step``'s batch: step 0 and every N-th after it."""
    return every > 0 and step % every == 0


def read_trained(trainer: Role, rollouts: Rollouts) -> dict[int, dict[str, torch.Tensor]]:
    """The fields ``FIELDS`` of the rollouts' samples that ``trainer``'s ranks trained on, read from
    each shard's first rank (``rollout_buffer``'s read: no engine state needed). Its seconds stay out
    of the step's metrics."""
    pipe = trainer.pipe
    shards = trainer._assign(rollouts)  # the shards' samples, as the step's training phases saw them
    work = {sh[0]: {"op": "read", "ids": ids, "fields": list(FIELDS)} for sh, ids in shards.items() if ids}
    before, pipe.apart = pipe.apart, Ledger()
    try:
        out = pipe.run("rollout_buffer", (trainer.name,), work)
    finally:
        pipe.apart = before
    return {sid: fields for part in out.values() for sid, fields in part.items()}


def keep_batch(run_dir: Path, step: int, trainer: Role, rollouts: Rollouts, rewards: torch.Tensor, algo: str) -> Path:
    """Write step ``step``'s batch (see the module's docstring); returns its path."""
    held = read_trained(trainer, rollouts)
    samples: list[dict[str, Any]] = []
    for k, sid in enumerate(rollouts.ids):
        episode = rollouts.episodes.get(sid)
        sample: dict[str, Any] = {"id": sid, "reward": float(rewards[k]), "answer": rollouts.answers[k],
                                  "source": rollouts.sources[k] if rollouts.sources else ""}
        if episode:
            sample |= {"end": str(episode["end"]), "detail": str(episode.get("detail") or ""),
                       "turns": int(episode["turns"])}
        samples.append(sample | held.get(sid, {}))
    path = batch_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"step": step, "policy_version": rollouts.version, "algo": algo, "samples": samples}, tmp)
    os.replace(tmp, path)
    return path


class BatchLog:
    """Keeps the batches ``watch.batch_every`` asks for."""

    def __init__(self, run_dir: Path, watch: WatchConfig, algo: str) -> None:
        self.run_dir, self.every, self.algo = run_dir, int(watch.batch_every), algo

    def after_training(self, step: int, trainer: Role, rollouts: Rollouts, rewards: torch.Tensor) -> None:
        if due(step, self.every):
            keep_batch(self.run_dir, step, trainer, rollouts, rewards, self.algo)
