"""How every script under mpiexec ends (``from mpi_exit import end_script``)."""

import os
import sys
from typing import Any

from mpi4py import MPI

from rlbatch.runtime.world import teardown


def end_script(comm: Any) -> None:
    """Tear down together, finalize MPI and exit without running interpreter finalization.

    Process groups, meshes and FSDP modules held in module globals are otherwise destroyed in
    arbitrary order at exit, and a gloo thread still joinable then aborts the process
    ("terminate called without an active exception")."""
    teardown(comm)
    sys.stdout.flush()
    sys.stderr.flush()
    MPI.Finalize()
    os._exit(0)
