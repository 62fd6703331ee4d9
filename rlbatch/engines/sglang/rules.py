"""What the sglang engine would fail on once the ranks are up, refused by validation before start.

- ``algo.partial_rollouts`` (anywhere): the engine generates each call's prompts to their end and
  keeps no request across calls (no ``generate_some``; weights still land mid-generation);
- the ``sglang`` package missing from this environment (``make venv SGLANG=auto``; docs/sglang.md);
- on a machine without a GPU, SGLang's CPU engine without ``sgl_kernel``: SGLang imports that
  library's CPU kernels at start-up and no CPU build of it is published; the test suite brings a
  stand-in (tests/stand_ins, on ``PYTHONPATH``).

With tensor parallelism (t > 1): a model whose heads t does not split (SGLang splits them as vLLM
does), and, on GPUs, a worker whose t GPUs are not consecutive on one node (its engine's scheduler
processes take the leader's GPU and the t - 1 after it). No torch, no SGLang import
(``importlib.util.find_spec`` only).
"""

from __future__ import annotations

import importlib.util
import os
import sys

from rlbatch.config.schema import RLBatchConfig
from rlbatch.engines.tp_split import tp_heads_refusal
from rlbatch.errors import ConfigError
from rlbatch.osinfo import on_cpu
from rlbatch.placement import Placement
from rlbatch.placement.backend import RoleEngine


def _kernel_importable() -> bool:
    """Whether SGLang's CPU engine, started with its switch ``SGLANG_USE_CPU_ENGINE=1``, would find
    sgl_kernel (installed, or a finder's stand-in that answers under that switch)."""
    saved = os.environ.get("SGLANG_USE_CPU_ENGINE")
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    try:
        return importlib.util.find_spec("sgl_kernel") is not None
    finally:
        if saved is None:
            os.environ.pop("SGLANG_USE_CPU_ENGINE")
        else:
            os.environ["SGLANG_USE_CPU_ENGINE"] = saved


def sglang_problems(cfg: RLBatchConfig, engines: list[RoleEngine], placement: Placement | None,
                    train_run: bool = True) -> list[str]:
    """The sglang roles' refusals, one line each; those of this machine's environment only where it is
    to run them."""
    roles = [e for e in engines if e.backend.engine == "sglang" and not e.inherited]
    if not roles:
        return []
    field = f"roles.{roles[0].role}.backend"
    infer = next((e for e in roles if e.role == "actor_infer"), None)
    if cfg.algo.partial_rollouts and infer is not None:
        return [f"algo.partial_rollouts: the inference engine keeps unfinished samples across steps, but "
                f"roles.actor_infer.backend '{infer.backend}' generates each call's prompts to their end and keeps "
                f"no request across calls (weights still land mid-generation with algo.in_flight_updates): use vllm, "
                f"or set algo.partial_rollouts=false"]
    if not train_run:
        return []
    if importlib.util.find_spec("sglang") is None:
        return [f"{field}: '{roles[0].backend}' needs the sglang package, which is not installed in this "
                f"environment ({sys.prefix}); install it with `make venv SGLANG=auto` (docs/sglang.md)"]
    if on_cpu(cfg.cluster) and not _kernel_importable():
        return [f"{field}: '{roles[0].backend}' on CPU runs SGLang's CPU engine, which imports sgl_kernel's CPU "
                f"kernels at start-up; no CPU build of sgl_kernel is published (its wheels link CUDA). Run on a GPU, "
                f"or with tests/stand_ins on PYTHONPATH as the tests do (docs/sglang.md)"]
    return _tp_problems(cfg, [e for e in roles if e.backend.t > 1], placement)


def _tp_problems(cfg: RLBatchConfig, roles: list[RoleEngine], placement: Placement | None) -> list[str]:
    """Tensor-parallel sglang roles: heads t splits, each worker's GPUs consecutive on one node."""
    if not roles:
        return []
    from rlbatch.models.spec import spec_from_config

    problems = []
    try:
        spec = spec_from_config(cfg.model)
    except (ConfigError, OSError, ValueError, TypeError):
        spec = None  # the model's own checks report it
    for e in roles:
        field, t = f"roles.{e.role}.backend", e.backend.t
        if spec is not None and (line := tp_heads_refusal(e.role, e.backend, t, spec.heads, spec.kv_heads,
                                                           "SGLang")) is not None:
            problems.append(line)
        role = placement.roles.get(e.role) if placement is not None else None
        if placement is None or role is None or on_cpu(cfg.cluster):
            continue
        gpn = placement.gpus_per_node
        for worker in role.workers:
            if {r // gpn for r in worker} != {worker[0] // gpn} or list(worker) != list(range(worker[0], worker[0] + t)):
                gpus = ", ".join(f"node {r // gpn} GPU {r % gpn}" for r in worker)
                problems.append(f"{field}: '{e.backend}': a worker's engine runs its {t} tensor-parallel ranks on the "
                                f"first rank's GPU and the {t - 1} after it on that node, but this worker has {gpus}; "
                                f"list each worker's GPUs consecutively in roles.{e.role}.device_mapping")
                break
    return problems
