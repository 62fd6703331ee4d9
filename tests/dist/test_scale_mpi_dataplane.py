"""The data plane over MPI (``rlbatch.runtime.mpi_dataplane``, a run with no torch.distributed world)
moves the same samples as the torch.distributed plane, byte for byte: 3 real ranks (mpiexec) do
the same moves both ways, from the same stores, and compare what each received and the bytes
counted; later exchanges into stores that keep earlier samples too."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
FIELDS = ["prompt", "response", "ref_logprobs"]


def test_mpi_data_plane_moves_the_torch_planes_bytes() -> None:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    port = str(random.Random("mpi_dataplane").randrange(30000, 40000) + os.getpid() % 1000)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out = subprocess.run([str(mpiexec), "-n", "3", sys.executable, __file__, port], env=env, capture_output=True,
                         text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("same bytes") == 3, out.stdout[-2000:]


def _rank(port: int) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from rlbatch.runtime.dataplane import Move, SampleStore, exchange
    from rlbatch.runtime.world import teardown

    comm = MPI.COMM_WORLD
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)

    def sample(i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        p, r = 3 + i % 4, 1 + i % 5
        return {"prompt": torch.randint(0, 50000, (p,), generator=g),
                "response": torch.randint(0, 50000, (r,), generator=g), "ref_logprobs": -torch.rand(r, generator=g)}

    def lens(ids: list[int]) -> list[list[int]]:
        return [[len(sample(i)[f]) for f in FIELDS] for i in ids]

    owned = {0: [0, 1, 2, 3], 1: [4, 5], 2: []}
    stores = {"torch": SampleStore(), "mpi": SampleStore()}
    for store in stores.values():
        for i in owned[comm.rank]:
            for f, t in sample(i).items():
                store.put(i, f, t)
    rounds = [
        [Move(0, 2, [0, 2], FIELDS, lens([0, 2])), Move(1, 2, [5], FIELDS, lens([5])),
         Move(0, 1, [3], ["response"], [[len(sample(3)["response"])]]), Move(1, 0, [4], FIELDS, lens([4]))],
        [Move(0, 2, [1], FIELDS, lens([1])), Move(1, 2, [4], FIELDS, lens([4]))],
    ]
    for moves in rounds:
        by_torch = exchange(stores["torch"], comm.rank, moves)
        by_mpi = exchange(stores["mpi"], comm.rank, moves, comm, timeout_s=120)
        for key in ("bytes_sent", "bytes_received"):
            assert by_torch[key] == by_mpi[key], (comm.rank, key, by_torch, by_mpi)
    held = {name: store.samples for name, store in stores.items()}
    assert sorted(held["torch"]) == sorted(held["mpi"]) == {0: [0, 1, 2, 3, 4], 1: [3, 4, 5], 2: [0, 1, 2, 4, 5]}[comm.rank]
    for i, fields in held["torch"].items():
        assert sorted(fields) == sorted(held["mpi"][i]), (comm.rank, i)
        for f, t in fields.items():
            m = held["mpi"][i][f]
            assert isinstance(m, torch.Tensor) and m.dtype == t.dtype, (comm.rank, i, f, type(m))
            assert np.asarray(m).tobytes() == np.asarray(t).tobytes() == np.asarray(sample(i)[f]).tobytes(), (i, f)
    print(f"rank {comm.rank}: same bytes", flush=True)
    teardown(comm)
    sys.stdout.flush()
    MPI.Finalize()
    os._exit(0)


if __name__ == "__main__":
    _rank(int(sys.argv[1]))
