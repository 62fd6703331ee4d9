"""Under mpiexec, 2 ranks with tests/stand_ins on PYTHONPATH: one tensor-parallel SGLang worker
(sglang:d1t2) built as the engine registry builds it (``rlbatch.engines.sglang.engine.build``): rank 0
holds ``sglang.Engine(tp_size=2)`` (two scheduler processes that reduce over gloo), rank 1 its
follower.

Checks: the leader's greedy output equals transformers' (same weights, fp32) token for token before
and after a weight sync in buckets through one reused staging buffer; its behaviour log-probs equal
a transformers forward's; the follower's every generate call returns exactly the leader's
generations (tokens and log-probs); the follower loads nothing and moves nothing; the program's
collectives still work after SGLang started and after each call.

Everything runs under ``main()``: SGLang spawns its scheduler processes, which import this file
afresh (as ``__mp_main__``) and must not start MPI."""

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from rlbatch.config.compose import compose
from rlbatch.engines.base import EngineContext, SamplingParams
from rlbatch.engines.hf import HFArgs
from rlbatch.engines.hf.engine import HFInferenceEngine
from rlbatch.engines.model import load_tokenizer
from rlbatch.engines.sglang import SGLangArgs
from tests.unit.infer_checks import assert_behaviour_logprobs_match_transformers, sync_in_buckets

SEED = 1


def collective_works(comm: Any) -> None:
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [float(comm.size)] * 2, t


def main() -> None:
    from mpi4py import MPI
    from mpi_exit import end_script

    from rlbatch.engines.sglang.engine import SGLangEngine, SGLangFollower, build

    comm = MPI.COMM_WORLD
    port = comm.bcast(int(sys.argv[1]), root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
    mesh = DeviceMesh("cpu", torch.arange(comm.size).reshape(1, comm.size), mesh_dim_names=("dp", "tp"))
    cpu = torch.device("cpu")
    cfg = compose([])  # the default tiny model: 4 heads, 2 KV heads, split 2 ways
    tok = load_tokenizer(cfg.model)
    engine = build(EngineContext("actor_infer", SGLangArgs(kv_cache_tokens=4096, max_num_seqs=64), cfg.model, cfg.algo,
                                 tok, cpu, seed=SEED, mesh=mesh, comm=comm))
    leader = comm.rank == 0
    assert isinstance(engine, SGLangEngine if leader else SGLangFollower), type(engine)
    if isinstance(engine, SGLangEngine):  # one engine of two scheduler processes
        assert engine.engine.server_args.tp_size == 2, engine.engine.server_args.tp_size
    collective_works(comm)
    hf = HFInferenceEngine(EngineContext("actor_infer", HFArgs(), cfg.model, cfg.algo, tok, cpu, seed=SEED))
    prompts = [tok.encode(f"{k}*{k + 1}=") for k in range(6)]
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    before = [t for t, _ in both(comm, engine, prompts, greedy)]
    assert before == [g.tokens for g in hf.generate(prompts, greedy)], "t=2 greedy equals transformers"
    if leader:
        # each call is made on both ranks in the same order, as the rollout does
        assert_behaviour_logprobs_match_transformers(engine, cfg, tok, SEED, [tok.encode(f"{k}+{k}=") for k in range(4)] * 2,
                                                     0.7)
    else:
        engine.generate([[0]] * 8, SamplingParams(max_new_tokens=6, temperature=0.7, seed=3))
    collective_works(comm)
    g = torch.Generator().manual_seed(11)
    new = [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=g)) for n, p in hf.model.named_parameters()]
    if leader:
        sync_in_buckets(engine, new)
    else:
        assert engine.load_weights(new) == 0 and not engine.state_kinds
        assert engine.offload(["params"]).bytes == 0 and engine.reload(["params"]).bytes == 0
    hf.load_weights(new)
    want = [g.tokens for g in hf.generate(prompts, greedy)]
    assert want != before  # the new weights change the answers: the check below sees the sync
    assert [t for t, _ in both(comm, engine, prompts, greedy)] == want, "t=2 greedy after the sync equals transformers"
    print(f"rank {comm.rank}: sglang tp ok", flush=True)
    if leader:
        engine.close()
    end_script(comm)


def both(comm: Any, engine: Any, prompts: list[list[int]], params: SamplingParams) -> list[tuple[list[int], list[float]]]:
    """Both ranks' generations of one call: the same on each (the follower's are the leader's)."""
    out = [(g.tokens, g.logprobs) for g in engine.generate(prompts, params)]
    everyone = comm.allgather(out)
    assert everyone[1] == everyone[0], "the follower returns the leader's generations"
    collective_works(comm)
    return out


if __name__ == "__main__":
    main()
