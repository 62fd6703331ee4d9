"""What the training engines share: micro-batching, the loss of a chunk, the update schedule
(mini-batches x epochs x gradient accumulation), the warm-up LR schedule.

Each engine supplies its model call, its backward and its optimizer step; the numbers these
helpers produce (which samples form a micro-batch, what the loss is divided by, the LR of each
update) are therefore the same for every engine, which is what lets one engine's checkpoint
resume in another.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlbatch.algos.objective import LossInput
from rlbatch.algos.split import aggregation_count
from rlbatch.algos.value import ValueInput, ValueObjective
from rlbatch.engines.base import Sample, require_mesh
from rlbatch.engines.batch import (
    Flat,
    Full,
    Packed,
    flat_outputs,
    flat_sequences,
    response_logits,
    response_logprobs,
    spread,
    unpack,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from rlbatch.config.schema import AlgoConfig
    from rlbatch.engines.base import Objective


def require_data_parallel(mesh: DeviceMesh | None, engine: str) -> None:
    """Refuse a mesh with tensor, context or pipeline parallelism for an engine that runs d only."""
    mesh = require_mesh(mesh, f"{engine} engine")
    dims = dict(zip(mesh.mesh_dim_names or (), mesh.mesh.shape, strict=True))
    if any(dims.get(k, 1) > 1 for k in ("tp", "cp", "pp")):
        raise NotImplementedError(f"{engine} engine: only data parallelism (d) is implemented, got mesh {dims}")


@dataclass(frozen=True)
class Split:
    """How a forward-only pass (log-probs, values, scores) cuts a rank's samples into forwards."""

    samples: int = 0
    """Samples per forward (0: all in one), when ``max_tokens`` is 0."""
    max_tokens: int = 0
    """> 0: consecutive runs of at most this many prompt + response tokens (a longer sample alone)."""
    group: ProcessGroup | None = None
    """The data-parallel group whose ranks must make as many forwards (FSDP and ZeRO-3 gather
    parameters in each); None: this rank alone."""
    device: torch.device | None = None
    """Where the group's all-reduce tensor lives."""


def chunks(samples: list[Sample], size: int | Split) -> list[list[Sample]]:
    """Consecutive chunks of ``size`` samples (0: all in one), or as a ``Split`` says. A token
    budget makes every rank of the split's group run the same number of chunks: the most any rank
    needs, by cutting runs further, and where a rank has too few samples for that, by repeating its
    last sample as extra chunks at the end, whose outputs the caller drops (``[: len(samples)]``)."""
    if isinstance(size, Split):
        if size.max_tokens > 0:
            return _token_chunks(samples, size)
        size = size.samples
    size = size or len(samples)
    return [samples[i : i + size] for i in range(0, len(samples), size)]


def _token_chunks(samples: list[Sample], split: Split) -> list[list[Sample]]:
    tokens = [sample_tokens(s) for s in samples]
    runs: list[list[int]] = []
    used = split.max_tokens
    for i, t in enumerate(tokens):  # next fit: runs stay consecutive, so outputs come back in order
        if used + t > split.max_tokens:
            runs.append([])
            used = 0
        runs[-1].append(i)
        used += t
    need = int(_dp_reduce(float(len(runs)), split.group, split.device, "MAX"))
    while len(runs) < need and any(len(r) > 1 for r in runs):
        k = max((k for k in range(len(runs)) if len(runs[k]) > 1), key=lambda k: sum(tokens[i] for i in runs[k]))
        run = runs[k]
        cut = min(range(1, len(run)), key=lambda c: max(sum(tokens[i] for i in run[:c]), sum(tokens[i] for i in run[c:])))
        runs[k : k + 1] = [run[:cut], run[cut:]]
    out = [[samples[i] for i in r] for r in runs]
    return out + [samples[-1:]] * (need - len(out) if samples else 0)


