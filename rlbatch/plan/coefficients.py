"""Per phase kind, the weight of each time feature: priors, or what calibration fitted.

A phase's predicted seconds are ``sum(coef[kind][f] * features[f])``. Seconds-valued features
(roofline, overhead, comm, transfer, samples: host work per sample, workers: the controller's
messages and wake-ups for the ranks it commands) have prior weight 1: the hardware profile's
numbers are taken at face value. Count-valued features (fixed: 1 per phase; transitions: state
kinds moved; env_calls: round trips to env workers) have priors in seconds, measured on the cpu profile's VM or guessed, until a run is
calibrated.

Saved as YAML by ``python -m rlbatch.plan calibrate`` and read by ``--profile FILE``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlbatch.errors import ConfigError

KINDS = ("generate", "reward", "logprobs", "train", "sync", "offload", "reload", "step")
FEATURES = ("roofline", "overhead", "comm", "transfer", "samples", "fixed", "workers", "transitions", "env",
            "env_calls")
PRIORS: dict[str, float] = {
    "roofline": 1.0, "overhead": 1.0, "comm": 1.0, "transfer": 1.0, "samples": 1.0, "workers": 1.0,
    # The controller's part of a phase beyond the ranks' own work that does not depend on how many
    # ranks it commands (timing.command charges those): the controller's phase time minus the
    # ranks' time in their handlers, on the cpu profile's VM, came to about 2 ms plus 2.5 ms per rank.
    "fixed": 2e-3,
    "transitions": 1e-3,  # allocating or freeing one kind of state on the device (guess)
    "env": 1.0,  # seconds of environment steps on a trajectory's critical path, beyond its generation
    # One round trip to an env worker (the env role), sent and received on the inference rank: its
    # pickled request and reply and the receiver's poll. experiment=multiturn on the cpu profile's VM
    # generated 1024 trajectories a step (512 per inference rank, 4 round trips each) in 1.9-2.6 s
    # with 2 env workers against 0.9-1.6 s with the envs on the ranks' threads: ~1 s / 2048.
    "env_calls": 5e-4,
}
STEP_FIXED_PRIOR = 5e-3
"""Controller work between phases per step: batching prompts, advantages, metrics (guess)."""


def prior(kind: str, feature: str) -> float:
    if kind == "step":
        return STEP_FIXED_PRIOR if feature == "fixed" else 0.0
    return PRIORS[feature]


@dataclass
class Coefficients:
    """Fitted weights; anything missing falls back to its prior."""

    values: dict[str, dict[str, float]] = field(default_factory=dict)
    hardware: str = ""
    """The profile the fit was made against (a fit is only meaningful with the same one)."""
    source: list[str] = field(default_factory=list)
    """Run directories the fit came from."""

    def get(self, kind: str, feature: str) -> float:
        return self.values.get(kind, {}).get(feature, prior(kind, feature))

    def seconds(self, kind: str, features: dict[str, float]) -> float:
        return sum(self.get(kind, f) * v for f, v in features.items())

    def to_dict(self) -> dict[str, Any]:
        return {"hardware": self.hardware, "source": list(self.source),
                "coefficients": {k: dict(v) for k, v in self.values.items()}}

    def save(self, path: str | Path) -> None:
        import yaml

        header = "# Fitted by `python -m rlbatch.plan calibrate`; predicted seconds = sum(coef * feature).\n"
        Path(path).write_text(header + yaml.safe_dump(self.to_dict(), sort_keys=False))


def load_coefficients(path: str | Path) -> Coefficients:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--profile: {p} does not exist; make one with `python -m rlbatch.plan calibrate <run_dir>...`")
    data = yaml.safe_load(p.read_text()) or {}
    coefs = data.get("coefficients", {})
    bad = [f"{k}.{f}" for k, fs in coefs.items() for f in (fs or {}) if k not in KINDS or f not in FEATURES]
    if bad:
        raise ConfigError(f"--profile: {p} has unknown coefficients {bad}; kinds {list(KINDS)}, features {list(FEATURES)}")
    return Coefficients({k: {f: float(v) for f, v in (fs or {}).items()} for k, fs in coefs.items()},
                        str(data.get("hardware", "")), list(data.get("source", [])))
