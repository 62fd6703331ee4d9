"""The planner: memory and time model of an rlbatch step, calibration, and placement search.

Pure Python and numpy, no torch: ``python -m rlbatch.plan`` answers on a login node, before
anything is submitted. See docs/planner.md.
"""

from rlbatch.config.hardware import Hardware, load_hardware
from rlbatch.models.shape import ModelShape, shape_from_config, shape_from_hf_config
from rlbatch.plan.layout import Layout, RoleLayout, from_placement
from rlbatch.plan.predict import Prediction, predict
from rlbatch.plan.workload import Workload, workload_from_config

__all__ = [
    "Hardware", "Layout", "ModelShape", "Prediction", "RoleLayout", "Workload", "from_placement", "load_hardware",
    "predict", "shape_from_config", "shape_from_hf_config", "workload_from_config",
]
