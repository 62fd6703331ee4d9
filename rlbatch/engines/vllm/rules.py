"""What vLLM would refuse once the ranks are up, refused by ``check(cfg)`` before anything starts.

For every role whose backend is ``vllm``, with the model's shape from ``rlbatch.models.spec``
(``model.path``'s config.json, or the random-init fields):

- tensor parallelism t that vLLM cannot split the attention heads over;
- on CPU, a head size vLLM's CPU attention has no kernel for;
- a KV cache larger than the memory it must fit in: on CPU, kv_cache_mb times the engine ranks of
  a node against the node's memory; on a GPU, against the GPU's memory minus the weights;
- a KV cache too small for one sequence of max_model_len (vLLM refuses to start).

Memory comes from ``cluster.mem_gb``, the ``hardware`` config (a profile ``name`` of
rlbatch/conf/hardware and/or ``host_ram_bytes`` / ``hbm_bytes``), or, for ``cluster=local``, this
machine. What is unknown (a Slurm node's memory without mem_gb, a GPU's without a profile) is not
checked. No torch, no vLLM import.
"""

from __future__ import annotations

import math
import os
import subprocess

from rlbatch.config.schema import LoraConfig, RLBatchConfig
from rlbatch.engines.registry import parse_args
from rlbatch.engines.tp_split import kv_heads_per_rank, tp_heads_refusal
from rlbatch.engines.vllm import VLLMArgs
from rlbatch.engines.vllm.limits import (
    BLOCK_TOKENS_CPU,
    BLOCK_TOKENS_GPU,
    CPU_HEAD_SIZES,
    CPU_KV_CACHE_MB,
    LORA_RANKS,
)
from rlbatch.errors import ConfigError
from rlbatch.models.spec import ModelSpec
from rlbatch.osinfo import on_cpu
from rlbatch.placement import Placement
from rlbatch.placement.backend import RoleEngine

MiB = float(1 << 20)
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def node_memory(cfg: RLBatchConfig) -> tuple[float, str] | None:
    """(bytes, where the figure comes from) of one node's memory, or None when unknown."""
    mem_gb = cfg.cluster.mem_gb
    if mem_gb is not None and mem_gb > 0:
        return mem_gb * float(1 << 30), f"cluster.mem_gb={mem_gb}"
    if cfg.hardware is not None and cfg.hardware.host_ram_bytes is not None:
        return cfg.hardware.host_ram_bytes, "the hardware config's host_ram_bytes"
    if cfg.cluster.name == "local":
        try:
            return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "this machine"
        except (OSError, ValueError):
            return None
    return None


def gpu_memory(cfg: RLBatchConfig) -> tuple[float, str] | None:
    """(bytes, source) of one GPU's memory: the hardware config, or this machine's first GPU
    (nvidia-smi) for cluster=local; None when unknown."""
    if cfg.hardware is not None and cfg.hardware.hbm_bytes is not None:
        return cfg.hardware.hbm_bytes, "the hardware config's hbm_bytes"
    if cfg.cluster.name != "local":
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout.split()
        return float(out[0]) * MiB, "nvidia-smi on this machine"
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _dtype_bytes(cfg: RLBatchConfig, engine_dtype: str, cpu: bool) -> int:
    """Bytes per weight and KV element: engine_args.dtype, else model.dtype; 'auto' is fp32 on CPU, bf16 on GPU."""
    for name in (engine_dtype, cfg.model.dtype):
        if name in _DTYPE_BYTES:
            return _DTYPE_BYTES[name]
    return 4 if cpu else 2


