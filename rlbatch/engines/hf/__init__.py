"""The ``hf`` inference engine: transformers' ``generate`` on the role's ranks. Its spec and typed
engine_args are here; the engine is ``engine``, its cost model ``rlbatch.engines.hf.cost``."""

from __future__ import annotations

from dataclasses import dataclass

from rlbatch.engines.defaults import HF_MAX_BATCH
from rlbatch.engines.registry import EngineKind, EngineSpec, register


@dataclass(frozen=True)
class HFArgs:
    """engine_args of the ``hf`` inference engine (transformers ``generate``)."""

    max_batch: int = HF_MAX_BATCH
    """Sequences per ``generate`` call."""
    share_prompts: bool = True
    """Prefill each distinct prompt of a call once and decode its samples on the selected cache."""


# sync_check_floor: the trainers' transformers forward on the same weights; fp32 on CPU differs by ~1e-7
register(EngineSpec("hf", EngineKind.INFER, HFArgs, "rlbatch.engines.hf.engine:HFInferenceEngine", dims="d",
                    cost="rlbatch.engines.hf.cost:HFCost", sync_check_floor=1e-4))
