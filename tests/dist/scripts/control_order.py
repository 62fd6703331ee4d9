"""Under mpiexec -n 3: calls in flight at once are waited for in any order, and each gets its
own replies (a rank answers in the order it was sent commands)."""

import time

from mpi4py import MPI

from rlbatch.runtime.control import Controller, serve

comm = MPI.COMM_WORLD
if comm.rank == 0:
    ctl = Controller(comm, timeout_s=30)
    first = ctl.send([1, 2], "echo", tag="first", pause=0.2)
    second = ctl.send([1], "echo", tag="second", pause=0.0)
    third = ctl.send([2], "echo", tag="third", pause=0.0)
    assert third.wait() == {2: ("third", 2)}
    assert second.wait() == {1: ("second", 1)}
    assert first.wait() == {1: ("first", 1), 2: ("first", 2)}
    assert ctl.call([1, 2], "echo", tag="fourth", pause=0.0) == {1: ("fourth", 1), 2: ("fourth", 2)}
    ctl.shutdown([1, 2])
    print("control order ok", flush=True)
else:
    def echo(tag: str, pause: float) -> tuple[str, int]:
        time.sleep(pause)
        return tag, comm.rank

    serve(comm, 0, {"echo": echo})
