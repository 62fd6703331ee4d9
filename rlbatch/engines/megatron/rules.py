"""What the megatron engine cannot split, said before anything starts: the model's layers over
pipeline stages, its attention heads and MLP over tensor-parallel ranks, its routed experts over
expert-parallel ranks (the shape of ``model``: its config.json, or the random-init fields), and
under a hybrid ``(attn:...|ffn:...)`` layout the routed experts over the ffn section's t and e; and the
layouts it does not build or megatron-core refuses (a hybrid layout on a dense model; training a
Mixture-of-Experts model under tensor parallelism without sequence parallelism; expert parallelism
with tensor parallelism outside a hybrid layout, or with the distributed optimizer; training in
fp16); and ranks without a
GPU when no CPU shim is installed (``megatron_device.needs_cuda``: the message the ranks would stop with). The engine refuses the same at build, with the same numbers."""

from __future__ import annotations

from typing import Any

from rlbatch.config.schema import TRAINABLE_ROLES, RLBatchConfig
from rlbatch.engines.megatron import MegatronArgs
from rlbatch.engines.megatron.device import needs_cuda
from rlbatch.engines.megatron.limits import context_parallel_refusal
from rlbatch.engines.registry import parse_args
from rlbatch.errors import ConfigError
from rlbatch.osinfo import on_cpu
from rlbatch.placement.backend import ParallelDims, RoleEngine

CONVERTED_ARCHS = ("qwen2", "llama", "qwen2_moe")
"""The Hugging Face ``model_type``s whose weight names ``convert`` maps onto megatron-core's GPTModel."""


def megatron_problems(cfg: RLBatchConfig, engines: list[RoleEngine], placement: Any = None,
                      train_run: bool = True) -> list[str]:
    """One line per split that does not divide (``EngineSpec.rules``; only for a run this machine is
    to start, ``train_run``). Inherited backends are reported once, on actor_train."""
    from rlbatch.models.spec import spec_from_config

    mine = [e for e in engines if e.backend.engine == "megatron" and not e.inherited]
    if not mine or not train_run:
        return []
    problems = []
    if on_cpu(cfg.cluster) and (why := needs_cuda("cpu")) is not None:  # the ranks would start, then stop with it
        problems += [f"roles.{e.role}.backend: {why}" for e in mine]
    try:
        spec = spec_from_config(cfg.model)
    except (ConfigError, OSError, ValueError, TypeError):  # the model checks report it
        return problems
    if spec.arch not in CONVERTED_ARCHS:
        return problems + [f"roles.{e.role}.backend: the megatron engine converts {', '.join(CONVERTED_ARCHS)} models "
                           f"(rlbatch/engines/megatron/convert.py); model.path is a {spec.arch!r} model; use fsdp or "
                           f"deepspeed for it" for e in mine]
    for e in mine:
        b, d = e.backend, e.backend.dims  # a hybrid spec's dims: attn's
        field = f"roles.{e.role}.backend"
        args = _args(cfg, e.role)
        if b.ffn is not None:
            problems += _hybrid_problems(field, b, spec, args, e.role in TRAINABLE_ROLES)
        else:
            problems += _expert_problems(field, b, spec, args, e.role in TRAINABLE_ROLES)
        if e.role in TRAINABLE_ROLES and cfg.model.dtype == "fp16":
            problems.append(f"{field}: the megatron engine trains in bf16 or fp32 (model.dtype), got model.dtype=fp16: "
                            f"fp16 gradients need loss scaling, which it does not build")
        splits = (("layers", "num_layers", spec.layers, d.p, "pipeline stages p"),
                  ("attention", "num_heads", spec.heads, d.t, "tensor-parallel ranks t"),
                  ("attention", "num_kv_heads", spec.kv_heads, d.t, "tensor-parallel ranks t"),
                  ("MLP", "intermediate_size", spec.ffn, d.t, "tensor-parallel ranks t"),
                  ("routed experts", "moe_intermediate_size", spec.moe_ffn, b.ffn.t if b.ffn else d.t,
                   "the ffn section's expert tensor-parallel ranks t" if b.ffn else "tensor-parallel ranks t"),
                  ("shared expert", "shared_expert_intermediate_size", spec.shared_ffn, d.t, "tensor-parallel ranks t"))
        for what, name, n, by, axis in splits:
            if by > 1 and n % by:
                problems.append(f"{field}: '{b}' splits the model's {what} over {axis}={by}, but "
                                f"{name}={n} is not divisible by {by}")
        if d.c > 1:
            problems += _context_problems(field, b, spec, args, e.role in TRAINABLE_ROLES)
    return problems


def _args(cfg: RLBatchConfig, role: str) -> MegatronArgs:
    """The role's typed engine_args; the defaults where they do not parse (their own check reports it)."""
    args = parse_args("megatron", cfg.roles[role].engine_args, f"roles.{role}.engine_args").value
    return args if isinstance(args, MegatronArgs) else MegatronArgs()


