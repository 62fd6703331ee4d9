"""The ``deepspeed`` training engine: DeepSpeed ZeRO 1, 2 or 3 over the role's data-parallel ranks
(docs/deepspeed.md). Its spec and typed engine_args are here; the engine is ``engine``, DeepSpeed's
world on the role's ranks ``world``, its cost model ``rlbatch.engines.deepspeed.cost``."""

from __future__ import annotations

from dataclasses import dataclass

from rlbatch.engines.defaults import SYNC_BUCKET_MB
from rlbatch.engines.registry import EngineKind, EngineSpec, register


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
    sync_bucket_mb: int = SYNC_BUCKET_MB
    """actor_train: weight sync to a disaggregated actor_infer broadcasts buckets of this size."""

    def __post_init__(self) -> None:
        if self.zero_stage not in (1, 2, 3):
            raise ValueError(f"zero_stage: must be 1, 2 or 3, got {self.zero_stage}")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(f"offload_params: needs zero_stage 3 (parameters are partitioned only there), "
                             f"got zero_stage {self.zero_stage}")


register(EngineSpec("deepspeed", EngineKind.TRAIN, DeepSpeedArgs, "rlbatch.engines.deepspeed.engine:DeepSpeedEngine",
                    dims="d", note="only data parallelism (deepspeed:dN) is built", heads=("lm", "value", "reward"),
                    packs_rows=True, trains_adapters=True, cost="rlbatch.engines.deepspeed.cost:DeepSpeedCost"))
