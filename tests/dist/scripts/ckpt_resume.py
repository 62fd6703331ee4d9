"""Under mpiexec -n 2: save FSDP2 train state + RNG mid-run, restore it into a freshly built
model, and the next steps are bit for bit those of the run that never stopped.

    mpiexec -n 2 python tests/dist/scripts/ckpt_resume.py <port> <out_dir>

Leaves in <out_dir>: run/ (config.yaml, checkpoints/step_000003, step_000006), ref_step3.pt
(full state at step 3) and logits_step6.pt (the trained model's logits on probe()), for the
resharding and export tests.
"""

import sys
from pathlib import Path

import torch
from ckpt_common import assert_same, build, comm, full_state, init, probe, seed_all, train_step, write_config
from mpi_exit import end_script

from rlbatch.checkpoint import CheckpointStore
from rlbatch.checkpoint.engine_state import load_rank, save_rank
from rlbatch.checkpoint.files import write_controller

out = Path(sys.argv[2])
mesh = init()
run = out / "run"
config = write_config(run) if comm.rank == 0 else None
store = CheckpointStore(run / "checkpoints", keep=3)


def checkpoint(step: int, e) -> Path:
    stage = comm.bcast(str(store.begin(step)) if comm.rank == 0 else None, root=0)
    save_rank(Path(stage), {"actor_train": e, "reference": object()}, comm.rank)
    comm.barrier()  # every rank has written: now the one commit
    if comm.rank == 0:
        write_controller(Path(stage), {"step": step}, config)
        store.commit(step, {"run_dir": str(run.resolve())})
    comm.barrier()
    return store.root / f"step_{step:06d}"


seed_all(100 + comm.rank)
a = build(mesh)
for _ in range(3):
    train_step(a)
ckpt3 = checkpoint(3, a)
ref3 = full_state(a)
for _ in range(3):
    train_step(a)
final = full_state(a)
checkpoint(6, a)
logits = a.model(input_ids=probe()).logits.detach()
if comm.rank == 0:
    torch.save(ref3, out / "ref_step3.pt")
    torch.save(logits, out / "logits_step6.pt")

seed_all(999)  # a restarted process: other seeding, other initial weights
b = build(mesh, seed=12345)
ck = store.resolve(str(ckpt3))
assert ck is not None and ck.step == 3 and ck.meta["run_dir"] == str(run.resolve()), ck
load_rank(ck.path, {"actor_train": b}, comm.rank)
after_load = full_state(b)
for _ in range(3):
    train_step(b)
resumed = full_state(b)
if comm.rank == 0:
    assert_same(ref3, after_load, "state after load")
    assert_same(final, resumed, "3 steps after resume")
print(f"rank {comm.rank}: resume ok", flush=True)
end_script(comm)
