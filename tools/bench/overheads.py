"""What rlbatch's mechanisms cost over the raw operation they wrap, measured in one run.

    python tools/bench/overheads.py [--ranks 4] [--mb 64] [--iters 20]

Starts itself under mpiexec (the mpich wheel's) with --ranks processes on this machine and
prints, each as a ratio (ours / raw, lower is better, 1.00 = no overhead):
  control plane   Controller.call round trip to every rank   vs  MPI barrier
                  (and its floor: bare blocking pickled send/recv to every rank, vs the barrier)
  data plane      exchange() of a sample payload rank 0 -> 1  vs  raw torch.distributed send/recv
                                                              and raw broadcast of the same bytes
  offload+reload  TensorStash round trip of --mb MB           vs  raw copy of the same bytes there and back
  weight sync     WeightBroadcast of --mb MB to all ranks     vs  raw dist.broadcast of the same bytes
Medians over --iters repetitions after warm-up. On CPU, "device" memory is host memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def _median_time(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from rlbatch.engines.offload import TensorStash
    from rlbatch.runtime.control import Controller, serve
    from rlbatch.runtime.dataplane import Move, SampleStore, exchange

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    port = comm.bcast(29400 + os.getpid() % 1000 if rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    torch.set_num_threads(1)
    controller = size - 1
    results: dict[str, tuple[float, float]] = {}

    # control plane: the controller's command round trip vs a barrier over the same processes
    if rank == controller:
        ctl = Controller(comm, timeout_s=60)
        workers = list(range(size - 1))
        t_call = _median_time(lambda: ctl.call(workers, "noop"), args.iters * 5)
        ctl.shutdown(workers)
    else:
        serve(comm, controller, {"noop": lambda: None})
        t_call = 0.0
    t_barrier = _median_time(comm.Barrier, args.iters * 5)
    results["control plane round trip"] = (t_call, t_barrier)
    # The floor any Python control plane over mpi4py starts from: the same round trip with bare
    # blocking pickled send/recv (no timeout, no reply matching, MPI's own spinning waits).
    if rank == controller:
        def bare() -> None:
            for r in workers:
                comm.send(("noop", {}), dest=r, tag=21)
            for r in workers:
                comm.recv(source=r, tag=22)
        t_bare = _median_time(bare, args.iters * 5)
        for r in workers:
            comm.send(None, dest=r, tag=21)
    else:
        while comm.recv(source=controller, tag=21) is not None:
            comm.send(None, dest=controller, tag=22)
        t_bare = 0.0
    results["control floor: bare send/recv"] = (t_bare, t_barrier)

    # data plane: one sample of --mb MB worth of tokens from rank 0 to rank 1
    n = args.mb * (1 << 20) // 8
    store = SampleStore()
    if rank == 0:
        store.put(0, "response", torch.arange(n, dtype=torch.long))
    move = [Move(0, 1, [0], ["response"], [[n]])]

    def step() -> None:  # as a phase does: drop the samples done with, then exchange
        if rank == 1:
            store.drop([0])
        exchange(store, rank, move)

    t_ex = _median_time(step, args.iters)
    buf = torch.zeros(n, dtype=torch.float64)

    def raw_p2p() -> None:
        if rank == 0:
            dist.send(buf, dst=1)
        elif rank == 1:
            dist.recv(buf, src=0)

    t_p2p = _median_time(raw_p2p, args.iters)
    pair = dist.new_group([0, 1])
    t_bc2 = _median_time(lambda: dist.broadcast(buf, src=0, group=pair) if rank < 2 else None, args.iters)
    results["data plane vs send/recv"] = (t_ex, t_p2p)
    results["data plane vs broadcast"] = (t_ex, t_bc2)

    # offload + reload of --mb MB of state vs a raw copy of the same bytes out and back
    state = [torch.randn(args.mb * (1 << 20) // 4 // 8) for _ in range(8)]
    stash = TensorStash("bench", lambda: state)

    def roundtrip() -> None:
        stash.offload()
        stash.reload()

    host = [torch.empty_like(t) for t in state]

    def raw_copy() -> None:
        for h, t in zip(host, state, strict=True):
            h.copy_(t)
        for h, t in zip(host, state, strict=True):
            t.copy_(h)

    results["offload + reload"] = (_median_time(roundtrip, args.iters), _median_time(raw_copy, args.iters))

    # weight sync: bucketed broadcast of full weights into an inference engine's parameters (laid
    # out and loaded as the hf engine does it) vs one raw broadcast of the same bytes
    from types import SimpleNamespace

    from rlbatch.engines.base import WeightStream
    from rlbatch.engines.flat import flatten_parameters
    from rlbatch.engines.hf.engine import HFInferenceEngine
    from rlbatch.loop.weightsync import WeightBroadcast
    from rlbatch.runtime.world import SYNC

    class Infer:
        load_weights, weight_views = HFInferenceEngine.load_weights, HFInferenceEngine.weight_views

        def __init__(self) -> None:
            self.model = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(s), requires_grad=False) for s in shapes)
            flatten_parameters(self.model)
            self._params = {f"w{i}": p for i, p in enumerate(self.model)}

    shapes = [(1024, args.mb * 1024 // 4 // 16)] * 16
    named = [(f"w{i}", torch.randn(s)) for i, s in enumerate(shapes)]
    everyone = dist.new_group(list(range(size)))
    world = SimpleNamespace(rank=rank, device=torch.device("cpu"), groups={SYNC: everyone}, members={SYNC: tuple(range(size))},
                            check=lambda op, role, fn, *a, **k: fn(*a, **k))
    sync, infer = WeightBroadcast(), Infer()
    flat = torch.randn(sum(a * b for a, b in shapes))
    t_sync = _median_time(lambda: sync(world, WeightStream.of(named) if rank == 0 else None, infer, 0, 256 << 20), args.iters)
    t_raw = _median_time(lambda: dist.broadcast(flat, src=0, group=everyone), args.iters)
    results["weight sync"] = (t_sync, t_raw)

    # every figure is the slowest rank's (the ranks not taking part in a transfer report ~0)
    results = {k: (comm.allreduce(a, op=MPI.MAX), comm.allreduce(b, op=MPI.MAX)) for k, (a, b) in results.items()}
    if rank == controller:
        print(f"rlbatch overheads: {size} ranks on this machine (gloo, CPU), {args.mb} MB payloads, median of {args.iters}")
        for name, (ours, raw) in results.items():
            print(f"  {name:28s} ours {ours * 1e3:9.3f} ms   raw {raw * 1e3:9.3f} ms   ratio {ours / raw:5.2f}x")
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--mb", type=int, default=64)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [str(mpiexec), "-n", str(args.ranks), sys.executable, __file__, "--worker",
           "--mb", str(args.mb), "--iters", str(args.iters)]
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from rlbatch.runtime.env import CPU_DEVICE_ENV

    # The ranks run as rlbatch's launchers start them on a CPU "device" (gloo, CPU tensors).
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])) | CPU_DEVICE_ENV
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
