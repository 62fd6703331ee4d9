"""Placement search: enumerate placements for a GPU count, drop what does not fit, rank by step time.

ROLL's AutoDeviceMapping idea with the planner as the cost model. Candidates:

- colocated: every GPU role on all GPUs, taking turns (offload on or off);
- disaggregated: actor_train (with reference / critic) on the first GPUs, actor_infer on the
  rest, split at node boundaries (any split on one or two nodes);

and for each, the training engine's dims (tensor parallel within a node, pipeline stages that
divide the layers, data parallel for the rest) and the inference engine's (tensor parallel
within a node, engines for the rest), keeping the engines the config names. Where the training
engines run token-budget micro-batches (``engine_args.max_tokens_per_micro_batch``, set or the
device's default), each placement is predicted under a ladder of budgets (``budgets``) and keeps
the fastest that fits (``choose_budget``). Only the winners
are validated with ``rlbatch.checks.validate.check`` (candidates that fail are skipped and
counted), and each is printed as Hydra overrides ready to paste.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from rlbatch.config.hardware import Hardware
from rlbatch.config.parse import parse
from rlbatch.config.schema import RLBatchConfig, RoleConfig
from rlbatch.engines.registry import spec_of
from rlbatch.errors import ConfigError
from rlbatch.models.shape import ModelShape
from rlbatch.placement import parse_backend
from rlbatch.plan.coefficients import Coefficients
from rlbatch.plan.costs import cost_of
from rlbatch.plan.layout import Layout, RoleLayout
from rlbatch.plan.passes import token_budget
from rlbatch.plan.predict import Prediction, predict
from rlbatch.plan.workload import Workload

WITH_TRAIN = ("reference", "critic")
"""Roles the search places on actor_train's GPUs with actor_train's backend."""


@dataclass
class Candidate:
    label: str
    mode: str
    """'colocated' or 'disaggregated'."""
    layout: Layout
    prediction: Prediction | None = None
    overrides: list[str] = field(default_factory=list)
    budget: int = 0
    """The token budget chosen for the roles whose engines pack (``budgets``); 0: none searched."""
    lora: int = 0
    """``model.lora.rank`` the search proposes (``LORA_RANK``: nothing fits fully trained); 0: the config's."""


LORA_RANK = 16
"""The adapter rank the search proposes when no placement fits with every weight trained."""


