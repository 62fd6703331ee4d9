"""Under mpiexec -n 2: weight sync streams an fsdp trainer's weights one FSDP unit at a time, in the
inference dtype, and lands them bit for bit (``RankRuntime._sync`` on both ranks, as a sync phase runs).

Memory is tracked two ways, both counting only memory still allocated (storages held weakly: a tensor
freed, or an unsharded parameter resharded, counts 0; ``tests/alive.py``), and bounded by the largest
unit of the trainer (a decoder layer, a quarter of the model), computed from its parameter sizes:
the tensors a tracking hf engine has been handed, counted at every ``load_weights`` call; and the
output of every all-gather, counted at every all-gather (so a unit still held while the next one is
gathered shows).

- colocated: the trainer (a unit per decoder layer, sharded over both ranks) loads into an hf engine on
  each rank: both counts stay within one unit; the inference weights equal the trainer's, gathered
  independently, bit for bit.
- bf16 wire (forced on CPU, as for a bf16 engine on a GPU), after a forward that left the root unit
  unsharded: every all-gather moves bf16 (each shard is cast before it is gathered), every parameter is
  gathered (this rank sends its half of the model in bf16), half a unit at most is alive, and the bf16
  inference weights equal the trainer's cast to bf16.
- one unit (the fast path of a small model: one all-gather of it all), colocated: bit for bit.
- broadcast to a rank that also trains: rank 0 sends, rank 1 trains and receives (its gathers
  interleave with the broadcasts), in buckets smaller than a unit; bit for bit, and on both ranks the
  gathered weights alive stay within one unit.

    mpiexec -n 2 python tests/dist/scripts/weight_stream.py <port> [checks, e.g. colocated,bf16]
"""

import sys
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
from mpi4py import MPI
from mpi_exit import end_script
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

from rlbatch.config.compose import compose
from rlbatch.engines.base import EngineContext
from rlbatch.engines.fsdp import FSDPArgs
from rlbatch.engines.fsdp.engine import FSDPEngine
from rlbatch.engines.hf import HFArgs
from rlbatch.engines.hf.engine import HFInferenceEngine
from rlbatch.engines.model import load_tokenizer
from rlbatch.loop.rank_runtime import RankRuntime
from rlbatch.loop.weightsync import WeightBroadcast
from rlbatch.phases import PHASES
from rlbatch.runtime.world import SYNC
from tests.alive import Alive

comm = MPI.COMM_WORLD
port = comm.bcast(int(sys.argv[1]), root=0)
CHECKS = sys.argv[2].split(",") if len(sys.argv) > 2 else ["colocated", "bf16", "one_unit", "broadcast"]
# A deadlock between the gathers and the broadcasts fails in two minutes, not at the test's timeout.
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size,
                        timeout=timedelta(seconds=120))
mesh = DeviceMesh("cpu", torch.arange(comm.size), mesh_dim_names=("dp",))
cfg = compose(["model.num_layers=4"])  # a layer is a quarter of the model's parameters
tok = load_tokenizer(cfg.model)
cpu = torch.device("cpu")
SPEC = PHASES["sync"]


class TrackingHF(HFInferenceEngine):
    """The hf engine, counting the memory of what a sync has handed it each time it hands more."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self.alive = Alive()

    def load_weights(self, named):  # type: ignore[no-untyped-def]
        named = list(named)
        self.alive.saw(t for _, t in named)
        return super().load_weights(named)


class Gathers(TorchDispatchMode):
    """Every all-gather (a DTensor's ``full_tensor``, FSDP's unshard): the dtype and bytes of this rank's
    input, and the memory of all outputs so far still allocated, counted at each one."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[tuple[torch.dtype, int]] = []
        self.alive = Alive()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name.startswith("_c10d_functional.all_gather_into_tensor"):
            self.inputs.append((args[0].dtype, args[0].numel() * args[0].element_size()))
            self.alive.saw([out])
        elif name.startswith("c10d._allgather_base_"):
            self.inputs.append((args[1].dtype, args[1].numel() * args[1].element_size()))
            self.alive.saw([args[0]])
        return out


def trainer(**args) -> FSDPEngine:  # type: ignore[no-untyped-def]
    return FSDPEngine(EngineContext("actor_train", FSDPArgs(**args), cfg.model, cfg.algo, tok, cpu, seed=3, mesh=mesh,
                                    trainable=True))


def inference(dtype: str = "auto") -> TrackingHF:
    model = compose(["model.num_layers=4", f"model.dtype={dtype}"]).model
    return TrackingHF(EngineContext("actor_infer", HFArgs(), model, cfg.algo, tok, cpu, seed=1))  # other weights


