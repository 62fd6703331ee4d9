"""Under mpiexec: one tensor-parallel vLLM worker (t=2) on ranks ``sys.argv[2]`` (comma-separated),
in a private world of its two peers beside the program's world.

- ``1,2`` of 3 ranks (disaggregated): rank 0, holding the program store's server and no engine,
  sends new weights in 8 KiB buckets over the program's world (rlbatch.loop.weightsync)
  to both peers, which receive them through one reused staging buffer;
- ``0,1`` of 2 ranks (colocated): every rank loads the full weights in process.

A third argument ``compiled`` builds the engine with ``cpu_compile`` (torch.compile, as vLLM runs
by default) and checks it is compiled; ``moe`` runs a Qwen2-MoE model (vLLM's CPU MoE kernel packs
the experts' weights, and must pack them again after each sync); every check below is the same.

Each peer checks: greedy output before and after the sync equals transformers' with the same
weights token for token (fp32); sampled output with a seed is the same on both peers and differs
between seeds; the program's collectives still work after vLLM started and after each call."""

import glob
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from mpi4py import MPI
from mpi_exit import end_script
from torch.distributed.device_mesh import DeviceMesh

from rlbatch.config.compose import compose
from rlbatch.engines.base import EngineContext, SamplingParams, WeightStream
from rlbatch.engines.hf import HFArgs
from rlbatch.engines.hf.engine import HFInferenceEngine
from rlbatch.engines.model import load_model, load_tokenizer
from rlbatch.engines.vllm import VLLMArgs
from rlbatch.engines.vllm.engine import VLLMEngine
from rlbatch.loop.weightsync import WeightBroadcast
from rlbatch.runtime.world import SYNC

SEED = 1
comm = MPI.COMM_WORLD
port = comm.bcast(int(sys.argv[1]), root=0)
peers = [int(r) for r in sys.argv[2].split(",")]
colocated = comm.size == len(peers)
compiled = "compiled" in sys.argv[3:]  # engine_args.cpu_compile: torch.compile, as vLLM runs by default
moe = "moe" in sys.argv[3:]  # a Qwen2-MoE (4 experts, top-2): vLLM's fused MoE layer, repacked on each sync
os.environ.setdefault("OMP_NUM_THREADS", "1")
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
mesh = DeviceMesh("cpu", torch.tensor(peers).reshape(1, len(peers)), mesh_dim_names=("dp", "tp"))  # collective


def program_collective_works() -> None:
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [float(comm.size)] * 2, t


cfg = compose(["model.num_heads=2", "model.num_kv_heads=1",  # head_dim 32: vLLM's CPU attention
               *(["model.arch=qwen2_moe"] if moe else [])])
tok = load_tokenizer(cfg.model)
cpu = torch.device("cpu")
engine = hf = None
if comm.rank in peers:
    engine = VLLMEngine(EngineContext("actor_infer", VLLMArgs(kv_cache_mb=64, cpu_compile=compiled), cfg.model, cfg.algo, tok, cpu,
                                      seed=SEED, mesh=mesh))
    assert engine.world.default_pg.size() == len(peers) and engine.tp_ranks == tuple(peers)
    assert engine.llm.llm_engine.vllm_config.model_config.enforce_eager is not compiled
    hf = HFInferenceEngine(EngineContext("actor_infer", HFArgs(), cfg.model, cfg.algo, tok, cpu, seed=SEED))
program_collective_works()  # also: every peer's engine has started
if engine is not None:
    # On an AVX-512 CPU vLLM's tp collectives go through shared memory: the segments carry this
    # worker's own name (not the external launcher's fixed one), and are unlinked once mapped.
    from vllm.distributed import parallel_state

    tp_comm = parallel_state.get_tp_group().device_communicator.dist_module
    if type(tp_comm).__name__ == "_CPUSHMDistributed":
        assert tp_comm.group_name.startswith("rlbatch-"), tp_comm.group_name
        assert not glob.glob(f"/dev/shm/{glob.escape(tp_comm.group_name)}*"), os.listdir("/dev/shm")
        print(f"rank {comm.rank}: shared-memory tp collectives as {tp_comm.group_name}", flush=True)

prompts = [tok.encode(f"{k}*{k + 1}=") for k in range(6)]
greedy = SamplingParams(max_new_tokens=10, temperature=0.0)


def check_greedy(when: str) -> None:
    if engine is None:
        return
    got, want = [g.tokens for g in engine.generate(prompts, greedy)], [g.tokens for g in hf.generate(prompts, greedy)]
    assert got == want, (comm.rank, when, got, want)


check_greedy("before the sync")
g = torch.Generator().manual_seed(11)
new = [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=g)) for n, p in load_model(cfg.model, tok, SEED).named_parameters()]
if colocated:
    engine.load_weights(new)  # type: ignore[union-attr]
else:
    world = SimpleNamespace(rank=comm.rank, device=cpu, groups={SYNC: dist.group.WORLD}, members={SYNC: (0, 1, 2)},
                            check=lambda op, role, fn, *a, **k: fn(*a, **k))
    WeightBroadcast(torch.float32)(world, WeightStream.of(new) if comm.rank == 0 else None, engine, 0, 8192)  # type: ignore[arg-type]
if hf is not None:
    hf.load_weights(new)
program_collective_works()
check_greedy("after the sync")
sampled: list = []
if engine is not None:
    mixed = [tok.encode("1+2=")] * 8 + [tok.encode("3+4=")] * 8
    for seed in (5, 6):
        sampled.append([tuple(x.tokens) for x in engine.generate(mixed, SamplingParams(8, 1.0, seed=seed))])
    assert sampled[0] != sampled[1], "a different seed gives different samples"
    assert len(set(sampled[0][:8])) > 2, "a group's samples differ"
everyone = comm.allgather(sampled)
assert all(everyone[r] == everyone[peers[0]] for r in peers), "tp peers return the same samples"
program_collective_works()
print(f"rank {comm.rank}: vllm tp ok", flush=True)
end_script(comm)
