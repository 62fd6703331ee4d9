"""What the training engines share: micro-batching, the loss of a chunk, the update schedule
(mini-batches x epochs x gradient accumulation), the warm-up LR schedule.

Each engine supplies its model call, its backward and its optimizer step; the numbers these
helpers produce (which samples form a micro-batch, what the loss is divided by, the LR of each
update) are therefore the same for every engine, which is what lets one engine's checkpoint
resume in another.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rlbatch import algos
from rlbatch.algos.objective import LossInput
from rlbatch.engines.base import Sample
from rlbatch.engines.batch import Full, Packed, response_logits, unpack


def require_data_parallel(mesh: Any, engine: str) -> None:
    """Refuse a mesh with tensor, context or pipeline parallelism for an engine that runs d only."""
    dims = dict(zip(mesh.mesh_dim_names, mesh.mesh.shape, strict=True))
    if any(dims.get(k, 1) > 1 for k in ("tp", "cp", "pp")):
        raise NotImplementedError(f"{engine} engine: only data parallelism (d) is implemented, got mesh {dims}")


def chunks(samples: list[Sample], size: int) -> list[list[Sample]]:
    """Consecutive chunks of ``size`` samples (0: all in one)."""
    size = size or len(samples)
    return [samples[i : i + size] for i in range(0, len(samples), size)]


@torch.no_grad()
def logprobs(model: Any, samples: list[Sample], micro_batch: int, pack: Callable[[list[Sample]], Packed]) -> list[torch.Tensor]:
    """Per-sample response-token log-probs under ``model``, ``micro_batch`` sequences per forward."""
    out: list[torch.Tensor] = []
    for chunk in chunks(samples, micro_batch):
        b = pack(chunk)
        out += unpack(algos.token_logprobs(response_logits(model, b).float(), b.targets), b.lengths)
    return out


def value_outputs(model: Any, b: Packed) -> torch.Tensor:
    """[B, R] a value model's output at the positions that score each response token."""
    return response_logits(model, b)[..., 0].float()


@torch.no_grad()
def values(model: Any, samples: list[Sample], micro_batch: int, pack: Callable[[list[Sample]], Packed]) -> list[torch.Tensor]:
    """Per-sample response-token values under a value model (``rlbatch.engines.model.value_model``)."""
    out: list[torch.Tensor] = []
    for chunk in chunks(samples, micro_batch):
        b = pack(chunk)
        out += unpack(value_outputs(model, b), b.lengths)
    return out


@torch.no_grad()
def scores(model: Any, samples: list[Sample], micro_batch: int, pack: Callable[[list[Sample]], Packed]) -> list[float]:
    """One score per sample (prompt + response) from a sequence-classification model: its output at
    the sequence's last non-pad token (transformers' pooling over the right-padded batch)."""
    out: list[float] = []
    for chunk in chunks(samples, micro_batch):
        x = pack(chunk).inputs
        assert isinstance(x, Full), "a sequence-classification model scores whole sequences (no shared prompts)"
        out += model(input_ids=x.input_ids, attention_mask=x.attention_mask).logits[:, 0].float().tolist()
    return out


def chunk_loss(model: Any, b: Packed, objective: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """The objective on one packed micro-batch: log-probs of the LM head (``PolicyObjective``), or
    the value head's output (``ValueObjective``, ``head == "value"``)."""
    if objective.head == "value":
        from rlbatch.algos.value import ValueInput

        return objective(ValueInput(value_outputs(model, b), b.mask, b.fields))
    logits = response_logits(model, b).float()
    logp = algos.token_logprobs(logits, b.targets)
    return objective(LossInput(logp, b.mask, b.token_advantages(), b.fields, logits if objective.needs_logits else None))


def updates(samples: list[Sample], algo: Any, objective: Any = None) -> Iterator[list[list[Sample]]]:
    """One list of micro-batches per optimizer update: mini-batches x epochs, each mini-batch cut
    into at most ``algo.grad_accum`` micro-batches. The loss of each micro-batch is to be divided
    by ``algo.grad_accum``.

    For a policy objective, samples without old log-probs are trained on-policy (old = current,
    detached): right only before the first update, so only the first mini-batch of the first
    epoch may leave them out. A value objective (``head == "value"``) reads no log-probs."""
    per_mb = len(samples) // algo.mini_batches
    policy = getattr(objective, "head", "lm") == "lm"
    for epoch in range(algo.epochs):
        for m in range(algo.mini_batches):
            mb = samples[m * per_mb : (m + 1) * per_mb]
            missing = sum("old_logprobs" not in s for s in mb) if policy else 0
            if missing and (epoch, m) != (0, 0):
                raise ValueError(f"train: {missing} samples of mini-batch {m} (epoch {epoch}) have no old "
                                 f"log-probs; only the first mini-batch of the first epoch may leave them out")
            micro = math.ceil(len(mb) / algo.grad_accum)
            yield [mb[k : k + micro] for k in range(0, len(mb), micro)]


class Totals:
    """Stats summed over micro-batches (each weighted 1/grad_accum) and averaged over updates."""

    def __init__(self, grad_accum: int) -> None:
        self.grad_accum = grad_accum
        self.sums: dict[str, float] = {}
        self.updates = 0

    def add(self, stats: dict[str, float], weight: float | None = None) -> None:
        w = 1.0 / self.grad_accum if weight is None else weight
        for key, v in stats.items():
            self.sums[key] = self.sums.get(key, 0.0) + v * w

    def result(self, lr: float) -> dict[str, float]:
        out = {k: v / max(self.updates, 1) for k, v in self.sums.items()}
        out["lr"] = lr
        return out


def warmup(steps: int) -> Callable[[int], float]:
    """The LR multiplier of update ``s``: linear warm-up over ``steps`` updates, then 1."""
    return lambda s: min(1.0, (s + 1) / steps) if steps else 1.0