def _head_fix(spec: ModelSpec) -> str:
    """How to reach a head size vLLM's CPU attention supports: for a random-init model, the
    nearest head count (and a KV head count that divides it)."""
    fits = [h for h in range(1, spec.hidden + 1) if spec.hidden % h == 0 and spec.hidden // h in CPU_HEAD_SIZES]
    if not fits:
        return f"no head count splits hidden {spec.hidden} into a supported size: change model.hidden_size"
    heads = min(fits, key=lambda h: (abs(h - spec.heads), -h))
    kv = max(k for k in range(1, min(spec.kv_heads, heads) + 1) if heads % k == 0)
    return f"set model.num_heads={heads} model.num_kv_heads={kv}"


def _head_dim_problem(role: str, spec: ModelSpec, from_path: bool) -> str | None:
    if spec.head_dim in CPU_HEAD_SIZES:
        return None
    sizes = "{" + ", ".join(map(str, CPU_HEAD_SIZES)) + "}"
    if spec.head_dim * spec.heads == spec.hidden:
        shape = f"hidden {spec.hidden} / {spec.heads} heads = {spec.head_dim}"
    else:
        shape = f"head_dim {spec.head_dim}"
    fix = (f"vLLM's CPU build cannot run {spec.name}: use an hf backend, or a GPU" if from_path
           else _head_fix(spec))
    return f"roles.{role}: vllm on CPU needs head_dim in {sizes}; model has {shape}: {fix}"


def _ranks_per_node(placement: Placement | None, role: str) -> dict[int, int]:
    if placement is None or role not in placement.roles:
        return {}
    counts: dict[int, int] = {}
    for r in placement.roles[role].gpu_ranks:
        counts[r // placement.gpus_per_node] = counts.get(r // placement.gpus_per_node, 0) + 1
    return counts


def _memory_problems(cfg: RLBatchConfig, e: RoleEngine, spec: ModelSpec, args: VLLMArgs,
                     placement: Placement | None, cpu: bool | None) -> list[str]:
    where = f"roles.{e.role}.engine_args"
    b, problems = e.backend, []
    kv_mb, util = args.kv_cache_mb, args.gpu_memory_utilization
    if not 0 < util <= 1:
        problems.append(f"{where}.gpu_memory_utilization: must be in (0, 1], got {util}")
    e_bytes = _dtype_bytes(cfg, args.dtype, cpu is not False)
    from rlbatch.models.shape import ModelShape

    weights = e_bytes * ModelShape.of(spec).params / (b.t * b.p)
    kv_bytes: float | None = None
    if cpu:
        kv_bytes = (kv_mb or CPU_KV_CACHE_MB) * MiB
        per_node = _ranks_per_node(placement, e.role)
        mem = node_memory(cfg)
        if per_node and mem is not None:
            node, n = max(per_node.items(), key=lambda kv: (kv[1], -kv[0]))
            total = n * kv_bytes
            if total > mem[0]:
                size = f"kv_cache_mb={kv_mb}" if kv_mb else f"kv_cache_mb=0 ({CPU_KV_CACHE_MB} MiB on CPU)"
                problems.append(
                    f"{where}.kv_cache_mb: {n} vLLM ranks on node {node} x {kv_bytes / MiB:.0f} MiB KV cache "
                    f"({size}) = {total / MiB:.0f} MiB > {mem[0] / MiB:.0f} MiB memory of a node ({mem[1]}); "
                    f"lower kv_cache_mb or spread {e.role} over more nodes")
    elif cpu is False and (gpu := gpu_memory(cfg)) is not None:
        free = gpu[0] - weights
        if kv_mb:
            kv_bytes = kv_mb * MiB
            if kv_bytes > free:
                problems.append(
                    f"{where}.kv_cache_mb: {kv_mb} MiB KV cache > {gpu[0] / MiB:.0f} MiB GPU memory ({gpu[1]}) - "
                    f"{weights / MiB:.0f} MiB weights per GPU ({spec.name} at {e_bytes} bytes over t*p={b.t * b.p}) "
                    f"= {free / MiB:.0f} MiB")
        elif 0 < util <= 1 and util * gpu[0] <= weights:
            problems.append(
                f"{where}.gpu_memory_utilization: {util} x {gpu[0] / MiB:.0f} MiB GPU memory ({gpu[1]}) = "
                f"{util * gpu[0] / MiB:.0f} MiB leaves no KV cache after {weights / MiB:.0f} MiB weights per GPU")
    max_len = args.max_model_len or spec.max_positions
    if max_len > spec.max_positions:
        problems.append(f"{where}.max_model_len: {max_len} > the model's max_position_embeddings "
                        f"{spec.max_positions} (vLLM refuses it)")
    elif kv_bytes is not None:
        block = BLOCK_TOKENS_CPU if cpu else BLOCK_TOKENS_GPU
        per_token = 2 * spec.layers * kv_heads_per_rank(spec.kv_heads, b.t) * spec.head_dim * e_bytes / b.p
        need = math.ceil(max_len / block) * block * per_token
        if need > kv_bytes:
            problems.append(
                f"{where}.kv_cache_mb: one sequence of max_model_len={max_len} tokens needs {need / MiB:.1f} MiB "
                f"of KV cache per rank > {kv_bytes / MiB:.0f} MiB (vLLM refuses to start); raise kv_cache_mb "
                f"or lower max_model_len")
    return problems


def _lora_rank_problem(lora: LoraConfig) -> str | None:
    """Adapters synced alone into vLLM (``model.lora.sync`` adapter, or auto) of a rank above the
    largest ``max_lora_rank`` vLLM takes."""
    rank, sync = lora.rank, lora.sync
    if rank <= LORA_RANKS[-1] or sync not in ("auto", "adapter"):
        return None
    return (f"model.lora.rank: {rank}: vLLM loads adapters of rank at most {LORA_RANKS[-1]} (max_lora_rank), and "
            f"model.lora.sync={sync} syncs the adapters alone into the vllm engine; use a lower rank or "
            f"model.lora.sync=merged")


def vllm_problems(cfg: RLBatchConfig, engines: list[RoleEngine], placement: Placement | None,
                  runnable: bool = True) -> list[str]:
    """Every vLLM role's refusals, one line each (nothing when the model's shape or the role's
    engine_args cannot be read: the other checks report those). Nothing with ``runnable=False``:
    the planner models any engine layout, its search keeps to the tensor-parallel sizes vLLM accepts."""
    vllm = [e for e in engines if e.backend.engine == "vllm" and not e.inherited]
    if not vllm or not runnable:
        return []
    from rlbatch.models.spec import spec_from_config

    try:
        spec = spec_from_config(cfg.model)
    except (ConfigError, OSError, ValueError, TypeError):
        return []
    cpu = on_cpu(cfg.cluster)
    problems = []
    for e in vllm:
        b = e.backend
        if b.t > 1 and (line := tp_heads_refusal(e.role, b, b.t, spec.heads, spec.kv_heads, "vLLM")) is not None:
            problems.append(line)
        if cpu and (p := _head_dim_problem(e.role, spec, bool(cfg.model.path))) is not None:
            problems.append(p)
        if (p := _lora_rank_problem(cfg.model.lora)) is not None:
            problems.append(p)
        args = parse_args("vllm", cfg.roles[e.role].engine_args, f"roles.{e.role}.engine_args").value
        if isinstance(args, VLLMArgs):
            problems += _memory_problems(cfg, e, spec, args, placement, cpu)
    return problems