@torch.no_grad()
def logprobs(model: torch.nn.Module, samples: list[Sample], micro_batch: int | Split, pack: Callable[[list[Sample]], Packed]) -> list[torch.Tensor]:
    """Per-sample response-token log-probs under ``model``, ``micro_batch`` sequences per forward
    (or as a ``Split`` says: ``chunks``), in the order of ``samples``."""
    out: list[torch.Tensor] = []
    for chunk in chunks(samples, micro_batch):
        b = pack(chunk)
        out += unpack(response_logprobs(model, b)[0], b.lengths)
    return out[: len(samples)]


def value_outputs(model: torch.nn.Module, b: Packed) -> torch.Tensor:
    """[B, R] a value model's output at the positions that score each response token."""
    if isinstance(b.inputs, Flat):
        return spread(flat_outputs(model, b.inputs, lm=False)[:, 0], b.inputs, b.targets.shape[0])
    return response_logits(model, b)[..., 0].float()


@torch.no_grad()
def values(model: torch.nn.Module, samples: list[Sample], micro_batch: int | Split, pack: Callable[[list[Sample]], Packed]) -> list[torch.Tensor]:
    """Per-sample response-token values under a value model (``rlbatch.engines.model.value_model``)."""
    out: list[torch.Tensor] = []
    for chunk in chunks(samples, micro_batch):
        b = pack(chunk)
        out += unpack(value_outputs(model, b), b.lengths)
    return out[: len(samples)]


@torch.no_grad()
def scores(model: torch.nn.Module, samples: list[Sample], micro_batch: int | Split, pack: Callable[[list[Sample]], Packed],
           head: torch.nn.Module | None = None, slice_row: Callable[[Flat], Flat] | None = None) -> list[float]:
    """One score per sample (prompt + response) from a sequence-classification model: its output at
    the sequence's last token. Padded (no token budget): transformers' pooling at each right-padded
    row's last non-pad token. Under a ``Split``'s token budget: each chunk's whole sequences in one
    row (``flat_sequences``), the model's ``head`` (its ``score`` layer) read where transformers'
    pooling reads each padded row (which would read one position of a packed row); ``slice_row``:
    this rank's slice of that row under context parallelism (``rlbatch.engines.ulysses.split``)."""
    out: list[float] = []
    flat = micro_batch if isinstance(micro_batch, Split) and micro_batch.max_tokens > 0 else None
    for chunk in chunks(samples, micro_batch):
        if flat is not None:
            assert head is not None, "scoring flat rows reads the model's score layer: pass it as head"
            row = flat_sequences(chunk, model_pad_id(model), flat.device)
            out += flat_scores(model, row if slice_row is None else slice_row(row), head, len(chunk))
            continue
        x = pack(chunk).inputs
        assert isinstance(x, Full), "a sequence-classification model scores whole padded sequences (not shared, not flat)"
        out += model(input_ids=x.input_ids, attention_mask=x.attention_mask).logits[:, 0].float().tolist()
    return out[: len(samples)]


def model_pad_id(model: torch.nn.Module) -> int:
    """The pad token id a sequence-classification model pools by (``config.pad_token_id``; -1,
    matching no token, when it has none), through a DeepSpeed engine's module too."""
    config = getattr(getattr(model, "module", model), "config", None)
    pad = getattr(config, "pad_token_id", None)
    return -1 if pad is None else int(pad)


def flat_scores(model: torch.nn.Module, x: Flat, head: torch.nn.Module, batch: int) -> list[float]:
    """A sequence-classification model's score of each of the ``batch`` sequences of one flat row,
    read at its kept position: one call through the model's own forward (as ``flat_outputs``:
    FSDP's and DeepSpeed's hooks gather the parameters there; no attention mask, so attention stays
    within each sample), its head's per-position output caught on the way (transformers then pools
    one position of the row, unused). A context-parallel slice scores the sequences that end in it,
    and ``spread`` sums them over the group."""
    seen: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda _module, _args, output: seen.append(output))
    try:
        with x.cp.over() if x.cp is not None else contextlib.nullcontext():
            model(**x.forward_kwargs())
    finally:
        handle.remove()
    return spread(seen[-1][0, x.keep, 0], x, batch)[:, 0].tolist()


