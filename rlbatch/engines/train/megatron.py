"""``megatron`` training engine: megatron-core's GPTModel, tensor-parallel over the role's tp axis
and data-parallel over its dp axis (``megatron:dXtY``).

Also serves forward-only roles (reference). The model is built from the run's transformers
Qwen2/Llama model (a local HF directory or the random-init one every engine builds from the seed)
and its weights converted in (``megatron_convert``); weights leave it, for weight sync, export and
checkpoints, as full tensors under Hugging Face names, so any inference engine loads them and a
checkpoint of this engine loads into the fsdp engine and back. AdamW with the fsdp engine's
warm-up, gradient clipping over the TP shards and gradient accumulation; gradients are averaged
over dp (with ``engine_args.distributed_optimizer``, megatron-core's DDP and DistributedOptimizer
shard the AdamW state over dp instead: ``megatron_optim``). bf16 parameters on GPU, fp32 on CPU (where it runs only with the test-only shim, see
``megatron_device``). Pipeline, context and expert parallelism are refused by the registry.

The critic and a reward model are the same GPTModel body with a scalar head (hidden -> 1) in place
of the vocabulary output layer, whole on every TP rank: ``values()`` reads it at every response
token, ``scores()`` at each sequence's last non-pad token (transformers' pooling), and
``train()`` minimises the value objective on it. In and out, such a model is transformers'
``...ForTokenClassification`` / ``...ForSequenceClassification`` (``score.weight``, ``score.bias``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from rlbatch import algos
from rlbatch.algos.objective import LossInput
from rlbatch.algos.value import ValueInput
from rlbatch.engines.base import CheckpointState, EngineContext, Sample
from rlbatch.engines.batch import Full, Packed, pack, unpack
from rlbatch.engines.model import load_engine_model
from rlbatch.engines.offload import StashedState, Stashes, TensorStash, grad_tensors, optimizer_tensors
from rlbatch.engines.train import common, megatron_optim
from rlbatch.engines.train import megatron_convert as convert
from rlbatch.engines.train.megatron_device import check_device
from rlbatch.engines.train.megatron_model import build_gpt, freeze_padding_row, process_groups, role_group

ADAM_KEYS = ("exp_avg", "exp_avg_sq")
MEGATRON_GROUP_KEYS = ("is_expert_parallel", "default_config", "wd_mult", "lr_mult", "is_decoupled_lr", "max_lr", "min_lr")
"""Param-group keys megatron-core's optimizer reads, not AdamW's: left out of the checkpoint's groups."""


