"""Under mpiexec -n 2: commit a checkpoint at step 2, then SIGKILL rank 1 in the middle of
writing step 3 (its shard half written, no DCP metadata, no commit). Run by test_checkpoint.py,
which then checks that step 2 is still the newest complete checkpoint and loads exactly.

    mpiexec -n 2 python tests/dist/scripts/ckpt_kill.py <port> <out_dir>
"""

import os
import signal
import sys
from pathlib import Path

import torch
from ckpt_common import build, comm, full_state, init, seed_all, train_step, write_config
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from rlbatch.checkpoint import CheckpointStore
from rlbatch.checkpoint.engine_state import save_rank
from rlbatch.checkpoint.files import write_controller

out = Path(sys.argv[2])
mesh = init()
run = out / "run"
config = write_config(run) if comm.rank == 0 else None
store = CheckpointStore(run / "checkpoints")


def stage(step: int) -> Path:
    return Path(comm.bcast(str(store.begin(step)) if comm.rank == 0 else None, root=0))


seed_all(7 + comm.rank)
e = build(mesh)
for _ in range(2):
    train_step(e)
s = stage(2)
save_rank(s, {"actor_train": e}, comm.rank)
comm.barrier()
if comm.rank == 0:
    write_controller(s, {"step": 2}, config)
    store.commit(2, {"run_dir": str(run.resolve())})
ref = full_state(e)
if comm.rank == 0:
    torch.save(ref, out / "ref_step2.pt")
train_step(e)
s = stage(3)
if comm.rank == 1:
    write = FileSystemWriter.write_data

    def die_while_writing(self, plan, planner):
        write(self, plan, planner).wait()
        for f in Path(self.path).glob("__1_*.distcp"):
            os.truncate(f, f.stat().st_size // 2)
        print("rank 1: SIGKILL while writing step 3", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    FileSystemWriter.write_data = die_while_writing
comm.barrier()
save_rank(s, {"actor_train": e}, comm.rank)
print(f"rank {comm.rank}: should not get here", flush=True)
