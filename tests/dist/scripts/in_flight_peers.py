"""Under mpiexec -n 3: rank 0 sends in-flight syncs to a worker of two tensor-parallel ranks (1, 2)
that step a generation in lockstep, the notice to rank 2 always 0.3 s after rank 1's. Both ranks
take each sync at the same engine step (``InFlightSync.agreed``): each checks for a notice before
every step, and a rank whose notice is late waits for it once its peer has one. (Alone, rank 1
would take each sync some 30 steps before rank 2 and stamp different versions on the same
tokens.)"""

import time
from types import SimpleNamespace

from mpi4py import MPI

from rlbatch.loop.weightsync import NOTICE_TAG, InFlightSync, SyncNotice

comm = MPI.COMM_WORLD
STEP_S = 0.01
VERSIONS = (5, 6)


def broadcast(world: SimpleNamespace, stream: object, infer: list[str], src: int, bucket_bytes: int) -> int:
    """The sync's broadcast, as the sync group runs it: here one object from rank ``src``."""
    got = world.comm.bcast(None, root=src)
    infer.append(got)
    return len(got)


if comm.rank == 0:
    for v in VERSIONS:
        time.sleep(0.2)
        comm.send(SyncNotice(v, 1024), dest=1, tag=NOTICE_TAG)
        time.sleep(0.3)
        comm.send(SyncNotice(v, 1024), dest=2, tag=NOTICE_TAG)
        comm.bcast(f"weights of version {v}", root=0)
    print("in-flight peers ok", flush=True)
else:
    world = SimpleNamespace(comm=comm, timeout_s=60.0)
    sync = InFlightSync(world, broadcast, 0, peers=(1, 2))  # type: ignore[arg-type]
    loaded: list[str] = []
    landed: list[tuple[int, int]] = []  # (engine step, version)
    step, after = 0, 0
    while after < 5:  # a few steps past the last sync: the same count on both ranks, they agree
        version = sync.poll(loaded)  # type: ignore[arg-type]
        if version is not None:
            landed.append((step, version))
        if landed and landed[-1][1] == VERSIONS[-1]:
            after += 1
        time.sleep(STEP_S)
        step += 1
    assert [v for _, v in landed] == list(VERSIONS), landed
    assert loaded == [f"weights of version {v}" for v in VERSIONS], loaded
    assert sync.peers is not None
    both = sync.peers.allgather(landed)
    assert both[0] == both[1], f"the worker's ranks took the syncs at different engine steps: {both}"
    assert list(sync.taken) == [(v, len(f"weights of version {v}")) for v in VERSIONS]
