"""A run's saved ``config.yaml`` as the typed schema: what every rank and the controller run with.

The launcher validated and saved the composed config; each process reads it back here through the
one parser (``rlbatch.config.parse``) into ``RLBatchConfig`` (nested dataclasses, every field typed
and defaulted), so the runtime's signatures are typed and a misspelt attribute is a type error, not
a run-time surprise.
"""

from __future__ import annotations

from pathlib import Path

from rlbatch.config.parse import parsed
from rlbatch.config.schema import RLBatchConfig


def load_config(path: Path | str) -> RLBatchConfig:
    from omegaconf import OmegaConf

    return parsed(OmegaConf.to_container(OmegaConf.load(path), resolve=True))
