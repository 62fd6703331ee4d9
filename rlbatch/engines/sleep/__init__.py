"""The ``sleep`` engines: no model, a modelled time per call and sized payloads, for measuring
what rlbatch itself costs at scale (``tools/bench/scale.py``). Plugged in like any engine from
outside: ``plugins=[rlbatch.engines.sleep]``, then ``roles.actor_infer.backend=sleep:d<N>`` and
``roles.actor_train.backend=sleep_train:d<N>`` (the reference inherits the trainer's).

``sleep`` (inference): every response is ``response_tokens`` tokens, the last EOS, each with
log-prob 0, after ``seconds`` per generate call. ``sleep_train`` (training and forward-only roles):
log-probs of zeros (one per response token) after ``seconds`` per call, a training batch that
sleeps ``seconds`` and changes nothing, and ``weight_elems`` float weights to sync.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlbatch.engines.registry import EngineKind, EngineSpec, register


@dataclass(frozen=True)
class SleepArgs:
    """engine_args of the ``sleep`` inference engine."""

    seconds: float = 0.0
    """Modelled time of one generate call."""
    response_tokens: int = 16
    """Tokens of every response (the last one EOS)."""

    def __post_init__(self) -> None:
        if self.response_tokens < 1:
            raise ValueError(f"response_tokens: {self.response_tokens} < 1 (a response holds at least its EOS)")


@dataclass(frozen=True)
class SleepTrainArgs:
    """engine_args of the ``sleep_train`` training engine."""

    seconds: float = 0.0
    """Modelled time of one log-probs or training call."""
    weight_elems: int = 1024
    """float32 elements of the weights it exports to the inference engines at each sync."""


# Neither runs a collective: colocated, a run of them starts no torch.distributed world.
register(EngineSpec("sleep", EngineKind.INFER, SleepArgs, f"{__name__}.engine:SleepInferenceEngine", dims="d",
                    needs_torch_world=False))
register(EngineSpec("sleep_train", EngineKind.TRAIN, SleepTrainArgs, f"{__name__}.engine:SleepTrainEngine", dims="d",
                    needs_torch_world=False))
