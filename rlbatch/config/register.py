"""Register the schema with Hydra's ConfigStore, so YAML in ``rlbatch/conf/`` is type-checked against it."""

from __future__ import annotations

import dataclasses
from typing import Any

from hydra.core.config_store import ConfigStore

from rlbatch.config.schema import RLBatchConfig, default_roles

SCHEMA_NAME = "rlbatch_schema"


def _plain_roles() -> dict[str, Any]:
    return {name: dataclasses.asdict(rc) for name, rc in default_roles().items()}


HydraConfig = dataclasses.make_dataclass(
    "HydraConfig", [("roles", dict[str, Any], dataclasses.field(default_factory=_plain_roles)),
                    ("hardware", dict[str, Any], dataclasses.field(default_factory=dict))], bases=(RLBatchConfig,))
"""The schema as Hydra composes it: roles as plain mappings, so a command line may add a role of
any name (``+roles.code_sandbox.world_size=8``), and the hardware section as the fields of its
profile (``hardware=h100_sxm``) or, without one, an empty mapping that ``+hardware.<field>=<value>``
adds to; ``rlbatch.config.parse`` types and checks them with the rest."""


def register() -> None:
    """Store the schema as ``rlbatch_schema``; ``rlbatch/conf/config.yaml`` lists it first in its defaults."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=HydraConfig)
