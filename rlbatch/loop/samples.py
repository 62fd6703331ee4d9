"""Sample completions a user reads while a run trains, and the environment failures they see.

Every ``watch.samples_every`` steps (step 0, every N-th step after it and the last step) the
controller shows ``watch.samples_per_step`` of the step's samples: their prompt and response as
text, reward and advantage, and for a trajectory its turns, end reason and the env's words
(``detail``). The text is decoded where the tokens already are, on the reward worker that scores
them, and only on those steps (``Scoring.show``; ``decode_shown`` on the rank): the controller
never holds every response. Each shown sample is one line of ``<run_dir>/samples.jsonl``:

    {"step": 10, "id": 320, "prompt": "...", "response": "...", "answer": "7", "reward": 1.0,
     "advantage": 0.93, "response_tokens": 4,
     "turns": [{"by": "policy", "text": "3"}, {"by": "env", "text": "+5="}, ...],   # with an env
     "end": "error", "detail": "step raised ValueError: ..."}                         # with an env

and the same rows go to TensorBoard (a text table under ``samples``) and to the trackers that show
tables (W&B: a ``samples`` table; MLflow: ``samples/step_<N>.jsonl`` artifacts). A resumed run
keeps the lines of the steps before its checkpoint and writes the later ones again, once.

``EnvFailures`` puts an environment's failure (it raised, answered outside the contract, timed
out) in the controller's log: one line the first time each failure is seen, with its words,
then only counted, and one summary line at the end of the run.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import torch

if TYPE_CHECKING:
    from rlbatch.config.schema import WatchConfig
    from rlbatch.envs.trajectories import TrajectorySummary
    from rlbatch.loop.controller import Rollouts
    from rlbatch.loop.metrics import Metrics

log = logging.getLogger(__name__)
SAMPLES = "samples.jsonl"
TEXT_MAX = 4000
"""The most characters of a prompt or response a sample row keeps (the rest is cut, marked)."""
FAILED_ENDS = ("error", "invalid", "timeout")
"""End reasons of a trajectory whose env failed (as ``rlbatch.envs.trajectories.FAILED_ENDS``)."""


class Turn(TypedDict):
    """A piece of a trajectory's response: a generated turn (``by`` 'policy') or the env's
    observation between two turns (``by`` 'env')."""

    by: str
    text: str


class Shown(TypedDict):
    """One sample as text, decoded on the rank that scores it."""

    prompt: str
    response: str
    turns: list[Turn]
    """A trajectory's response in turns; empty for a single-turn sample."""


def due(step: int, every: int, steps: int) -> bool:
    """Whether ``step`` is one that ``every`` shows: step 0, every N-th step after it and the last."""
    return every > 0 and (step % every == 0 or step == steps - 1)


def cut(text: str, most: int = TEXT_MAX) -> str:
    return text if len(text) <= most else text[:most] + f"... [{len(text) - most} more characters]"


def decode_shown(decode: Callable[[list[int]], str], prompt: Sequence[int] | None, response: Sequence[int],
                 spans: Sequence[Sequence[int]] | None = None, text: str | None = None) -> Shown:
    """A sample as text: its prompt (empty when this rank does not hold it), its response (``text``
    when already decoded) and, given a trajectory's ``spans`` (the (start, length) runs of generated
    tokens: ``TrajectorySummary.spans``), the response cut into the policy's turns and the env's
    observations between them."""
    response = list(response)
    turns: list[Turn] = []
    if spans is not None:
        pos = 0
        for start, length in spans:
            if start > pos:
                turns.append({"by": "env", "text": cut(decode(response[pos:start]))})
            turns.append({"by": "policy", "text": cut(decode(response[start:start + length]))})
            pos = start + length
        if pos < len(response):
            turns.append({"by": "env", "text": cut(decode(response[pos:]))})
    return {"prompt": cut(decode(list(prompt))) if prompt is not None else "",
            "response": cut(text if text is not None else decode(response)), "turns": turns}


def advantage_of(advantages: torch.Tensor | Sequence[torch.Tensor], k: int,
                 spans: Sequence[Sequence[int]] | None = None) -> float:
    """Sample ``k``'s advantage: its value (one per sample), or the mean of its per-token values
    over its actions (a trajectory's generated tokens, ``spans``; every token otherwise)."""
    if isinstance(advantages, torch.Tensor):
        return float(advantages[k])
    per_token = advantages[k].reshape(-1).float()
    if spans is not None:
        mask = torch.zeros(per_token.numel(), dtype=torch.bool)
        for start, length in spans:
            mask[start:start + length] = True
        per_token = per_token[mask]
    return float(per_token.mean()) if per_token.numel() else 0.0


