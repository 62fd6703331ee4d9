"""Stand-ins for the MPI objects the controller touches (a sent request, a received message), for
the tests that give the controller a communicator of their own."""

from __future__ import annotations

from mpi4py import MPI


class Sent:
    """A request from ``isend``: already complete."""

    def wait(self) -> None:
        pass


class Message:
    """A matched message (``mprobe``): its object and the rank it came from."""

    def __init__(self, obj: object, source: int) -> None:
        self.obj, self.source = obj, source

    def recv(self, status: MPI.Status | None = None) -> object:
        if status is not None:
            status.Set_source(self.source)
        return self.obj