def chunk_loss(model: torch.nn.Module, b: Packed, objective: Objective) -> tuple[torch.Tensor, dict[str, float]]:
    """The objective on one packed micro-batch: log-probs of the LM head (``PolicyObjective``), or
    the value head's output (``ValueObjective``, ``head == "value"``)."""
    if isinstance(objective, ValueObjective):
        return objective(ValueInput(value_outputs(model, b), b.mask, b.fields))
    logp, entropy, logits = response_logprobs(model, b, entropy=objective.needs_logits)
    return objective(LossInput(logp, b.mask, b.token_advantages(), b.fields,
                               logits if objective.needs_logits else None, entropy))


def mini_batches(samples: list[Sample], algo: AlgoConfig, objective: Objective | None = None) -> Iterator[list[Sample]]:
    """The samples of each optimizer update: ``algo.mini_batches`` consecutive slices, every epoch.

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
            yield mb


def updates(samples: list[Sample], algo: AlgoConfig,
            objective: Objective | None = None) -> Iterator[list[list[Sample]]]:
    """One list of micro-batches per optimizer update (``mini_batches``), each mini-batch cut into at
    most ``algo.grad_accum`` micro-batches by sample count. The loss of each micro-batch is to be
    divided by ``algo.grad_accum``."""
    for mb in mini_batches(samples, algo, objective):
        micro = math.ceil(len(mb) / algo.grad_accum)
        yield [mb[k : k + micro] for k in range(0, len(mb), micro)]


def sample_tokens(s: Sample) -> int:
    """Prompt + response tokens of one sample: what a token budget counts."""
    return len(s["prompt"]) + len(s["response"])


def token_bins(tokens: list[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: indices into ``tokens`` grouped so each group's sum stays within
    ``budget`` (an item over it is a group of its own). Groups list their indices in ascending order
    and come ordered by their first index."""
    bins: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(tokens)), key=lambda i: -tokens[i]):  # stable: ties keep their order
        for b in range(len(bins)):
            if used[b] + tokens[i] <= budget:
                bins[b].append(i)
                used[b] += tokens[i]
                break
        else:
            bins.append([i])
            used.append(tokens[i])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def _halve(group: list[int], tokens: list[int]) -> tuple[list[int], list[int]]:
    """Two non-empty groups of ``group`` with near-equal tokens, each within what ``group`` held."""
    a: list[int] = []
    b: list[int] = []
    for i in sorted(group, key=lambda i: -tokens[i]):
        (a if sum(tokens[j] for j in a) <= sum(tokens[j] for j in b) else b).append(i)
    return sorted(a), sorted(b)


def exactly(groups: list[list[int]], tokens: list[int], k: int) -> list[list[int]]:
    """``groups`` split further, heaviest splittable first, until there are ``k`` (data-parallel
    ranks must run the same number of forwards and backwards); where no group of two or more is
    left, fewer than ``k`` come back."""
    groups = [list(g) for g in groups]
    while len(groups) < k:
        splittable = [g for g in groups if len(g) > 1]
        if not splittable:
            break
        g = max(splittable, key=lambda g: sum(tokens[i] for i in g))
        groups.remove(g)
        groups += _halve(g, tokens)
    return sorted(groups, key=lambda g: g[0])


@dataclass
class MicroBatch:
    """One forward and backward of an update: its loss is ``objective``'s on ``samples`` divided by
    ``divisor``, its stats weighted ``weight`` in ``Totals``."""

    samples: list[Sample]
    objective: Objective
    divisor: float
    weight: float


def _dp_size(group: ProcessGroup | None) -> int:
    return 1 if group is None or not torch.distributed.is_initialized() else torch.distributed.get_world_size(group)


