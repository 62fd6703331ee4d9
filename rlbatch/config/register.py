"""Register the schema with Hydra's ConfigStore, so YAML in ``rlbatch/conf/`` is type-checked against it."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from rlbatch.config.schema import RLBatchConfig

SCHEMA_NAME = "rlbatch_schema"


def register() -> None:
    """Store the schema as ``rlbatch_schema``; ``rlbatch/conf/config.yaml`` lists it first in its defaults."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=RLBatchConfig)
