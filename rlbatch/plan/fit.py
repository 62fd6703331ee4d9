"""The prediction of one validated configuration: what ``python -m rlbatch.plan predict`` prints
and what ``check(cfg)`` refuses at launch when the config names a hardware profile.

``predict_config(cfg, placement, hw)`` runs the planner on a validated config; the profile of the
config's ``hardware`` section is ``cfg.hardware.profile`` (``rlbatch.config.hardware_section``).
"""

from __future__ import annotations

from rlbatch.config.hardware import Hardware
from rlbatch.config.schema import RLBatchConfig
from rlbatch.models.shape import shape_from_config
from rlbatch.placement import Placement
from rlbatch.plan.coefficients import Coefficients
from rlbatch.plan.layout import from_placement
from rlbatch.plan.predict import Prediction, predict
from rlbatch.plan.workload import workload_from_config


def mem_limit(cfg: RLBatchConfig) -> float | None:
    """cluster.mem_gb in bytes: the node memory a job may use, when the config limits it."""
    gb = cfg.cluster.mem_gb
    return float(gb) * 1e9 if gb else None


def predict_config(cfg: RLBatchConfig, placement: Placement, hw: Hardware, prompt_len: float | None = None,
                   response_mean: float | None = None, coef: Coefficients | None = None,
                   overlap: bool = False, zero_variance_frac: float | None = None,
                   **episodes: float | None) -> Prediction:
    """The planner's prediction for ``cfg`` placed as ``placement``; ``episodes``: a multi-turn
    rollout's turns, observation_len and env_step_s (``workload_from_config``)."""
    layout = from_placement(placement, cfg.cluster.cpus_per_task)
    shape = shape_from_config(cfg.model)
    w = workload_from_config(cfg, prompt_len, response_mean, zero_variance_frac, **episodes)
    return predict(layout, shape, w, hw, cfg.model.dtype, coef, mem_limit(cfg), overlap)
