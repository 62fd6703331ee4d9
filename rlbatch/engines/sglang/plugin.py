"""rlbatch's SGLang plugin: the entry point ``rlbatch`` of group ``sglang.srt.plugins``
(pyproject.toml), which SGLang loads in each of its processes, its scheduler's included, when
rlbatch is installed. It gives SGLang's scheduler one more RPC, ``rlbatch_reseed(seed)``: the
sglang engine calls it (``Engine.collective_rpc``) before each generate call with the call's seed,
so the scheduler's sampler draws from RNGs seeded per call, as the vllm engine seeds its own
process's: a run resumed from a checkpoint samples what the uninterrupted run did. It adds a
method and changes nothing else of SGLang. With ``SGLANG_PLUGINS`` set (SGLang's whitelist), name
``rlbatch`` in it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler import Scheduler

RESEED = "rlbatch_reseed"
"""The scheduler method the plugin adds."""


def _reseed(scheduler: Scheduler, seed: int) -> None:
    from sglang.srt.utils import set_random_seed

    set_random_seed(int(seed) % 2**32)  # Python's, NumPy's (32-bit seeds) and torch's RNGs, CUDA's too on a GPU


def register() -> None:
    """SGLang calls this in each process at start-up (``sglang.srt.plugins.load_plugins``)."""
    from sglang.srt.managers.scheduler import Scheduler

    setattr(Scheduler, RESEED, _reseed)
