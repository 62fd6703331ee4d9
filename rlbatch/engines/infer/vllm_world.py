"""A private torch.distributed world for an in-process vLLM engine, beside the program's world.

vLLM initialises torch.distributed itself, or, when a default process group already exists,
adopts it: its world group becomes the program's whole world and every group it creates
(``new_group``, collective over the default group) needs every rank of the job, controller and
CPU workers included, to take part. A role placed on some ranks only would hang at start-up.

A t=1 engine needs no peers, so it gets a world of its own: the program's default group is put
aside while vLLM starts (vLLM then creates a one-rank gloo/NCCL world and its groups inside it),
and each later call into vLLM runs with vLLM's default group in place. Process-group names come
from one counter shared by both worlds, so they never collide. The program's groups are
untouched and keep working between the calls (tests/unit/test_vllm_engine.py checks both).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed.distributed_c10d as c10d


class PrivateWorld:
    """Swaps torch.distributed's default process group between the program's and vLLM's."""

    def __init__(self) -> None:
        self.default_pg: Any = None
        self.backend: Any = None
        self.init_method: Any = None

    @contextmanager
    def active(self) -> Iterator[None]:
        """Inside: torch.distributed's default group is vLLM's (none before vLLM starts)."""
        saved = (c10d._world.default_pg, c10d._backend, c10d._default_pg_init_method)
        c10d._world.default_pg = self.default_pg
        c10d._backend, c10d._default_pg_init_method = self.backend, self.init_method
        try:
            yield
        finally:
            self.default_pg = c10d._world.default_pg
            self.backend, self.init_method = c10d._backend, c10d._default_pg_init_method
            c10d._world.default_pg = saved[0]
            c10d._backend, c10d._default_pg_init_method = saved[1], saved[2]
