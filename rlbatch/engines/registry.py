"""Which engines this build runs, what each accepts, and where its implementation lives.

Torch-free, so validation, the launcher and the planner read it without importing an engine.
The placement language (``rlbatch.placement.backend.ENGINES``) names every engine a backend
string may mention; this registry says which of them are *built*: the dims each supports here,
its typed ``engine_args`` and how the loop dispatches samples to its ranks. An engine is
added by one ``register(EngineSpec(...))`` call next to its implementation (or in a plugin module
listed in the config's ``plugins``); nothing else changes.

    python -c "from rlbatch.engines.registry import describe; print(describe())"
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlbatch.config.bounds import RANGE, Range, bounded, value_problem
from rlbatch.placement.backend import ENGINES, EngineInfo, EngineKind

AT_LEAST_ZERO = Range(ge=0)
"""The range of a numeric engine arg that declares none (``bounded`` declares one): sizes, counts
and fractions are never negative, and every one is finite and within what torch holds."""


@dataclass(frozen=True)
class FSDPArgs:
    """engine_args of the ``fsdp`` engine (training and forward-only roles)."""

    micro_batch: int = 0
    """Sequences per log-prob forward (0: the rank's whole share in one pass)."""
    share_prompts: bool = True
    """Run each distinct prompt of a micro-batch once and its responses on its KV cache (same
    log-probs and gradients, less compute for GRPO groups); off under activation checkpointing."""
    max_tokens_per_micro_batch: int | None = None
    """> 0: each micro-batch runs without padding, its samples concatenated into one row with
    attention confined to each sample, the LM head only at the positions that score a response
    token, log-probs and entropy computed in chunks (no fp32 copy of the logits kept for the
    backward; a reward model's score read at each sample's last token); share_prompts is then not
    used. Micro-batches hold at most this many prompt + response tokens (a longer sample alone),
    every dp rank running as many; training's loss is then exact under any split (the whole
    mini-batch's aggregation; algo.grad_accum unused) and the samples are spread over the dp ranks
    by tokens (docs/algorithms.md). 0: padded rows, grad_accum micro-batches by sample count.
    Unset: the device's default (``rlbatch.engines.defaults.max_tokens_per_micro_batch``): packed
    with a budget of 4096 tokens on a GPU, padded on the CPU."""
    single_unit_max_mb: int = 64
    """A model of up to this many MB of fp32 parameters is one FSDP unit (one all-gather per
    pass); a larger one gets a unit per decoder layer."""
    sync_bucket_mb: int = 256
    """actor_train: weight sync to a disaggregated actor_infer broadcasts buckets of this size."""


@dataclass(frozen=True)
class HFArgs:
    """engine_args of the ``hf`` inference engine (transformers ``generate``)."""

    max_batch: int = 1024
    """Sequences per ``generate`` call."""
    share_prompts: bool = True
    """Prefill each distinct prompt of a call once and decode its samples on the selected cache."""


@dataclass(frozen=True)
class VLLMArgs:
    """engine_args of the ``vllm`` inference engine (an in-process ``vllm.LLM`` per rank; on a
    machine without a GPU, vLLM's CPU build). See docs/vllm.md."""

    gpu_memory_utilization: float = bounded(0.9, gt=0, le=1)
    """GPU: share of the GPU vLLM reserves for weights, activations and KV cache (ignored when
    kv_cache_mb is set, and on CPU)."""
    kv_cache_mb: int = 0
    """KV cache size in MiB. 0: on a GPU, what gpu_memory_utilization leaves; on CPU,
    ``VLLM_CPU_KV_CACHE_MB`` (256 MiB). Without a size vLLM's CPU build takes ~90% of the node's memory."""
    max_num_batched_tokens: int = 8192
    """Tokens per scheduler step (chunked prefill)."""
    max_num_seqs: int = 256
    """Sequences decoded together."""
    max_model_len: int = 0
    """Longest prompt + response (0: the model's max_position_embeddings)."""
    enforce_eager: bool = False
    """No CUDA graphs and no torch.compile. On CPU the engine runs eager unless cpu_compile."""
    cpu_compile: bool = False
    """CPU: compile the model as vLLM does by default (torch.compile): ~30 s more start-up, a ~15%
    shorter generate phase on an AVX-512 CPU (docs/benchmarks.md). Off: eager, which starts in seconds."""
    enable_prefix_caching: bool = True
    """Share the KV cache of a prompt's samples (a GRPO group) and of repeated prefixes."""
    dtype: str = "auto"
    """Weights and activations: 'auto' (the run's model.dtype: bf16 on GPU, fp32 on CPU), 'bf16',
    'fp16' or 'fp32'."""


@dataclass(frozen=True)
class SGLangArgs:
    """engine_args of the ``sglang`` inference engine (an in-rank ``sglang.Engine`` per rank; on a
    machine without a GPU, SGLang's CPU engine). See docs/sglang.md."""

    mem_fraction_static: float = bounded(0.88, gt=0, le=1)
    """GPU: share of the GPU SGLang reserves for weights and KV cache (ignored on CPU)."""
    max_num_batched_tokens: int = 8192
    """Tokens per prefill chunk (SGLang's chunked_prefill_size)."""
    max_num_seqs: int = 256
    """Requests decoded together (SGLang's max_running_requests)."""
    kv_cache_tokens: int = 0
    """Tokens the KV cache holds (SGLang's max_total_tokens). 0: on a GPU, what mem_fraction_static
    leaves; on CPU, 16384 (SGLang would otherwise size it from the node's memory)."""
    max_model_len: int = 0
    """Longest prompt + response (0: the model's max_position_embeddings)."""
    dtype: str = "auto"
    """Weights and activations: 'auto' (the run's model.dtype: bf16 on GPU, fp32 on CPU), 'bf16',
    'fp16' or 'fp32'."""

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bf16", "fp16", "fp32"):
            raise ValueError(f"dtype: must be 'auto', 'bf16', 'fp16' or 'fp32', got {self.dtype!r}")


@dataclass(frozen=True)
class DeepSpeedArgs:
    """engine_args of the ``deepspeed`` training engine (training and forward-only roles). See
    docs/deepspeed.md."""

    zero_stage: int = 3
    """ZeRO stage: 1 (optimizer states), 2 (+ gradients) or 3 (+ parameters) sharded over the dp group."""
    micro_batch: int = 0
    """Sequences per log-prob forward (0: the rank's whole share in one pass)."""
    share_prompts: bool = True
    """Run each distinct prompt of a micro-batch once and its responses on its KV cache (as fsdp)."""
    max_tokens_per_micro_batch: int | None = None
    """As fsdp's: > 0 runs each micro-batch without padding in one row, the LM head only at scored
    positions, micro-batches by tokens with the loss exact under the split. 0: padded rows. Unset:
    the device's default, as fsdp's."""
    offload_optimizer: bool = False
    """ZeRO-Offload: fp32 master weights and AdamW state live in host memory, stepped there."""
    offload_params: bool = False
    """ZeRO-3 only: parameter partitions live in host memory between uses."""
    sync_bucket_mb: int = 256
    """actor_train: weight sync to a disaggregated actor_infer broadcasts buckets of this size."""

    def __post_init__(self) -> None:
        if self.zero_stage not in (1, 2, 3):
            raise ValueError(f"zero_stage: must be 1, 2 or 3, got {self.zero_stage}")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(f"offload_params: needs zero_stage 3 (parameters are partitioned only there), "
                             f"got zero_stage {self.zero_stage}")


@dataclass(frozen=True)
class MegatronArgs:
    """engine_args of the ``megatron`` training engine (megatron-core GPTModel; docs/megatron.md)."""

    micro_batch: int = 0
    """Sequences per forward (0: the replica's whole share in one pass)."""
    max_tokens_per_micro_batch: int = 0
    """> 0: every pass (log-probs, values, scores, training) in micro-batches of at most this many
    prompt + response tokens (a longer sample alone), every dp rank running as many, at any p;
    training's loss is then exact under any split (the whole mini-batch's aggregation;
    algo.grad_accum unused) and the samples are spread over the dp ranks by tokens, as fsdp's.
    Rows stay right-padded within a micro-batch (its longest sample sets its length) unless
    ``pack_rows``. 0 (the default on every device): grad_accum micro-batches by sample count,
    micro_batch sequences per forward."""
    pack_rows: bool = False
    """With max_tokens_per_micro_batch > 0: each micro-batch's samples back
    to back in one row, megatron-core's 'thd' format (PackedSeqParams), instead of padded rows: no
    compute on padding. Attention is confined to each sample by an exact block-diagonal mask
    through megatron-core's local attention (TransformerEngine's varlen attention, which megatron
    uses for 'thd', is not used here), so its scores grow with the row's length squared: it pays
    where samples are ragged and the budget short; the planner models rows padded."""
    sync_bucket_mb: int = 256
    """actor_train: weight sync to a disaggregated actor_infer broadcasts buckets of this size."""
    distributed_optimizer: bool = False
    """megatron-core's DistributedDataParallel and DistributedOptimizer: each data-parallel rank keeps
    the fp32 main weights and AdamW state of 1/d of the parameters (gradients reduce-scattered,
    weights all-gathered). Off: torch AdamW on every rank and one all-reduce of the gradients.
    Trainable roles only (a forward-only role has no optimizer)."""
    sequence_parallel: bool = True
    """At t > 1: megatron-core's sequence parallelism, the activations outside the tensor-parallel
    regions (norms, residuals, the MoE router) split along the sequence over tp: 1/t of their memory,
    all-gather and reduce-scatter in place of all-reduce. Needed to train a Mixture-of-Experts
    model at t > 1. No effect at t = 1."""


@dataclass(frozen=True)
class EngineSpec:
    """One engine as this build knows it."""

    name: str
    kind: EngineKind
    args: type
    """Dataclass of its engine_args: every key a user may set, typed, with a default and a doc."""
    implementation: str | None = None
    """'module:Class' implementing the engine Protocol; None when this build does not run it."""
    dims: str = "d"
    """Dims (letters of 'dtpce') this implementation supports with a size above 1."""
    data_axes: tuple[str, ...] = ("dp",)
    """Mesh axes over which samples are split: ranks that differ only in other axes (tp, pp, cp
    peers of one replica) receive the same samples."""
    note: str = ""
    """Why it is not built, or what is missing, for error messages."""
    heads: tuple[str, ...] = ("lm",)
    """The model heads it builds (``rlbatch.config.schema.HEADS``): 'lm' (the policy), 'value' (a
    critic), 'reward' (a sequence-classification reward model)."""
    reserves_device_share: bool = False
    """At start-up it reserves a share of the device's memory for itself and refuses to start when
    that much is not free (vLLM's gpu_memory_utilization): on a rank shared with other engines it
    is built before them, while the device is empty."""
    packs_rows: bool = False
    """Under a token budget (engine_args.max_tokens_per_micro_batch, resolved by
    ``rlbatch.engines.defaults.max_tokens_per_micro_batch``) it packs each micro-batch's samples
    into one unpadded row, the LM head only at scored positions: what the planner models."""

    trains_adapters: bool = False
    """It trains low-rank adapters of the model (``model.lora``) and exports them merged
    (``export_weights``) or alone (``export_adapters``, for an engine that ``loads_adapters``)."""
    rules: str | None = None
    """'module:function' of its own checks before start, ``fn(plain, roles, placement, train_run)
    -> problems``: ``plain`` the config as plain mappings, ``roles`` the roles that run this engine
    (``rlbatch.placement.backend.RoleEngine``), ``placement`` (None when placement failed),
    ``train_run`` whether this machine is to run the training (a runnable check of program=train).
    Validation calls it for every engine in use (``rlbatch.checks.runnable.engine_rule_problems``)."""
    cost: str | None = None
    """'module:Class' of the planner's model of the engine (``rlbatch.plan.costs.EngineCost``): its
    memory and what its passes cost; None: the generic defaults."""
    loads_adapters: bool = False
    """An inference engine that generates with low-rank adapters beside its base weights, so a
    ``model.lora`` policy's weight sync moves the adapters alone (``model.lora.sync``): the trainer
    streams them through its ``export_adapters``, the engine takes them through its
    ``load_adapters(named) -> bytes`` (PEFT's names, in buckets, as ``load_weights`` takes weights)."""

    @property
    def built(self) -> bool:
        return self.implementation is not None


REGISTRY: dict[str, EngineSpec] = {}


def register(spec: EngineSpec, language_dims: str | None = None) -> EngineSpec:
    """Add (or replace) an engine. A name the placement language does not know yet is added to it
    with ``language_dims`` (default: the spec's dims), so backend strings may name it."""
    if not dataclasses.is_dataclass(spec.args):
        raise TypeError(f"engine {spec.name!r}: args must be a dataclass type, got {spec.args!r}")
    if spec.name not in ENGINES:
        ENGINES[spec.name] = EngineInfo(spec.kind, language_dims or spec.dims)
    elif ENGINES[spec.name].kind is not spec.kind:
        raise ValueError(f"engine {spec.name!r} is a {ENGINES[spec.name].kind.value} engine in the placement "
                         f"language, but registered as {spec.kind.value}")
    REGISTRY[spec.name] = spec
    return spec


def spec_of(name: str) -> EngineSpec:
    if name not in REGISTRY:
        raise KeyError(f"engine {name!r} is not registered; registered engines: {sorted(REGISTRY)}")
    return REGISTRY[name]


def built_engines(kind: EngineKind | None = None) -> list[str]:
    return sorted(n for n, s in REGISTRY.items() if s.built and (kind is None or s.kind is kind))


@dataclass
class ArgsCheck:
    """The result of reading one role's engine_args: the typed value, or the problems."""

    value: Any = None
    problems: list[str] = field(default_factory=list)


def _coerce(value: Any, annotation: Any) -> tuple[Any, bool]:
    """The value as the field's type; False when it is not of that type (no string parsing: YAML and
    Hydra already typed it)."""
    t = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    if t.endswith(" | None"):  # optional: unset (None) is the engine's default
        return (None, True) if value is None else _coerce(value, t.removesuffix(" | None"))
    if t == "bool":
        return value, isinstance(value, bool)
    if t == "int":
        return value, isinstance(value, int) and not isinstance(value, bool)
    if t == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return (float(value) if ok else value), ok
    if t == "str":
        return value, isinstance(value, str)
    return value, True


def parse_args(engine: str, raw: Mapping[str, Any] | None, where: str) -> ArgsCheck:
    """Typed engine_args for ``engine`` from the role's mapping. Unknown keys and wrong types are
    problems naming ``where`` (e.g. 'roles.actor_train.engine_args'), the key and what is accepted."""
    spec = REGISTRY.get(engine)
    if spec is None:
        return ArgsCheck(None, [])
    raw = dict(raw or {})
    fields = {f.name: f for f in dataclasses.fields(spec.args)}
    problems = []
    unknown = sorted(str(k) for k in raw if k not in fields)
    if unknown:
        problems.append(f"{where}: unknown key(s) {unknown} for engine '{engine}'; it accepts {sorted(fields)}")
    values = {}
    for k, v in raw.items():
        if k not in fields:
            continue
        coerced, ok = _coerce(v, fields[k].type)
        if not ok:
            want = fields[k].type if isinstance(fields[k].type, str) else getattr(fields[k].type, "__name__", fields[k].type)
            problems.append(f"{where}.{k}: expected {want}, got {type(v).__name__} {v!r}"[:200])
        elif isinstance(coerced, (int, float)) and not isinstance(coerced, bool) and (problem := value_problem(
                f"{where}.{k}", coerced, type(coerced), fields[k].metadata.get(RANGE, AT_LEAST_ZERO))) is not None:
            problems.append(problem)
        else:
            values[k] = coerced
    if problems:
        return ArgsCheck(None, problems)
    try:
        return ArgsCheck(spec.args(**values), [])
    except ValueError as e:  # a value the args refuse (their __post_init__): "<key>: <why>"
        return ArgsCheck(None, [f"{where}.{e}"])


def engine_args(engine: str, raw: Mapping[str, Any] | None) -> Any:
    """Typed engine_args (validated before launch; raises ValueError if they are not)."""
    checked = parse_args(engine, raw, "engine_args")
    if checked.problems:
        raise ValueError("; ".join(checked.problems))
    return checked.value


def describe() -> str:
    lines = []
    for name in sorted(REGISTRY):
        s = REGISTRY[name]
        state = f"built, dims {s.dims}" if s.built else f"not built{': ' + s.note if s.note else ''}"
        keys = ", ".join(f.name for f in dataclasses.fields(s.args))
        heads = f"; heads: {', '.join(s.heads)}" if s.kind is EngineKind.TRAIN else ""
        lines.append(f"{name:10s} {s.kind.value:6s} {state}{heads}; engine_args: {keys or '-'}")
    return "\n".join(lines)


# dims "dtc": FSDP2 over dp, DTensor tensor parallelism over tp (rlbatch.engines.train.fsdp_tp) or
# Ulysses context parallelism over cp (rlbatch.engines.ulysses), alone or together (c splits each tp rank's heads).
register(EngineSpec("fsdp", EngineKind.TRAIN, FSDPArgs, "rlbatch.engines.train.fsdp:FSDPEngine", dims="dtc",
                    heads=("lm", "value", "reward"), packs_rows=True, trains_adapters=True,
                    cost="rlbatch.plan.costs.fsdp:FSDPCost", rules="rlbatch.engines.train.fsdp_rules:fsdp_problems"))
register(EngineSpec("hf", EngineKind.INFER, HFArgs, "rlbatch.engines.infer.hf:HFInferenceEngine", dims="d",
                    cost="rlbatch.plan.costs.hf:HFCost"))
# dims "dt": data-parallel vLLM workers of t tensor-parallel ranks each; the placement language
# keeps "dtp" so plans with pipeline-parallel vLLM are still modelled.
register(EngineSpec("vllm", EngineKind.INFER, VLLMArgs, "rlbatch.engines.infer.vllm:VLLMEngine", dims="dt",
                    note="pipeline-parallel vLLM (p>1) is not built: rlbatch runs vLLM inside its ranks through vLLM's "
                         "external launcher, which vLLM builds for tensor parallelism (every rank one engine over "
                         "the same requests); its pipeline stages run under vLLM's own multiprocessing or Ray "
                         "executors; use vllm:dXtY", reserves_device_share=True,
                    loads_adapters=True, cost="rlbatch.plan.vllm:VLLMCost",
                    rules="rlbatch.engines.infer.vllm_rules:vllm_problems"))
# dims "dt": data-parallel SGLang workers of t tensor-parallel ranks each, one engine per worker on
# its first rank (SGLang spawns the t scheduler processes itself).
register(EngineSpec("sglang", EngineKind.INFER, SGLangArgs, "rlbatch.engines.infer.sglang:build", dims="dt",
                    reserves_device_share=True, cost="rlbatch.plan.costs.sglang:SGLangCost",
                    rules="rlbatch.engines.infer.sglang_rules:sglang_problems"))
register(EngineSpec("deepspeed", EngineKind.TRAIN, DeepSpeedArgs, "rlbatch.engines.train.deepspeed:DeepSpeedEngine",
                    dims="d", note="only data parallelism (deepspeed:dN) is built", heads=("lm", "value", "reward"),
                    packs_rows=True, trains_adapters=True, cost="rlbatch.plan.costs.deepspeed:DeepSpeedCost"))
# dims "dtpce": tensor, pipeline, data, context (Ulysses, padded rows: rlbatch.engines.train.megatron)
# and expert parallel (e over d, for Mixture-of-Experts models).
register(EngineSpec("megatron", EngineKind.TRAIN, MegatronArgs, "rlbatch.engines.train.megatron:MegatronEngine",
                    dims="dtpce", data_axes=("dp",), heads=("lm", "value", "reward"),
                    cost="rlbatch.plan.costs.megatron:MegatronCost", rules="rlbatch.engines.train.megatron_rules:megatron_problems"))
