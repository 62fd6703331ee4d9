"""The trackers this build has, by their section under ``trackers`` in the config (one a field of
``TrackersConfig``)."""

from __future__ import annotations

from rlbatch.trackers import mlflow_run, wandb_run
from rlbatch.trackers.base import TRACKERS, TrackerSpec, register

__all__ = ["TRACKERS"]

register(TrackerSpec("wandb", "rlbatch.trackers.wandb_run:WandbTracker", lambda t: t.wandb, wandb_run.problems,
                     package="wandb", install="pip install 'rlbatch[trackers]' (or: pip install wandb)"))
register(TrackerSpec("mlflow", "rlbatch.trackers.mlflow_run:MlflowTracker", lambda t: t.mlflow, mlflow_run.problems,
                     package="mlflow", install="pip install 'rlbatch[trackers]' (or: pip install mlflow-skinny)",
                     machine_problems=mlflow_run.store_problems))
