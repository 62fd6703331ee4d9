"""The planner's model of rlbatch's deepspeed engine (ZeRO stages 1-3 over dp)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlbatch.engines.deepspeed import DeepSpeedArgs
from rlbatch.plan.costs import EngineCost, Held
from rlbatch.plan.passes import adapted

if TYPE_CHECKING:
    from rlbatch.models.shape import ModelShape
    from rlbatch.plan.layout import RoleLayout
    from rlbatch.plan.workload import Workload


class DeepSpeedCost(EngineCost):
    """Its engine builds the whole fp32 model on the host on every rank before it is partitioned
    (``load_engine_model``): not modelled in ``load_bytes``."""

    def gathers_each_pass(self, r: RoleLayout) -> bool:
        return r.args_as(DeepSpeedArgs).zero_stage == 3

    def reduces_each_step(self, r: RoleLayout) -> bool:
        return r.args_as(DeepSpeedArgs).zero_stage < 3

    def tensor_sizes(self, gpn: int) -> list[int]:
        return [1]  # data parallelism only

    def held(self, r: RoleLayout, shape: ModelShape, w: Workload, e: int, forward_only: bool) -> Held:
        b, P, ea = r.backend, float(shape.params), r.args_as(DeepSpeedArgs)
        assert b is not None
        stage, n = ea.zero_stage, b.d
        notes: list[str] = []
        # with model.lora only the adapters have gradients, fp32 masters and AdamW moments; the
        # frozen base stays in the compute dtype
        G = float(shape.adapter_params(w.lora_rank, w.lora_targets)) if adapted(r, w) else P
        if G < P and not forward_only:
            notes.append(f"{r.name}: LoRA rank {w.lora_rank}: {G / 1e6:.1f}M trained parameters of {P / 1e6:.1f}M")
        if stage == 3:  # DeepSpeed's estimate: 18 bytes/param over all GPUs + 4 per largest-layer param
            state = {"params": 2 * P / n} if forward_only else {"params": 2 * P / n, "grads": 4 * G / n, "optimizer": 12 * G / n}
            buffers = 4.0 * shape.largest_module_params
        else:
            state = {"params": 2 * P} if forward_only else {
                "params": 2 * P, "grads": 2 * G / (n if stage == 2 else 1), "optimizer": 12 * G / n}
            buffers = 0.0
        # ZeRO-Offload (engine_args): fp32 masters, AdamW state and the fp32 gradient partitions they
        # are stepped with live in host memory; offload_params (stage 3) moves the weights' partitions too.
        if ea.offload_optimizer and not forward_only:
            state["optimizer"] = 0.0
            if stage == 3:
                state["grads"] = 0.0
            notes.append("optimizer offloaded to host")
        if ea.offload_params and stage == 3:
            state["params"] = 0.0
            notes.append("parameters offloaded to host")
        notes.append(f"deepspeed ZeRO stage {stage}")
        # weight sync gathers full tensors one at a time
        return Held(state, shape.layers, fwd_buffers=buffers, train_buffers=buffers,
                    sync_bytes=e * max(shape.layer_params, shape.embedding_params) / b.t, notes=notes)
