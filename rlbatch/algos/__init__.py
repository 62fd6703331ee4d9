"""Algorithms: pure policy-gradient math (``core``: GRPO advantages, PPO clip loss, KL estimators,
log-probs), the registries that name its parts (``registry``, torch-free), and the objective an
engine minimises (``objective``).

``rlbatch.algos.<function>`` reaches ``core``'s functions; it is resolved on first use, so
importing the torch-free registries does not import torch.
"""

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    core = importlib.import_module("rlbatch.algos.core")  # not `from rlbatch.algos import core`: that asks this hook
    try:
        return getattr(core, name)
    except AttributeError:
        raise AttributeError(f"module 'rlbatch.algos' has no attribute {name!r}") from None
