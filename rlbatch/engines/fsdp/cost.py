"""The planner's model of rlbatch's fsdp engine (FSDP2 over dp x cp, DTensor over tp: each decoder
layer's attention and MLP weights split over t, the embedding, the norms and the LM head whole on
every tp rank; ``rlbatch.engines.fsdp.tp``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlbatch.engines.defaults import fsdp_single_unit, worth_sharing
from rlbatch.engines.fsdp import FSDPArgs
from rlbatch.plan.costs import EngineCost, Held
from rlbatch.plan.memory import RANDOM_INIT_BLOCK, largest_tensor
from rlbatch.plan.passes import adapted

if TYPE_CHECKING:
    from rlbatch.config.hardware import Hardware
    from rlbatch.models.shape import ModelShape
    from rlbatch.plan.layout import RoleLayout
    from rlbatch.plan.workload import Workload


class FSDPCost(EngineCost):
    def load_bytes(self, r: RoleLayout, shape: ModelShape, e: int, hw: Hardware) -> float:
        """It builds on the meta device and reads only its rows, one tensor at a time
        (``rlbatch.engines.model.engine_skeleton``): at most the rows of the largest tensor in fp32,
        plus one random-init block."""
        b = r.backend
        assert b is not None
        return 4.0 * largest_tensor(shape) / (b.t * b.d * b.c) + RANDOM_INIT_BLOCK

    def units(self, r: RoleLayout, shape: ModelShape) -> int:
        """A small model is one unit, a larger one (or any under tensor parallelism) a unit per layer
        plus the root."""
        b = r.backend
        one = fsdp_single_unit(4 * shape.params, r.args_as(FSDPArgs).single_unit_max_mb) and (b is None or b.t == 1)
        return 1 if one else shape.layers + 1

    def shares_prompts(self, r: RoleLayout, w: Workload, mb: int, trained: bool) -> bool:
        """Each distinct prompt once with only its last position's logits, then the responses on its
        cache (``rlbatch.engines.batch``); not under context parallelism nor a recomputed training pass."""
        b = r.backend
        assert b is not None
        return (b.c == 1 and r.args_as(FSDPArgs).share_prompts and not (trained and w.recompute)
                and worth_sharing(w.distinct_prompts(mb), mb))

    def sequence_parallel(self, r: RoleLayout) -> bool:
        """The engine splits no activations along the sequence over tp (no effect at t = 1)."""
        return r.backend is None or r.backend.t == 1

    def vocab_split(self, r: RoleLayout) -> int:
        """The LM head stays whole on every tp rank (a vocabulary-sharded embedding would untie a
        tied head): each computes the whole vocabulary's logits."""
        return 1

    def gathers_each_pass(self, r: RoleLayout) -> bool:
        return True

    def held(self, r: RoleLayout, shape: ModelShape, w: Workload, e: int, forward_only: bool) -> Held:
        b, P = r.backend, float(shape.params)
        assert b is not None
        t, n = b.t, b.d * b.c
        notes: list[str] = []
        # Tensor parallelism splits the decoder layers' linear weights (all but their two norms);
        # the embedding, the final norm and the LM head stay whole on each tp rank. ``per_t`` is a
        # rank's share of the whole model's parameters before dp sharding.
        split = shape.layers * (shape.layer_params - 2 * shape.hidden) if t > 1 else 0.0
        per_t = (P - split + split / t) / P if t > 1 else 1.0 / t
        # rlbatch's fsdp engine keeps fp32 master weights for a role that trains (bf16 only for
        # compute on GPUs) and the compute dtype for a forward-only one (``FSDPEngine``'s held_dtype).
        state = {"params": (e if forward_only else 4) * P * per_t / n}
        # with model.lora the trained policy's gradients and AdamW state are the adapters' (the base is frozen)
        G = float(shape.adapter_params(w.lora_rank, w.lora_targets)) if adapted(r, w) else P
        if G < P and not forward_only:
            state["adapters"] = 4 * G / t / n
            notes.append(f"{r.name}: LoRA rank {w.lora_rank}: {G / 1e6:.1f}M trained parameters of {P / 1e6:.1f}M")
        if not forward_only:
            state |= {"grads": 4 * G * per_t / n, "optimizer": 8 * G * per_t / n}
        # FSDP2's collectives for the largest unit (the root: embedding, final norm, an untied head;
        # or the whole model when it is one unit), beside the next unit prefetched (a layer). An
        # all-gather copies the unit's shard into an input buffer (1/n), gathers it into an output
        # buffer (1) and copies that into the unsharded parameters (1): 2 + 1/n units. Backward holds
        # the unit's unsharded parameters, their gradients (a tied embedding's two uses summed: 2)
        # and the reduce-scatter's input and output in the reduce dtype (fp32): 3 units in the
        # compute dtype, 1 + 1/n in fp32. And as the engine keeps its gradients between steps
        # (zeroed, not freed), the backward's new gradient shards stand beside them until they are
        # added: one fp32 gradient shard more. Measured on CPU (docs/benchmarks.md, "Host memory").
        one = self.units(r, shape) == 1
        # the buffers below are divided by t; the root unit is whole on every tp rank, so it counts t times
        root = (shape.embedding_params * (1 if shape.tied else 2) + shape.hidden) * (t if t > 1 else 1)
        unit = P if one else max(float(shape.layer_params), root)
        nxt = 0.0 if one else float(shape.layer_params)
        g = G / P  # the share of a unit that gets gradients (1 but with adapters)
        return Held(
            state, shape.layers,
            fwd_buffers=e * ((2 + 1 / n) * unit + nxt) / t,
            train_buffers=(3 * e * unit + 4 * (1 + 1 / n) * unit * g + e * (2 + 1 / n) * nxt + 4 * G / n) / t,
            buffer_term="fsdp_buffers",
            # torch's foreach AdamW computes sqrt(v) for every parameter at once: one fp32 shard more,
            # after the backward's buffers are gone.
            step_temp=4 * G * per_t / n,
            # Weight sync gathers one unit at a time, each tensor in full (a shard cast to the wire
            # dtype, the all-gather's padded output and its unpadded copy): the unit and its largest tensor again.
            sync_bytes=e * (unit * (1 + 1 / n) + min(unit, largest_tensor(shape))) / t,
            notes=notes)
