"""``fsdp`` training engine: FSDP2 (``fully_shard``) over the role's DeviceMesh.

Also serves forward-only roles (reference): without an optimizer it only computes log-probs.
Parameter names are the transformers model's, i.e. Hugging Face names, so weight export and
checkpoint state need no renaming. AdamW, gradient clipping, linear warm-up, gradient accumulation and
activation checkpointing; bf16 compute with fp32 master weights on GPU, fp32 on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from rlbatch import algos
from rlbatch.algos.objective import LossInput, PolicyObjective
from rlbatch.engines.base import CheckpointState, EngineContext, Sample
from rlbatch.engines.batch import Packed, pack, response_logits, unpack
from rlbatch.engines.defaults import fsdp_single_unit, share_prompts
from rlbatch.engines.model import load_model
from rlbatch.engines.offload import StashedState, Stashes, TensorStash, grad_tensors, optimizer_tensors
from rlbatch.engines.train.state import load_module_state, module_state


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * 4 for p in model.parameters())


class FSDPEngine(StashedState):
    """A role's model sharded with FSDP2 over its dp axis (see the module docstring)."""

    def __init__(self, ctx: EngineContext) -> None:
        mesh, algo, args = ctx.mesh, ctx.algo, ctx.args
        dims = dict(zip(mesh.mesh_dim_names, mesh.mesh.shape, strict=True))
        if any(dims.get(k, 1) > 1 for k in ("tp", "cp", "pp")):
            raise NotImplementedError(f"fsdp engine: only data parallelism (d) is implemented, got mesh {dims}")
        self.device, self.algo, self.tokenizer = ctx.device, algo, ctx.tokenizer
        self.micro_batch = int(args.micro_batch)
        self.dp_group = ctx.group("dp")
        model = load_model(ctx.model, ctx.tokenizer, ctx.seed, torch.float32)
        recompute = ctx.trainable and bool(algo.activation_checkpointing)
        if recompute:
            model.gradient_checkpointing_enable()
        # A recomputed layer would append its keys to a shared prompt's cache a second time.
        self.share_prompts = share_prompts(args) and not recompute
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
            warmup = int(algo.warmup_steps)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
            )
            opt = self.optimizer
            self.state.add("grads", TensorStash("grads", lambda: grad_tensors(self.model)))
            self.state.add("optimizer", TensorStash("optimizer", lambda: optimizer_tensors(opt)))
        else:
            self.model.eval()

    def _chunks(self, samples: list[Sample]) -> list[list[Sample]]:
        size = self.micro_batch or len(samples)
        return [samples[i : i + size] for i in range(0, len(samples), size)]

    @torch.no_grad()
    def logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for chunk in self._chunks(samples):
            b = self._pack(chunk)
            out += unpack(algos.token_logprobs(response_logits(self.model, b).float(), b.targets), b.lengths)
        return out

    def _pack(self, chunk: list[Sample]) -> Packed:
        return pack(chunk, self.tokenizer.pad_token_id, self.device, share_prompts=self.share_prompts)

    def _loss(self, chunk: list[Sample], objective: PolicyObjective) -> tuple[torch.Tensor, dict[str, float]]:
        b = self._pack(chunk)
        logits = response_logits(self.model, b).float()
        logp = algos.token_logprobs(logits, b.targets)
        return objective(LossInput(logp, b.mask, b.token_advantages(), b.fields,
                                   logits if objective.needs_logits else None))

    def values(self, samples: list[Sample]) -> list[torch.Tensor]:
        raise NotImplementedError("fsdp engine: this model has no value head (a critic is not in this build)")

    def train(self, samples: list[Sample], objective: PolicyObjective) -> dict[str, float]:
        """Mini-batches x epochs of updates minimising ``objective`` over this rank's share of the batch.

        Samples without old log-probs are trained on-policy (old = current, detached): right
        only before the first update, so only the first mini-batch of the first epoch may
        leave them out."""
        assert self.optimizer is not None, "train() on a forward-only engine"
        a = self.algo
        per_mb = len(samples) // a.mini_batches
        totals: dict[str, float] = {}
        updates = 0
        for epoch in range(a.epochs):
            for m in range(a.mini_batches):
                mb = samples[m * per_mb : (m + 1) * per_mb]
                missing = sum("old_logprobs" not in s for s in mb)
                if missing and (epoch, m) != (0, 0):
                    raise ValueError(f"train: {missing} samples of mini-batch {m} (epoch {epoch}) have no old "
                                     f"log-probs; only the first mini-batch of the first epoch may leave them out")
                micro = math.ceil(len(mb) / a.grad_accum)
                self.optimizer.zero_grad(set_to_none=False)
                for k in range(0, len(mb), micro):
                    loss, stats = self._loss(mb[k : k + micro], objective)
                    (loss / a.grad_accum).backward()
                    for key, v in stats.items():
                        totals[key] = totals.get(key, 0.0) + v / a.grad_accum
                if a.grad_clip > 0:
                    norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.grad_clip)
                    total_norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
                    totals["grad_norm"] = totals.get("grad_norm", 0.0) + float(total_norm)
                self.optimizer.step()
                self.scheduler.step()
                updates += 1
        out = {k: v / updates for k, v in totals.items()}
        out["lr"] = float(self.scheduler.get_last_lr()[0])
        return out

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