def sample_rows(step: int, rollouts: Rollouts, rewards: torch.Tensor, advantages: torch.Tensor | Sequence[torch.Tensor],
                shown: Mapping[int, Shown]) -> list[dict[str, Any]]:
    """The rows of samples.jsonl for the samples of ``rollouts`` decoded in ``shown``, in id order
    (``rewards`` and ``advantages`` in the rollouts' order)."""
    rows = []
    for k, sid in enumerate(rollouts.ids):
        if sid not in shown:
            continue
        text, episode = shown[sid], rollouts.episodes.get(sid)
        spans = episode["spans"] if episode else None
        row: dict[str, Any] = {"step": step, "id": sid, "prompt": text["prompt"], "response": text["response"],
                               "answer": rollouts.answers[k], "reward": float(rewards[k]),
                               "advantage": advantage_of(advantages, k, spans),
                               "response_tokens": int(rollouts.response_len.get(sid, 0))}
        if rollouts.sources:
            row["source"] = rollouts.sources[k]
        if episode:
            row |= {"turns": text["turns"], "end": str(episode["end"]), "detail": str(episode.get("detail") or ""),
                    "env_turns": int(episode["turns"])}
        rows.append(row)
    return rows


def markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """Sample rows as a Markdown table (what TensorBoard's text tab renders)."""
    def cell(v: object) -> str:
        text = f"{v:.3f}" if isinstance(v, float) else str(v)
        return text.replace("|", "\\|").replace("\n", "<br>")

    cols = ["id", "prompt", "response", "reward", "advantage", *(["end", "detail"] if any("end" in r for r in rows) else [])]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of ``path``; a line that does not parse (the last one, cut by a crash while
    it was written) is left out with a warning."""
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            log.warning("%s: line %d is not JSON (cut by a crash?); left out", path, n)
    return rows


def keep_before(path: Path, start: int) -> list[dict[str, Any]]:
    """Resuming at step ``start``: keep the rows of ``path`` of the steps before it and drop the
    later ones (written after the checkpoint, they are written again), atomically (a crash now
    leaves the old file); returns the rows kept. A missing file keeps nothing."""
    if not path.exists():
        return []
    kept = [r for r in read_rows(path) if int(r["step"]) < start]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
    return kept


class EnvFailures:
    """The env failures of a run, for the controller's log: the first of each kind (end reason and
    words) logged once, with its step and sample; then counted; ``summary`` at the end."""

    DISTINCT = 10
    """The most distinct failures logged by their words; any further are only counted."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    def observe(self, step: int, episodes: Mapping[int, TrajectorySummary]) -> None:
        for sid in sorted(episodes):
            e = episodes[sid]
            end = str(e["end"])
            if end not in FAILED_ENDS:
                continue
            key = (end, str(e.get("detail") or "no detail"))
            if key not in self.counts:
                if len(self.counts) < self.DISTINCT:
                    log.warning("env: a trajectory ended '%s' (step %d, sample %d): %s  [logged once; "
                                "repeats are counted: env/end/%s in metrics.jsonl, a summary at the end]",
                                end, step, sid, key[1], end)
                elif len(self.counts) == self.DISTINCT:
                    log.warning("env: more than %d distinct env failures; further ones are only counted",
                                self.DISTINCT)
            self.counts[key] += 1

    def summary(self) -> str | None:
        """One line: every failure and how often it happened (None: none happened)."""
        if not self.counts:
            return None
        by_end = Counter[str]()
        for (end, _), n in self.counts.items():
            by_end[end] += n
        top = ", ".join(f"{n}x {end}: {detail[:200]}" for (end, detail), n in self.counts.most_common(3))
        return (f"env failures over the run: {', '.join(f'{n} {end}' for end, n in sorted(by_end.items()))} "
                f"({len(self.counts)} distinct); most frequent: {top}")


class SampleLog:
    """The controller's sample completions and env failures (see the module's docstring)."""

    def __init__(self, run_dir: Path, watch: WatchConfig, steps: int, start: int, metrics: Metrics) -> None:
        self.path, self.watch, self.steps, self.metrics = run_dir / SAMPLES, watch, steps, metrics
        keep_before(self.path, start)
        self.failures = EnvFailures()

    def wanted(self, step: int) -> int:
        """How many of step ``step``'s samples to decode (0: none)."""
        return int(self.watch.samples_per_step) if due(step, int(self.watch.samples_every), self.steps) else 0

    def record(self, step: int, rollouts: Rollouts, rewards: torch.Tensor,
               advantages: torch.Tensor | Sequence[torch.Tensor] | None, shown: Mapping[int, Shown]) -> None:
        """The step's env failures into the log, and its shown samples (``shown``: what scoring
        decoded) into samples.jsonl, TensorBoard and the trackers."""
        self.failures.observe(step, rollouts.episodes)
        if not shown or advantages is None:
            return
        rows = sample_rows(step, rollouts, rewards, advantages, shown)
        if not rows:
            return
        with open(self.path, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        if self.metrics.tb is not None:
            self.metrics.tb.add_text("samples", markdown(rows), step)
        if self.metrics.trackers is not None:
            self.metrics.trackers.log_samples(step, rows)

    def close(self) -> None:
        if (line := self.failures.summary()) is not None:
            log.warning("%s", line)