def _dp_reduce(value: float, group: ProcessGroup | None, device: torch.device | None, op: str) -> float:
    """``value`` summed (or maxed: ``op``) over the ranks of ``group`` (itself when there is none)."""
    if _dp_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=getattr(torch.distributed.ReduceOp, op), group=group)
    return float(t.item())


def weighted_updates(samples: list[Sample], algo: AlgoConfig, objective: Objective, max_tokens: int = 0,
                     group: ProcessGroup | None = None, device: torch.device | None = None,
                     old_logprobs: Callable[[list[Sample]], list[torch.Tensor]] | None = None,
                     ) -> Iterator[list[MicroBatch]]:
    """The micro-batches of each update, with what each micro-batch's loss is divided by.

    ``max_tokens`` 0: ``updates`` (``algo.grad_accum`` micro-batches by sample count, each loss
    divided by grad_accum: the mean of per-micro-batch aggregations).

    ``max_tokens`` > 0: micro-batches of at most that many prompt + response tokens
    (``token_bins``; ``algo.grad_accum`` is not used), and the loss exact under any split: each
    micro-batch's loss is its aggregation's total (``Aggregation.total``) over the whole global
    mini-batch's count (``Aggregation.count``, summed over this rank's samples and all-reduced over
    ``group``, the data-parallel ranks), times the number of those ranks, because FSDP and DeepSpeed
    average gradients over them. The update's gradient is then that of the global mini-batch's
    aggregated loss in one unsplit, unpadded pass, to float32 rounding. Every rank runs the same
    number of micro-batches (the most any rank needs; a rank with too few samples to split repeats
    one with a zero loss), since each forward and backward is collective under FSDP and ZeRO-3.
    Stats are weighted by each micro-batch's share of the rank's response tokens.

    The count must be known before the forward. An objective whose token mask depends on the old
    log-probs (``objective.needs_old_logprobs``: an off-policy correction keeping tokens by them)
    gets them from ``old_logprobs`` (a forward-only pass under the current weights, what the first
    mini-batch's on-policy "old = current" means) for the samples that lack them; without it, the
    objective refuses."""
    if not max_tokens:
        for micro in updates(samples, algo, objective):
            yield [MicroBatch(c, objective, algo.grad_accum, 1.0 / algo.grad_accum) for c in micro]
        return
    ranks = _dp_size(group)
    for mb in mini_batches(samples, algo, objective):
        needs = getattr(objective, "needs_old_logprobs", None)
        if old_logprobs is not None and needs is not None and _dp_reduce(float(needs(mb)), group, device, "MAX"):
            mb = with_old_logprobs(mb, old_logprobs)  # every rank: the pass is collective
        count = _dp_reduce(aggregation_count(objective, mb), group, device, "SUM")
        split = objective.split(max(count, 1.0) / ranks)
        tokens = [sample_tokens(s) for s in mb]
        groups = token_bins(tokens, max_tokens)
        need = int(_dp_reduce(float(len(groups)), group, device, "MAX"))
        groups = exactly(groups, tokens, need)
        responses = max(sum(len(s["response"]) for s in mb), 1)
        out = [MicroBatch([mb[i] for i in g], split, 1.0, sum(len(mb[i]["response"]) for i in g) / responses)
               for g in groups]
        out += [MicroBatch(mb[:1], split, math.inf, 0.0) for _ in range(need - len(out))]
        yield out


def with_old_logprobs(samples: list[Sample], old_logprobs: Callable[[list[Sample]], list[torch.Tensor]]) -> list[Sample]:
    """``samples`` with ``old_logprobs`` from one forward-only pass where they lack them (new dicts:
    the caller's samples are left as they were)."""
    lps = old_logprobs(samples)
    return [s if "old_logprobs" in s else s | {"old_logprobs": lp.to(s["response"].device)}
            for s, lp in zip(samples, lps, strict=True)]


class Totals:
    """Stats summed over micro-batches (each weighted 1/grad_accum, or as ``MicroBatch.weight``
    says) and averaged over updates."""

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