def full(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    """The trainer's weights gathered here, not through its export."""
    return {n: p.full_tensor().clone() for n, p in engine.model.named_parameters()}


def sync(engines: dict, wire: torch.dtype, local: bool, bucket_bytes: int = 256 << 20) -> Gathers:  # type: ignore[type-arg]
    """One sync phase on this rank, as the rank runtime runs it; returns what its all-gathers did."""
    world = SimpleNamespace(rank=comm.rank, device=cpu, groups={SYNC: dist.group.WORLD}, members={SYNC: (0, 1)},
                            check=lambda op, role, fn, *a, **k: fn(*a, **k))
    rt = SimpleNamespace(engines=engines, world=world, broadcast=WeightBroadcast(wire), in_flight=None)
    with Gathers() as gathers:
        RankRuntime._sync(rt, SPEC, src=0, local=local, bucket_bytes=bucket_bytes)  # type: ignore[arg-type]
    return gathers


def equal(infer: TrackingHF, want: dict[str, torch.Tensor], what: str) -> None:
    got = infer._params
    assert got.keys() == want.keys(), f"{what}: names differ: {sorted(got.keys() ^ want.keys())[:5]}"
    bad = [n for n in want if not torch.equal(got[n], want[n].to(got[n].dtype))]
    assert not bad, f"{what}: not bitwise equal: {bad[:5]}"


def largest_unit(names_bytes: list[tuple[str, int]]) -> int:
    """The most bytes of one unit of a trainer with a unit per layer: one layer's parameters; the root's
    embedding and final norm come as units of their own."""
    units: dict[str, int] = {}
    for name, nbytes in names_bytes:
        key = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else name
        units[key] = units.get(key, 0) + nbytes
    return max(units.values())


def within(alive: Alive, bound: int, what: str) -> None:
    assert 0 < alive.peak <= bound, (f"{what}: {alive.peak} bytes of gathered weights alive at once; one unit is "
                                     f"{bound}, the model {model_bytes}")


per_layer = trainer(single_unit_max_mb=0)
want = full(per_layer)
sizes = [(n, t.numel() * 4) for n, t in want.items()]
unit_bytes, model_bytes = largest_unit(sizes), sum(b for _, b in sizes)
assert unit_bytes < model_bytes / 3, (unit_bytes, model_bytes)

if "colocated" in CHECKS:
    infer = inference()
    gathers = sync({"actor_train": per_layer, "actor_infer": infer}, torch.float32, local=True)
    equal(infer, want, "colocated fp32")
    within(infer.alive, unit_bytes, "colocated, handed to the inference engine")
    within(gathers.alive, unit_bytes, "colocated, all-gathered")
    print(f"rank {comm.rank}: colocated sync: at most {gathers.alive.peak} bytes gathered at once (one unit: "
          f"{unit_bytes}, the model: {model_bytes})", flush=True)

if "bf16" in CHECKS:
    infer = inference("bf16")
    # A forward leaves the root unit (embedding, final norm) unsharded, as a log-prob phase does: the
    # export still gathers it from the fp32 shards, cast first.
    per_layer.logprobs([{"prompt": torch.tensor([4, 5, 6]), "response": torch.tensor([7, 8])}])
    gathers = sync({"actor_train": per_layer, "actor_infer": infer}, torch.bfloat16, local=True)
    dtypes = {d for d, _ in gathers.inputs}
    assert dtypes == {torch.bfloat16}, f"all-gathers with a bf16 wire moved {dtypes}"
    sent = sum(b for _, b in gathers.inputs)
    # its half of every parameter in bf16: a quarter of the fp32 model's bytes, a little more where shards pad
    assert model_bytes / 2 / comm.size <= sent < model_bytes / comm.size, \
        f"this rank sent {sent} bytes to all-gathers; its half of the model in bf16 is {model_bytes // 2 // comm.size}"
    within(infer.alive, unit_bytes // 2, "bf16, handed to the inference engine")
    within(gathers.alive, unit_bytes // 2, "bf16, all-gathered")
    equal(infer, want, "colocated bf16")
    print(f"rank {comm.rank}: bf16 wire: {len(gathers.inputs)} all-gathers, all bf16, {sent} bytes sent", flush=True)

if "one_unit" in CHECKS:
    one = trainer()
    assert one.single_unit
    infer = inference()
    gathers = sync({"actor_train": one, "actor_infer": infer}, torch.float32, local=True)
    equal(infer, full(one), "one unit, colocated")
    assert len(gathers.inputs) == 1, f"a one-unit model gathered in {len(gathers.inputs)} collectives"
    print(f"rank {comm.rank}: one-unit sync ok", flush=True)

if "broadcast" in CHECKS:
    engines = {"actor_train": per_layer} | ({"actor_infer": inference()} if comm.rank == 1 else {})
    bucket = unit_bytes // 3  # buckets end inside units: the receiver's gathers and the broadcasts interleave
    gathers = sync(engines, torch.float32, local=False, bucket_bytes=bucket)
    within(gathers.alive, unit_bytes, "broadcast, all-gathered")
    if comm.rank == 1:
        equal(engines["actor_infer"], want, "broadcast to a rank that trains")
    print(f"rank {comm.rank}: broadcast ok", flush=True)

print(f"rank {comm.rank}: weight stream ok", flush=True)
end_script(comm)
