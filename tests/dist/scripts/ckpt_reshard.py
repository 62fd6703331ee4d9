"""Under mpiexec -n <any>: load a committed checkpoint (written by another number of ranks) into
this layout; the unsharded model and optimizer state equal the reference, and training goes on.

    mpiexec -n 1 python tests/dist/scripts/ckpt_reshard.py <port> <run_or_ckpt_dir> <ref.pt> <step>
"""

import sys
from pathlib import Path

import torch
from ckpt_common import assert_same, build, comm, full_state, init, train_step
from mpi_exit import end_script
from omegaconf import OmegaConf

from rlbatch.checkpoint import open_checkpoint
from rlbatch.checkpoint.engine_state import load_rank
from rlbatch.checkpoint.files import CONFIG

mesh = init()
ck = open_checkpoint(Path(sys.argv[2]))
assert ck.step == int(sys.argv[4]), (ck.path, ck.step)
e = build(mesh, OmegaConf.load(ck.path / CONFIG), seed=777)
load_rank(ck.path, {"actor_train": e}, comm.rank)
state = full_state(e)
if comm.rank == 0:
    assert_same(torch.load(sys.argv[3], weights_only=True), state, f"{comm.size}-rank load of {ck.path.name}")
train_step(e)
print(f"rank {comm.rank}: reshard ok ({comm.size} ranks, {ck.path.name})", flush=True)
end_script(comm)
