"""A private torch.distributed world for an in-process vLLM engine, beside the program's world.

vLLM initialises torch.distributed itself, or, when a default process group already exists,
adopts it: its world group becomes the program's whole world and every group it creates
(``new_group``, collective over the default group) needs every rank of the job, controller and
CPU workers included, to take part. A role placed on some ranks only would hang at start-up.

So each vLLM worker gets a world of its own, of its t tensor-parallel peers only:

- t=1: the program's default group is put aside while vLLM starts; vLLM then creates a one-rank
  world and its groups inside it.
- t>1: ``join`` creates the private default group on the t peers before vLLM starts, over the
  program's store under a prefix of this worker's own (no new port, no extra rendezvous); vLLM
  (``external_launcher``) adopts it and creates its tp/pp groups inside it.

Each later call into vLLM runs with the private default group in place. Group names come from
a counter of the private world's own, the same on every peer (the rendezvous keys of a group
are its name under the default store's prefix) and far from the program's counter, so names
never collide in torch's one set of tables. The program's groups are untouched and keep working
between the calls (tests/unit/test_vllm_engine.py, tests/dist/scripts/vllm_tp.py).
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import itertools
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

GROUP_NAME_BASE = 1_000_000
"""Private worlds name their groups from here on (the program's counter starts at 0)."""
GROUP_NAME_SPAN = 10_000
"""Group names reserved for each private world of a process."""
_instances = itertools.count()


class PrivateWorld:
    """Swaps torch.distributed's default process group (and group-name counter) between the
    program's and vLLM's. Peers must create their PrivateWorlds in the same order (every rank
    builds its engines in placement order), so their group names agree."""

    def __init__(self) -> None:
        self.default_pg: ProcessGroup | None = None
        self.backend: str | None = None
        self.init_method: str | None = None
        self.group_count = GROUP_NAME_BASE + GROUP_NAME_SPAN * next(_instances)

    def join(self, key: str, rank: int, size: int, backend: str, timeout_s: float) -> None:
        """Create the private default group of ``size`` ranks (this process is ``rank``) over the
        program's store, under the prefix ``key`` that the peers share and nobody else uses.
        Collective over the peers; call before vLLM starts."""
        store = dist.PrefixStore(f"{key}/", c10d._get_default_store())
        with self.active():
            dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                    timeout=datetime.timedelta(seconds=timeout_s))

    @contextmanager
    def active(self) -> Iterator[None]:
        """Inside: torch.distributed's default group is vLLM's (none before vLLM starts)."""
        w = c10d._world
        saved = (w.default_pg, c10d._backend, c10d._default_pg_init_method, w.group_count)
        w.default_pg, w.group_count = self.default_pg, self.group_count
        c10d._backend, c10d._default_pg_init_method = self.backend, self.init_method
        try:
            yield
        finally:
            self.default_pg, self.group_count = w.default_pg, w.group_count
            self.backend, self.init_method = c10d._backend, c10d._default_pg_init_method
            w.default_pg, w.group_count = saved[0], saved[3]
            c10d._backend, c10d._default_pg_init_method = saved[1], saved[2]


SHM_DIR = "/dev/shm"


@contextmanager
def private_shm_names(private: bool) -> Iterator[None]:
    """Around vLLM's start-up on CPU, with a private world of t>1 peers active (collective over
    them, gloo; on a GPU vLLM does not use this communicator, and the engine does not call this).

    vLLM's CPU build, on AVX-512 machines, runs tensor-parallel collectives through shared memory:
    segments named ``{VLLM_DIST_IDENT}-{group}-[{ranks}]-cpushm_{i}``, where the identity comes from
    the init method, which under ``external_launcher`` is always ``env://``. Every t>1 worker on a
    node would then ask for the same names: a second worker on the node (``vllm:d2t2`` on 4 ranks)
    fails at start-up with ``create shm in SHMManager failed. errno: 17`` (EEXIST), and so does the
    next job on a node where a job left its segments behind (vLLM unlinks them in a destructor that
    a process ending with ``os._exit`` never runs).

    Inside the block the identity is one the peers draw together (tp rank 0's random token), so
    every worker's names are its own. After vLLM started, every peer has mapped the segments
    (vLLM's barrier after joining them), so tp rank 0 unlinks their names: the memory lives until
    the last peer exits, however it exits, and nothing is left in /dev/shm."""
    if not private:
        yield
        return
    from vllm.distributed.device_communicators import cpu_communicator

    token = [uuid.uuid4().hex[:16] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    ident = f"rlbatch-{token[0]}"
    shm = cpu_communicator._CPUSHMDistributed
    name = shm.make_group_name

    def named(communicator: CpuCommunicator) -> str:
        os.environ["VLLM_DIST_IDENT"] = ident  # read by vLLM's own naming, just below
        return name(communicator)

    shm.make_group_name = staticmethod(named)  # type: ignore[method-assign]
    try:
        yield
    finally:
        shm.make_group_name = staticmethod(name)  # type: ignore[method-assign]
        if dist.get_rank() == 0:
            for path in glob.glob(os.path.join(SHM_DIR, glob.escape(ident) + "-*")):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
