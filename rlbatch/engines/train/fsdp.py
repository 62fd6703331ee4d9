"""``fsdp`` training engine: FSDP2 (``fully_shard``) over the role's DeviceMesh.

Also serves forward-only roles (reference): without an optimizer it only computes log-probs.
Parameter names are the transformers model's, i.e. Hugging Face names, so weight export and
checkpoint state need no renaming. AdamW, gradient clipping, linear warm-up, gradient accumulation and
activation checkpointing; bf16 compute with fp32 master weights on GPU, fp32 on CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from rlbatch.engines.base import CheckpointState, EngineContext, Sample
from rlbatch.engines.batch import Packed, pack
from rlbatch.engines.defaults import fsdp_single_unit, share_prompts
from rlbatch.engines.model import load_engine_model
from rlbatch.engines.offload import StashedState, Stashes, TensorStash, grad_tensors, optimizer_tensors
from rlbatch.engines.train import common
from rlbatch.engines.train.state import load_module_state, module_state


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * 4 for p in model.parameters())


class FSDPEngine(StashedState):
    """A role's model sharded with FSDP2 over its dp axis (see the module docstring)."""

    def __init__(self, ctx: EngineContext) -> None:
        mesh, algo, args = ctx.mesh, ctx.algo, ctx.args
        common.require_data_parallel(mesh, "fsdp")
        self.device, self.algo, self.tokenizer = ctx.device, algo, ctx.tokenizer
        self.micro_batch = int(args.micro_batch)
        self.dp_group = ctx.group("dp")
        model = load_engine_model(ctx)
        recompute = ctx.trainable and bool(algo.activation_checkpointing)
        if recompute:
            model.gradient_checkpointing_enable()
        # A value or reward model returns no KV cache to share a prompt's pass through (and a recomputed
        # layer would append its keys to a shared prompt's cache a second time).
        self.share_prompts = share_prompts(args) and not recompute and ctx.head == "lm"
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if ctx.device.type == "cuda" else None
        dp_mesh = mesh["dp"]
        kwargs: dict[str, Any] = {"mesh": dp_mesh} | ({"mp_policy": mp} if mp else {})
        self.mp = mp
        self.single_unit = fsdp_single_unit(param_bytes(model), args)
        if not self.single_unit:
            for layer in model.model.layers:  # a unit per layer: gathered one at a time, overlapping compute
                fully_shard(layer, **kwargs)
        self.model = fully_shard(model.to(ctx.device), **kwargs)
        self.state = Stashes({"params": TensorStash("params", self.model.parameters)})
        self.optimizer: torch.optim.Optimizer | None = None
        if ctx.trainable:
            self.model.train()
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=algo.lr, weight_decay=algo.weight_decay,
                                               foreach=True)  # one dispatch per step, not one per DTensor
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, common.warmup(int(algo.warmup_steps)))
            opt = self.optimizer
            self.state.add("grads", TensorStash("grads", lambda: grad_tensors(self.model)))
            self.state.add("optimizer", TensorStash("optimizer", lambda: optimizer_tensors(opt)))
        else:
            self.model.eval()

    def logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        return common.logprobs(self.model, samples, self.micro_batch, self._pack)

    def _pack(self, chunk: list[Sample]) -> Packed:
        return pack(chunk, self.tokenizer.pad_token_id, self.device, share_prompts=self.share_prompts)

    def values(self, samples: list[Sample]) -> list[torch.Tensor]:
        return common.values(self.model, samples, self.micro_batch, self._pack)

    def scores(self, samples: list[Sample]) -> list[float]:
        return common.scores(self.model, samples, self.micro_batch, self._pack)

    def train(self, samples: list[Sample], objective: Any) -> dict[str, float]:
        """Mini-batches x epochs of updates minimising ``objective`` over this rank's share of the batch
        (``rlbatch.engines.train.common.updates``)."""
        assert self.optimizer is not None, "train() on a forward-only engine"
        a = self.algo
        totals = common.Totals(a.grad_accum)
        for micro_batches in common.updates(samples, a, objective):
            self.optimizer.zero_grad(set_to_none=False)
            for chunk in micro_batches:
                loss, stats = common.chunk_loss(self.model, self._pack(chunk), objective)
                (loss / a.grad_accum).backward()
                totals.add(stats)
            if a.grad_clip > 0:
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.grad_clip)
                total_norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
                totals.add({"grad_norm": float(total_norm)}, 1.0)
            self.optimizer.step()
            self.scheduler.step()
            totals.updates += 1
        return totals.result(float(self.scheduler.get_last_lr()[0]))

    @contextmanager
    def export_weights(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Every parameter unsharded under its Hugging Face name, valid inside the block. A one-unit model without mixed
        precision is all-gathered in one collective (``unshard``) and read in place; otherwise
        each parameter is gathered on its own (``full_tensor``)."""
        with torch.no_grad():
            if self.single_unit and self.mp is None:
                self.model.unshard()
                try:
                    yield [(name, p.detach()) for name, p in self.model.named_parameters()]
                finally:
                    self.model.reshard()
            else:
                yield [(name, p.full_tensor() if hasattr(p, "full_tensor") else p.detach())
                       for name, p in self.model.named_parameters()]

    def checkpoint_state(self) -> CheckpointState | None:
        """Model and AdamW state as named tensors (see ``rlbatch.engines.train.state``); None
        when forward-only."""
        if self.optimizer is None:
            return None
        return module_state(self.model, self.optimizer, self.scheduler, self.dp_group, "fsdp")

    def load_checkpoint_state(self, state: CheckpointState) -> None:
        assert self.optimizer is not None, "load_checkpoint_state on a forward-only engine"
        load_module_state(self.model, self.optimizer, self.scheduler, state)