class MegatronEngine(StashedState):
    """A role's model as a megatron-core GPTModel over its tp and dp axes (see the module docstring)."""

    def __init__(self, ctx: EngineContext) -> None:
        check_device(ctx.device)
        dims = dict(zip(ctx.mesh.mesh_dim_names, ctx.mesh.mesh.shape, strict=True))
        if dims.get("pp", 1) > 1 or dims.get("cp", 1) > 1:
            raise NotImplementedError(f"megatron engine: pipeline and context parallelism are not built, got mesh {dims}")
        self.device, self.algo, self.tokenizer = ctx.device, ctx.algo, ctx.tokenizer
        self.micro_batch = int(ctx.args.micro_batch)
        self.tp_group, self.dp_group = ctx.group("tp"), ctx.group("dp")
        self.tp, self.tp_rank = dist.get_world_size(self.tp_group), dist.get_rank(self.tp_group)
        self.group = role_group(ctx.mesh)
        self.head = ctx.head
        hf = load_engine_model(ctx, torch.float32)
        self.hf_config = hf.config
        self.pad_id = hf.config.pad_token_id  # a reward model pools at the last token that is not this one
        self.hf_names = [n for n, _ in hf.named_parameters()]
        self.lay = convert.layout(hf.config, self.tp, ctx.head, "score.bias" in self.hf_names)
        if bad := convert.problems(self.lay):
            raise ValueError(f"megatron engine, role {ctx.role}: " + "; ".join(bad))
        dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
        pgc = process_groups(ctx)
        self.model = build_gpt(hf.config, pgc, self.tp, self.lay.padded_vocab, dtype, ctx.head,
                               self.lay.head_bias).to(ctx.device)
        freeze_padding_row(self.model, hf.get_input_embeddings().padding_idx)
        self.params = dict(self.model.named_parameters())
        with torch.no_grad():
            self._load_full({n: p.detach() for n, p in hf.named_parameters()})
        del hf
        self.state = Stashes({"params": TensorStash("params", self.model.parameters)})
        self.optimizer: torch.optim.Optimizer | None = None
        self.dist_opt: Any = None
        """megatron-core's DistributedOptimizer (engine_args.distributed_optimizer); ``self.optimizer``
        is then the torch AdamW inside it, stepping this rank's slices."""
        self.net: Any = self.model  # what the forward calls: the model, or its megatron-core DDP wrapper
        if ctx.trainable:
            self.model.train()
            a = ctx.algo
            if ctx.args.distributed_optimizer:
                self.net, self.dist_opt = megatron_optim.build(self.model, pgc, a, self.group, dtype)
                self.optimizer = self.dist_opt.optimizer
                dist_opt, buffers = self.dist_opt, self.net.buffers
                self.state.add("grads", TensorStash("grads", lambda: [b.grad_data for b in buffers]))
                self.state.add("optimizer", TensorStash("optimizer", lambda: megatron_optim.state_tensors(dist_opt)))
            else:
                self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=a.lr, weight_decay=a.weight_decay,
                                                   foreach=True)
                opt = self.optimizer
                self.state.add("grads", TensorStash("grads", lambda: grad_tensors(self.model)))
                self.state.add("optimizer", TensorStash("optimizer", lambda: optimizer_tensors(opt)))
            assert self.optimizer is not None
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, common.warmup(int(a.warmup_steps)))
        else:
            self.model.eval()

    # -- weights in and out -------------------------------------------------------------------
    def _load_full(self, hf: dict[str, torch.Tensor]) -> None:
        local = convert.to_megatron(hf, self.lay, self.tp_rank)
        if missing := sorted(set(self.params) ^ set(local)):
            raise RuntimeError(f"megatron engine: GPTModel and the HF mapping disagree on {missing}")
        for name, p in self.params.items():
            p.copy_(local[name])

    def _gather(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full HF-named tensors from this rank's GPTModel-shaped tensors (collective over tp)."""
        shards: dict[str, list[torch.Tensor]] = {}
        for name, t in local.items():
            t = t.detach().contiguous()
            if self.tp == 1:
                shards[name] = [t]
                continue
            parts = [torch.empty_like(t) for _ in range(self.tp)]
            dist.all_gather(parts, t, group=self.tp_group)
            shards[name] = parts
        return convert.to_hf(shards, self.lay)

    @contextmanager
    def export_weights(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Every weight in full under its Hugging Face name (gathered over tp), in the HF model's order."""
        with torch.no_grad():
            full = self._gather(self.params)
            yield [(n, full[n]) for n in self.hf_names]

    # -- forward ------------------------------------------------------------------------------
    def _chunks(self, samples: list[Sample]) -> list[list[Sample]]:
        size = self.micro_batch or len(samples)
        return [samples[i : i + size] for i in range(0, len(samples), size)]

    def _pack(self, chunk: list[Sample]) -> Packed:
        return pack(chunk, self.tokenizer.pad_token_id, self.device, share_prompts=False)

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, L, V] logits (or [B, L, 1] of a scalar head) at every position of right-padded
        sequences: the causal mask alone keeps pads out of every real position."""
        pos = torch.arange(ids.shape[1], device=ids.device)[None, :].expand_as(ids)
        out = self.net(input_ids=ids, position_ids=pos, attention_mask=None)
        return out[..., : self.lay.vocab] if self.head == "lm" else out

    def _logits(self, b: Packed) -> torch.Tensor:
        """[B, R, V] logits (or [B, R, 1] of a scalar head) at the positions that score each response token."""
        x = b.inputs
        assert isinstance(x, Full)
        out = self._forward(x.input_ids)
        return out.gather(1, x.index[:, :, None].expand(-1, -1, out.shape[-1]))

    @torch.no_grad()
    def logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for chunk in self._chunks(samples):
            b = self._pack(chunk)
            out += unpack(algos.token_logprobs(self._logits(b).float(), b.targets), b.lengths)
        return out

    @torch.no_grad()
    def values(self, samples: list[Sample]) -> list[torch.Tensor]:
        """Per-sample response-token values of the value head (the critic)."""
        out: list[torch.Tensor] = []
        for chunk in self._chunks(samples):
            b = self._pack(chunk)
            out += unpack(self._logits(b)[..., 0].float(), b.lengths)
        return out

    @torch.no_grad()
    def scores(self, samples: list[Sample]) -> list[float]:
        """One score per sample from the reward head, read at the sequence's rightmost token that is not
        the model's pad token (transformers' sequence-classification pooling; the last position
        when the model names no pad token)."""
        out: list[float] = []
        for chunk in self._chunks(samples):
            x = self._pack(chunk).inputs
            assert isinstance(x, Full)
            ids = x.input_ids
            per_token = self._forward(ids)[..., 0].float()
            if self.pad_id is None:
                last = torch.full((ids.shape[0],), ids.shape[1] - 1, device=ids.device)
            else:
                cols = torch.arange(ids.shape[1], device=ids.device)
                last = (cols * (ids != self.pad_id)).argmax(-1)
            out += per_token[torch.arange(ids.shape[0], device=ids.device), last].tolist()
        return out

    # -- training -----------------------------------------------------------------------------
    def _loss(self, chunk: list[Sample], objective: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """The objective on one micro-batch: the policy's on log-probs, or the value objective
        (``head == "value"``) on the value head's output."""
        b = self._pack(chunk)
        if objective.head == "value":
            return objective(ValueInput(self._logits(b)[..., 0].float(), b.mask, b.fields))
        logits = self._logits(b).float()
        logp = algos.token_logprobs(logits, b.targets)
        return objective(LossInput(logp, b.mask, b.token_advantages(), b.fields,
                                   logits if objective.needs_logits else None))

    def _reduce_grads(self) -> None:
        """Average gradients over dp (each dp rank's loss is the mean over its own share)."""
        if dist.get_world_size(self.dp_group) == 1:
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= dist.get_world_size(self.dp_group)
        torch._foreach_copy_(grads, [c.view_as(g) for c, g in zip(flat.split([g.numel() for g in grads]), grads,
                                                                    strict=True)])

    def _clip(self, max_norm: float) -> float:
        """Clip by the global norm: TP-split weights count each shard, replicated ones (norms) once."""
        split = [p.grad for p in self.model.parameters() if p.grad is not None and getattr(p, "tensor_model_parallel", False)]
        repl = [p.grad for p in self.model.parameters() if p.grad is not None and not getattr(p, "tensor_model_parallel", False)]
        sq = torch.stack([g.float().pow(2).sum() for g in split]).sum() if split else torch.zeros(())
        if self.tp > 1:
            dist.all_reduce(sq, group=self.tp_group)
        if repl:
            sq = sq + torch.stack([g.float().pow(2).sum() for g in repl]).sum()
        norm = sq.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(split + repl, coef)
        return float(norm)

    def train(self, samples: list[Sample], objective: Any) -> dict[str, float]:
        """Mini-batches x epochs of updates minimising ``objective`` over this replica's share (the tp
        peers of a replica receive the same samples)."""
        assert self.optimizer is not None, "train() on a forward-only engine"
        a = self.algo
        totals = common.Totals(a.grad_accum)
        for micro_batches in common.updates(samples, a, objective):
            if self.dist_opt is not None:
                self.net.zero_grad_buffer()
                self.dist_opt.zero_grad()
            else:
                self.optimizer.zero_grad(set_to_none=False)
            for chunk in micro_batches:
                loss, stats = self._loss(chunk, objective)
                (loss / a.grad_accum).backward()
                totals.add(stats)
            if self.dist_opt is not None:
                self.net.finish_grad_sync()  # reduce-scatter: each dp rank gets the averaged gradients of its slices
                _, norm, _ = self.dist_opt.step()  # clips by the global norm, steps its slices, all-gathers the weights
                if a.grad_clip > 0:
                    totals.add({"grad_norm": float(norm)}, 1.0)
            else:
                self._reduce_grads()
                if a.grad_clip > 0:
                    totals.add({"grad_norm": self._clip(a.grad_clip)}, 1.0)
                self.optimizer.step()
            self.scheduler.step()
            totals.updates += 1
        return totals.result(float(self.scheduler.get_last_lr()[0]))

    # -- checkpoint ---------------------------------------------------------------------------
    def checkpoint_state(self) -> CheckpointState | None:
        """Weights and AdamW state as full HF-named plain tensors (``model.<hf>``, ``optim.<hf>.<key>``),
        the layout the fsdp engine's checkpoints have once resharded, so either loads the other's.
        Every rank of the role holds the same tensors; DCP writes each once."""
        if self.optimizer is None:
            return None
        with torch.no_grad():
            by_param = {p: n for n, p in self.params.items()}
            state = self.optimizer.state
            if self.dist_opt is not None:  # the fp32 main weights and moments, from every dp rank's slices
                full = megatron_optim.gather(self.net, self.dist_opt, self.dp_group)
                local = {key: {by_param[p]: full[p][key] for p in self.params.values()} for key in megatron_optim.STATE_KEYS}
            else:
                local = {"param": self.params} | {
                    key: {by_param[p]: state[p][key] if key in state.get(p, {}) else torch.zeros_like(p)
                          for p in self.params.values()} for key in ADAM_KEYS}
            tensors = {f"model.{n}": t.clone() for n, t in self._gather(local["param"]).items()}
            if self.lay.tied:  # a transformers state dict names the shared matrix twice
                tensors["model.lm_head.weight"] = tensors["model.model.embed_tokens.weight"]
            for key in ADAM_KEYS:
                tensors.update({f"optim.{n}.{key}": t.clone() for n, t in self._gather(local[key]).items()})
            step = next((s["step"] for s in state.values() if "step" in s), torch.zeros((), dtype=torch.float32))
            tensors.update({f"optim.{n}.step": step.detach().clone().float() for n in self.hf_names})
        group = self.optimizer.param_groups[0]
        meta = {"engine": "megatron", "param_groups": [{**{k: v for k, v in group.items()
                                                            if k != "params" and k not in MEGATRON_GROUP_KEYS},
                                                         "params": list(self.hf_names)}],
                "scheduler": self.scheduler.state_dict()}
        return CheckpointState(tensors, meta, self.group)

    def load_checkpoint_state(self, state: CheckpointState) -> None:
        assert self.optimizer is not None, "load_checkpoint_state on a forward-only engine"
        t = state.tensors
        with torch.no_grad():
            self._load_full({n: t[f"model.{n}"] for n in self.hf_names})
            moments = {key: convert.to_megatron({n: t[f"optim.{n}.{key}"] for n in self.hf_names}, self.lay,
                                                self.tp_rank) for key in ADAM_KEYS}
            step = t[f"optim.{self.hf_names[0]}.step"]
            if self.dist_opt is not None:
                main = convert.to_megatron({n: t[f"model.{n}"] for n in self.hf_names}, self.lay, self.tp_rank)
                megatron_optim.scatter(self.dist_opt, {p: {"param": main[name], **{k: moments[k][name] for k in ADAM_KEYS}}
                                                       for name, p in self.params.items()}, step)
            else:
                for name, p in self.params.items():
                    self.optimizer.state[p] = {"step": step.detach().clone().float().reshape(()),
                                               **{k: moments[k][name].clone().to(p.device) for k in ADAM_KEYS}}
        saved = state.meta["param_groups"][0]
        for group in self.optimizer.param_groups:
            group.update({k: v for k, v in saved.items() if k != "params"})
        if state.meta.get("scheduler") is not None:
            self.scheduler.load_state_dict(state.meta["scheduler"])
