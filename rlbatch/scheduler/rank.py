"""A rank's side of the pipeline: its engines, its samples, and one handler per phase.

The controller sends ``phase`` commands; each carries the data moves this rank takes part in
and, when this rank works in the phase, the work itself. Moves happen first (rank to rank over
the data plane), then the phase runs inside a residency switch that offloads colocated roles.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlbatch import algos
from rlbatch.config.schema import TRAINABLE_ROLES
from rlbatch.engines.base import SamplingParams, engine_class
from rlbatch.engines.model import load_tokenizer, model_dtype
from rlbatch.runtime import heap
from rlbatch.runtime.dataplane import Move, SampleStore, exchange
from rlbatch.runtime.faults import maybe_fault
from rlbatch.runtime.world import SYNC, World
from rlbatch.scheduler.residency import Residency
from rlbatch.scheduler.weightsync import WeightBroadcast

log = logging.getLogger(__name__)
TRAIN, INFER, REFERENCE, REWARD = "actor_train", "actor_infer", "reference", "reward"


class RankRuntime:
    def __init__(self, world: World, cfg: Any) -> None:
        self.world, self.cfg = world, cfg
        self.store = SampleStore()
        self.tokenizer = load_tokenizer(cfg.model)
        self.engines: dict[str, Any] = {}
        p = world.placement
        for role, _ in world.slot.roles:
            rp = p.roles[role]
            if not rp.is_gpu:
                continue
            assert rp.backend is not None
            kwargs: dict[str, Any] = {
                "model_cfg": cfg.model, "tokenizer": self.tokenizer, "device": world.device, "seed": int(cfg.seed),
                "engine_args": dict(rp.engine_args), "algo": cfg.algo, "trainable": role in TRAINABLE_ROLES,
                "mesh": world.meshes.get(role),
            }
            self.engines[role] = engine_class(rp.engine)(**kwargs)
            log.info("built %s engine for %s", rp.engine, role)
        self.reward_fn = None
        if REWARD in world.roles and not p.roles[REWARD].is_gpu:
            from rlbatch.rewards.rules import load_reward_fn

            self.reward_fn = load_reward_fn(str(cfg.data.reward_fn))
        offload = {r: p.roles[r].offload for r in self.engines}
        self.residency = Residency(self.engines, offload, world.device)
        # Weights travel in the inference engine's dtype: every rank of the sync group derives it alike.
        self.broadcast = WeightBroadcast(model_dtype(str(cfg.model.dtype), world.device))

    def handlers(self) -> dict[str, Any]:
        return {"phase": self.phase, "ready": self.ready}

    def ready(self) -> None:
        """The engines are built: nothing long-lived is allocated after this."""
        frozen, secs = heap.settle()
        log.info("heap settled: %d objects frozen out of garbage collection in %.2fs", frozen, secs)

    def phase(self, phase: str, roles: tuple[str, ...], moves: list[Move], work: dict[str, Any] | None,
              drop: list[int] | None = None) -> dict[str, Any]:
        if drop:
            self.store.drop(drop)
        xfer = exchange(self.store, self.world.rank, moves, self._transport_device())
        if work is None:
            return {"xfer": xfer}
        with self.residency.phase(phase, roles) as rec:
            out = getattr(self, f"_{phase}")(**work)
        return {"out": out, "rec": rec.as_dict(), "xfer": xfer}

    def _transport_device(self) -> torch.device:
        # With NCCL every message buffer must be on the GPU; gloo takes CPU tensors.
        return self.world.device if dist.get_backend() != "gloo" and self.world.device.type == "cuda" else torch.device("cpu")

    def _generate(self, ids: list[int], prompts: list[str], sampling: dict[str, Any]) -> dict[int, tuple[int, int]]:
        unique = list(dict.fromkeys(prompts))  # a group's samples share their prompt: encode it once
        tokens = dict(zip(unique, self.tokenizer(unique)["input_ids"], strict=True))
        as_tensor = {text: torch.tensor(t, dtype=torch.long) for text, t in tokens.items()}
        responses = self.engines[INFER].generate([tokens[text] for text in prompts], SamplingParams(**sampling))
        out = {}
        for sid, text, resp in zip(ids, prompts, responses, strict=True):
            self.store.put(sid, "prompt", as_tensor[text])
            self.store.put(sid, "response", torch.tensor(resp, dtype=torch.long))
            out[sid] = (len(tokens[text]), len(resp))
        return out

    def _score(self, ids: list[int], answers: list[str]) -> dict[int, float]:
        assert self.reward_fn is not None
        out = {}
        for sid, answer in zip(ids, answers, strict=True):
            completion = self.tokenizer.decode(self.store.samples[sid]["response"].tolist(), skip_special_tokens=False)
            out[sid] = float(self.reward_fn(completion, answer))
        return out

    def _logprobs_into(self, role: str, ids: list[int], field: str) -> list[torch.Tensor]:
        samples = self.store.get(ids, ["prompt", "response"])
        values = self.engines[role].logprobs(samples) if ids else []
        for sid, v in zip(ids, values, strict=True):
            self.store.put(sid, field, v)
        return values

    def _ref_logprobs(self, ids: list[int]) -> dict[int, int]:
        values = self._logprobs_into(REFERENCE, ids, "ref_logprobs")
        return {sid: len(v) for sid, v in zip(ids, values, strict=True)}

    def _old_logprobs(self, ids: list[int], kl_estimator: str | None = None) -> dict[int, float]:
        """Log-probs of the policy before this step's updates; with kl_estimator, per-sample KL sums."""
        values = self._logprobs_into(TRAIN, ids, "old_logprobs")
        if kl_estimator is None:
            return {sid: 0.0 for sid in ids}
        out = {}
        for sid, logp in zip(ids, values, strict=True):
            ref = self.store.samples[sid]["ref_logprobs"]
            out[sid] = float(algos.kl_penalty(logp, ref, kl_estimator).sum())  # type: ignore[arg-type]
        return out

    def _train(self, ids: list[int], advantages: list[float]) -> dict[str, float]:
        for sid, adv in zip(ids, advantages, strict=True):
            self.store.put(sid, "advantage", torch.tensor(adv))
        samples = self.store.get(ids, ["prompt", "response", "old_logprobs", "ref_logprobs", "advantage"])
        return self.engines[TRAIN].train(samples)

    def _checkpoint(self, op: str, path: str) -> dict[str, float]:
        """Write (op=save, into the staging dir) or read (op=load) this rank's part of a checkpoint."""
        from rlbatch.checkpoint.rank import load_rank, save_rank

        if op == "load":
            return load_rank(Path(path), self.engines, self.world.rank)
        out = save_rank(Path(path), self.engines, self.world.rank)
        maybe_fault("checkpoint", self.world.rank)
        return out

    def _sync(self, src: int, local: bool, bucket_bytes: int) -> dict[str, float]:
        """actor_train -> actor_infer. Colocated: in-process copy; otherwise bucketed broadcast."""
        train, infer = self.engines.get(TRAIN), self.engines.get(INFER)
        with train.full_weights() if train is not None else nullcontext([]) as named:  # collective over actor_train
            if local:
                return {"bytes": float(infer.load_weights(named)) if infer is not None else 0.0}
            if self.world.rank not in self.world.members[SYNC]:
                return {"bytes": 0.0}
            return {"bytes": float(self.broadcast(self.world, named, infer, src, bucket_bytes))}