def _context_problems(field: str, b: Any, spec: Any, engine_args: MegatronArgs, trains: bool) -> list[str]:
    """Context parallelism: each TP rank's attention heads split over c (its key/value heads too, or
    repeated up to c), and the settings it is built for (``megatron_limits``)."""
    d, out = b.dims, []
    heads, kv = spec.heads // max(d.t, 1), spec.kv_heads // max(d.t, 1)
    if heads % d.c:
        out.append(f"{field}: '{b}' splits each tensor-parallel rank's {heads} attention heads (num_heads="
                   f"{spec.heads} over t={d.t}) over context-parallel ranks c={d.c}, but {heads} is not divisible "
                   f"by {d.c}")
    elif kv % d.c and d.c % kv:
        out.append(f"{field}: '{b}' splits each tensor-parallel rank's {kv} key/value heads (num_kv_heads="
                   f"{spec.kv_heads} over t={d.t}) over context-parallel ranks c={d.c}: neither divides the other")
    packed = engine_args.pack_rows and engine_args.max_tokens_per_micro_batch > 0
    why = context_parallel_refusal(d.p, packed, spec.experts, b.ffn is not None,
                                   trains and engine_args.distributed_optimizer)
    if why:
        out.append(f"{field}: '{b}': context parallelism c={d.c} {why}")
    return out


def _expert_problems(field: str, b: Any, spec: Any, engine_args: MegatronArgs, trains: bool) -> list[str]:
    d = b.dims
    if d.e > 1 and not spec.experts:
        return [f"{field}: '{b}' splits the model's routed experts over expert-parallel ranks e={d.e}, but the model "
                f"has none (a dense {spec.arch}); expert parallelism needs a Mixture-of-Experts model, e.g. "
                f"model.arch=qwen2_moe"]
    out = []
    if d.e > 1 and spec.experts % d.e:
        out.append(f"{field}: '{b}' splits the model's {spec.experts} routed experts over expert-parallel ranks "
                   f"e={d.e}, but num_experts={spec.experts} is not divisible by {d.e}")
    if d.e > 1 and d.t > 1:
        out.append(f"{field}: '{b}' combines expert parallelism e={d.e} with tensor parallelism t={d.t}, which the "
                   f"megatron engine does not build on one mesh; use t=1 with e (or t without e), or a hybrid "
                   f"layout, e.g. 'megatron:(attn:{d.spec('dptc')}|ffn:{ParallelDims(p=d.p, t=d.t, e=d.e).spec('pte')})'")
    if d.e > 1 and d.d % d.e:
        out.append(f"{field}: '{b}' folds expert parallelism onto data parallelism, but e={d.e} does not divide "
                   f"d={d.d}")
    if spec.experts and d.t > 1 and trains and not engine_args.sequence_parallel:
        out.append(f"{field}: '{b}' trains a Mixture-of-Experts model under tensor parallelism t={d.t}, which "
                   f"megatron-core does with sequence parallelism only; leave engine_args.sequence_parallel true")
    if d.e > 1 and engine_args.distributed_optimizer:
        out.append(f"{field}: engine_args.distributed_optimizer with expert parallelism e={d.e} is not built; "
                   f"leave it false")
    return out


def _hybrid_problems(field: str, b: Any, spec: Any, engine_args: MegatronArgs, trains: bool) -> list[str]:
    """A hybrid layout: attention's splits are checked as for one mesh (``b.dims`` are attn's); here the
    ffn section's, which lays out the routed experts alone."""
    f, a = b.ffn, b.attn
    if not spec.experts:
        return [f"{field}: '{b}' lays out routed experts in its ffn section (t={f.t}, e={f.e}), but the model has "
                f"none (a dense {spec.arch}); a hybrid layout needs a Mixture-of-Experts model, e.g. "
                f"model.arch=qwen2_moe, or write one mesh, e.g. 'megatron:{a.spec()}'"]
    out = []
    if spec.experts % f.e:
        out.append(f"{field}: '{b}' splits the model's {spec.experts} routed experts over the ffn section's "
                   f"expert-parallel ranks e={f.e}, but num_experts={spec.experts} is not divisible by {f.e}")
    if a.t > 1 and trains and not engine_args.sequence_parallel:
        out.append(f"{field}: '{b}' trains a Mixture-of-Experts model under tensor parallelism t={a.t} (the attn "
                   f"section's), which megatron-core does with sequence parallelism only; leave "
                   f"engine_args.sequence_parallel true")
    if engine_args.distributed_optimizer:
        out.append(f"{field}: engine_args.distributed_optimizer with a hybrid layout is not built; leave it false")
    return out