def train_dims(engine: str, n: int, gpn: int, shape: ModelShape, w: Workload) -> list[str]:
    """Backend strings for a training engine on ``n`` GPUs whose batch splits evenly, over the
    sizes its cost model offers (``EngineCost.tensor_sizes``, ``pipeline_sizes``, ``expert_sizes``)."""
    cost, out = cost_of(engine), []
    for t in cost.tensor_sizes(gpn):
        if n % t or shape.heads % t or shape.kv_heads % t or cost.tensor_split_problem(t, shape):
            continue
        for p in cost.pipeline_sizes(t, gpn):
            if (n // t) % p or shape.layers % p:
                continue
            d = n // (t * p)
            if w.sequences % (d * w.mini_batches * w.grad_accum):
                continue
            for e in cost.expert_sizes(shape, t, d, gpn):
                dims = "".join(f"{k}{v}" for k, v in (("d", d), ("p", p), ("t", t), ("e", e)) if v > 1 or k == "d")
                out.append(f"{engine}:{dims}")
    return out


def infer_dims(engine: str, n: int, gpn: int, shape: ModelShape) -> list[str]:
    """Backend strings for an inference engine on ``n`` GPUs: TP within a node (the sizes its cost
    model offers and can split the model's heads over), PP as it offers (vLLM: across full nodes)."""
    cost, out = cost_of(engine), []
    for t in cost.tensor_sizes(gpn):
        if n % t or shape.heads % t or cost.tensor_split_problem(t, shape):
            continue
        for p in cost.pipeline_sizes(t, gpn):
            if n % (t * p) or shape.layers % p:
                continue
            dims = "".join(f"{k}{v}" for k, v in (("d", n // (t * p)), ("p", p), ("t", t)) if v > 1 or k == "d")
            out.append(f"{engine}:{dims}")
    return out


def splits(gpus: int, gpn: int) -> list[int]:
    """GPUs for actor_infer in disaggregated candidates: any split on <= 2 nodes, else whole nodes
    (every count up to 16 nodes, then a geometric ladder so 1000-GPU searches stay small)."""
    if gpus <= 2 * gpn:
        return list(range(1, gpus))
    nodes = gpus // gpn
    counts = sorted({k for k in range(1, min(nodes, 17))} | {int(round(nodes * f)) for f in (
        0.125, 0.1875, 0.25, 0.3125, 0.375, 0.4375, 0.5, 0.5625, 0.625, 0.6875, 0.75, 0.8125, 0.875)})
    return [k * gpn for k in counts if 0 < k < nodes]


def _role(name: str, spec: str, ranks: range, offload: bool, base: RoleConfig) -> RoleLayout:
    b = parse_backend(spec)
    return RoleLayout(name, b, ranks, offload, dict(base.engine_args), len(ranks) // b.num_gpus_per_worker)


def candidates(cfg: RLBatchConfig | Mapping[str, Any], gpus: int, gpn: int, shape: ModelShape, w: Workload,
               cpus: int = 1) -> Iterator[Candidate]:
    """Every placement the search considers for ``gpus`` GPUs (``cfg`` typed, or plain mappings the
    parse reads)."""
    typed = cfg if isinstance(cfg, RLBatchConfig) else parse(cfg).config
    roles = typed.roles
    train_engine = parse_backend(roles["actor_train"].backend).engine
    infer_engine = parse_backend(roles["actor_infer"].backend).engine
    extra = {n: rc for n, rc in roles.items() if rc.enabled and n not in ("actor_train", "actor_infer", *WITH_TRAIN)}
    # with model.lora the reference is the policy's base model, on actor_train's GPUs: no role of its own
    with_train = [n for n in WITH_TRAIN if typed.enabled(n) and not (n == "reference" and w.lora_rank)]
    cpu_roles = {n: RoleLayout(n, None, (), True, {}, rc.world_size or 1)
                 for n, rc in extra.items() if rc.device_mapping is None}

    def build(mode: str, tr: range, ir: range, ts: str, ispec: str, off: bool) -> Candidate:
        rl = {"actor_train": _role("actor_train", ts, tr, off, roles["actor_train"]),
              "actor_infer": _role("actor_infer", ispec, ir, off, roles["actor_infer"])}
        for n in with_train:
            rl[n] = _role(n, ts, tr, off, roles[n])
        rl |= cpu_roles
        label = f"{mode}: actor_train {ts} on {tr.start}-{tr.stop - 1}, actor_infer {ispec} on {ir.start}-{ir.stop - 1}, offload={'on' if off else 'off'}"
        return Candidate(label, mode, Layout(rl, gpn, gpus, cpus))

    everything = range(gpus)
    for ts, ispec, off in itertools.product(train_dims(train_engine, gpus, gpn, shape, w),
                                            infer_dims(infer_engine, gpus, gpn, shape), (True, False)):
        yield build("colocated", everything, everything, ts, ispec, off)
    for n_inf in splits(gpus, gpn):
        n_tr = gpus - n_inf
        tr, ir = range(0, n_tr), range(n_tr, gpus)
        for ts in train_dims(train_engine, n_tr, gpn, shape, w):
            for ispec in infer_dims(infer_engine, n_inf, gpn, shape):
                if n_tr % parse_backend(ispec).t:
                    continue  # an inference TP group would straddle a node boundary
                for off in ((True, False) if with_train else (True,)):
                    yield build("disaggregated", tr, ir, ts, ispec, off)


BUDGET_KEY = "max_tokens_per_micro_batch"


def packing_roles(layout: Layout, hw: Hardware) -> list[str]:
    """Roles whose engines run token-budget micro-batches as the config and device resolve them
    (``passes.token_budget`` > 0): the search chooses their budget. A role left padded (budget 0,
    the user's choice or the device's default) stays padded."""
    return [n for n, r in layout.roles.items() if r.is_gpu and token_budget(r, hw) > 0]


def budgets(layout: Layout, roles: list[str], w: Workload) -> list[int]:
    """Token budgets to try, largest first: powers of two from the longest sample's (prompt plus the
    longest response) up to the first that holds a rank's whole share of a pass (a larger one
    makes the same rows)."""
    if not roles:
        return []
    longest = w.prompt_len + w.response_max
    d = min(layout.roles[n].backend.d for n in roles if layout.roles[n].backend is not None)  # type: ignore[union-attr]
    share = math.ceil(w.sequences / max(1, d)) * (w.prompt_len + w.response_mean)
    lo = 1 << max(0, math.ceil(math.log2(max(1.0, longest))))
    out = [lo]
    while out[-1] < share:
        out.append(out[-1] * 2)
    return out[::-1]


def with_budget(layout: Layout, roles: list[str], budget: int) -> Layout:
    """``layout`` with ``roles``' engine_args setting the token budget."""
    rl = dict(layout.roles)
    for n in roles:
        rl[n] = replace(rl[n], engine_args=rl[n].engine_args | {BUDGET_KEY: budget})
    return replace(layout, roles=rl)


def choose_budget(c: Candidate, shape: ModelShape, w: Workload, hw: Hardware, model_dtype: str, coef: Coefficients,
                  mem_limit: float | None, overlap: bool) -> None:
    """Predict ``c`` under each of ``budgets`` and keep the fastest that fits (the larger on a tie),
    or, when none fits, the smallest budget's prediction (its problems say why)."""
    roles = packing_roles(c.layout, hw)
    ladder = budgets(c.layout, roles, w)
    if not ladder:
        c.prediction = predict(c.layout, shape, w, hw, model_dtype, coef, mem_limit, overlap)
        return
    best: tuple[float, Layout, Prediction, int] | None = None
    last: tuple[Layout, Prediction, int] | None = None
    for b in ladder:
        layout = with_budget(c.layout, roles, b)
        pred = predict(layout, shape, w, hw, model_dtype, coef, mem_limit, overlap)
        last = (layout, pred, b)
        if pred.fits and (best is None or pred.step_s < best[0]):
            best = (pred.step_s, layout, pred, b)
    assert last is not None
    c.layout, c.prediction, c.budget = best[1:] if best is not None else last
    c.label += f", {BUDGET_KEY}={c.budget}"


def _mapping(r: range) -> str:
    return f"list(range({r.start},{r.stop}))"


def _value(v: str) -> str:
    """A Hydra override value: bare when the grammar allows, quoted otherwise."""
    return v if all(ch.isalnum() or ch in ":_.-" for ch in v) else f"'{v}'"


def to_overrides(c: Candidate, cfg: Mapping[str, Any], typed: RLBatchConfig) -> tuple[list[str], dict[str, Any]]:
    """Hydra override lines for a candidate, and the plain config they produce (``cfg`` with them;
    ``typed``: ``cfg`` as the parse read it, what the lines are decided from)."""
    plain = copy.deepcopy(dict(cfg))
    lines = []
    for name, r in c.layout.roles.items():
        if not r.is_gpu:
            continue
        assert isinstance(r.ranks, range)
        rc = plain["roles"].setdefault(name, {})
        lines.append(f"'roles.{name}.device_mapping=\"{_mapping(r.ranks)}\"'")
        lines.append(f"roles.{name}.backend={_value(str(r.backend))}")
        lines.append(f"roles.{name}.offload={'true' if r.offload else 'false'}")
        rc |= {"device_mapping": _mapping(r.ranks), "backend": str(r.backend), "offload": r.offload, "enabled": True}
        given = typed.roles.get(name)
        for k in ("num_gpus_per_worker", "world_size"):
            if given is not None and getattr(given, k) is not None:
                lines.append(f"roles.{name}.{k}=null")
                rc[k] = None
        if c.budget and r.engine_args.get(BUDGET_KEY) == c.budget:
            # ++ adds the key or replaces the config's value
            lines.append(f"++roles.{name}.engine_args.{BUDGET_KEY}={c.budget}")
            rc["engine_args"] = dict(rc.get("engine_args") or {}) | {BUDGET_KEY: c.budget}
    if c.lora:
        lines.append(f"++model.lora.rank={c.lora}")
        model = plain.setdefault("model", {})
        model["lora"] = dict(model.get("lora") or {}) | {"rank": c.lora}
        if typed.enabled("reference"):
            lines.append("roles.reference.enabled=false")  # the reference is the policy's base model
            plain["roles"]["reference"] = dict(plain["roles"]["reference"]) | {"enabled": False}
    nodes = typed.cluster.nodes
    if nodes is not None and nodes * c.layout.gpus_per_node < c.layout.num_gpus:
        plain.setdefault("cluster", {})["nodes"] = c.layout.num_nodes
        lines.append(f"cluster.nodes={c.layout.num_nodes}")
    return lines, plain


def search(cfg: Mapping[str, Any], gpus: int, gpn: int, shape: ModelShape, w: Workload, hw: Hardware,
           coef: Coefficients, model_dtype: str, top: int = 5, cpus: int = 1,
           mem_limit: float | None = None, overlap: bool = False) -> tuple[list[Candidate], dict[str, int]]:
    """Rank every candidate; return the ``top`` valid fitting ones and counts of what was dropped."""
    typed = parse(cfg).config  # what the search reads; cfg, as plain mappings, is what it writes candidates from
    from rlbatch.checks.validate import check

    scored, stats = [], {"candidates": 0, "fit": 0, "oom": 0, "invalid": 0, "lora": 0}

    def rank(w: Workload, lora: int) -> None:
        for c in candidates(typed, gpus, gpn, shape, w, cpus):
            stats["candidates"] += 1
            c.lora = lora
            if lora:
                c.label += f", LoRA r{lora}"
            choose_budget(c, shape, w, hw, model_dtype, coef, mem_limit, overlap)
            assert c.prediction is not None
            if c.prediction.fits:
                stats["fit"] += 1
                scored.append(c)
            else:
                stats["oom"] += 1

    rank(w, 0)
    train_engine = parse_backend(typed.roles["actor_train"].backend).engine
    if not scored and not w.lora_rank and spec_of(train_engine).trains_adapters:
        stats["lora"] = LORA_RANK  # nothing fits with every weight trained: adapters do with less
        rank(replace(w, lora_rank=LORA_RANK), LORA_RANK)
    scored.sort(key=lambda c: (c.prediction.step_s if c.prediction else math.inf, c.label))
    best: list[Candidate] = []
    for c in scored:
        if len(best) >= top:
            break
        c.overrides, plain = to_overrides(c, cfg, typed)
        try:
            check(plain, runnable=False)
        except ConfigError:
            stats["invalid"] += 1
            continue
        best.append(c)
    return best, stats
