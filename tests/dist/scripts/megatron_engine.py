"""Under mpiexec -n 2, the megatron engine on real megatron-core (CPU, gloo, the test-only shim):

- HF -> GPTModel -> HF is exact (export at TP=1 and TP=2 gives the HF weights bit for bit);
- TP=2 (with sequence parallelism, the default, and without) and TP=1 log-probs equal the
  transformers model's within float tolerance; so do TP=2's over packed rows (a token budget: the
  samples of a micro-batch back to back in one row, megatron-core's ``thd`` format, padded to a
  multiple of t under sequence parallelism);
- exact resume at TP=2: 3 steps, checkpoint through the DCP store, 3 more == 6 steps, bitwise;
- weight sync from the TP=2 trainer into the hf engine: greedy output equals transformers with
  the same weights;
- an fsdp checkpoint loads into the TP=2 engine and its checkpoint loads back into fsdp
  (same weights and Adam moments, bitwise).
"""

import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from engine_state import bf16_like, policy_steps, resumes_exactly, same, shares_checkpoints_with_fsdp, weights
from mpi4py import MPI
from mpi_exit import end_script
from torch.distributed.device_mesh import DeviceMesh

import tests.plugins.megatron_cpu  # noqa: F401  (test-only CPU shim, installs itself)
from rlbatch import algos
from rlbatch.algos.objective import PolicyObjective
from rlbatch.config.compose import compose
from rlbatch.engines import training as common
from rlbatch.engines.base import EngineContext, SamplingParams
from rlbatch.engines.batch import pack, response_logits, unpack
from rlbatch.engines.fsdp import FSDPArgs
from rlbatch.engines.fsdp.engine import FSDPEngine
from rlbatch.engines.hf import HFArgs
from rlbatch.engines.hf.engine import HFInferenceEngine
from rlbatch.engines.megatron import MegatronArgs
from rlbatch.engines.megatron.engine import MegatronEngine
from rlbatch.engines.model import load_model, load_tokenizer

comm = MPI.COMM_WORLD
port = comm.bcast(int(sys.argv[1]), root=0)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
NAMES = ("pp", "dp", "cp", "tp")
mesh_tp2 = DeviceMesh("cpu", torch.arange(2).reshape(1, 1, 1, 2), mesh_dim_names=NAMES)
mesh_dp2 = DeviceMesh("cpu", torch.arange(2).reshape(1, 2, 1, 1), mesh_dim_names=NAMES)
cfg = compose(["algo.lr=1e-2", "algo.warmup_steps=2", "algo.grad_clip=0.5"])
tok = load_tokenizer(cfg.model)
objective = PolicyObjective(cfg.algo)
SEED = 3
TMP = Path(comm.bcast(tempfile.mkdtemp(prefix="mcore-") if comm.rank == 0 else None, root=0))


def megatron(mesh, trainable=True, sequence_parallel=True, budget=0):
    args = MegatronArgs(sequence_parallel=sequence_parallel, max_tokens_per_micro_batch=budget, pack_rows=budget > 0)
    return MegatronEngine(EngineContext("actor_train", args, cfg.model, cfg.algo, tok, torch.device("cpu"), seed=SEED,
                                        mesh=mesh, trainable=trainable))


def fsdp(mesh):
    return FSDPEngine(EngineContext("actor_train", FSDPArgs(share_prompts=False), cfg.model, cfg.algo, tok,
                                    torch.device("cpu"), seed=SEED, mesh=mesh, trainable=True))


def batch(step):
    """The same samples on both ranks (the tp peers of one replica get the same ones)."""
    g = torch.Generator().manual_seed(100 + step)
    out = [{"prompt": torch.randint(4, 18, (3 + k % 4,), generator=g),
            "response": torch.randint(4, 18, (1 + k % 5,), generator=g),
            "advantage": torch.tensor(float(k % 5) - 2.0)} for k in range(8)]
    return out


def train(e, steps):
    policy_steps(e, steps, batch, objective)


# -- conversion and numerics ---------------------------------------------------------------------
hf = load_model(cfg.model, tok, SEED)
hf_weights = {n: p.detach().clone() for n, p in hf.named_parameters()}
tp1, tp2 = megatron(mesh_dp2, trainable=False), megatron(mesh_tp2)
plain_tp2 = megatron(mesh_tp2, trainable=False, sequence_parallel=False)
assert tp2.model.config.sequence_parallel and not plain_tp2.model.config.sequence_parallel
same(weights(tp1), hf_weights, "HF -> GPTModel -> HF at TP=1")
same(weights(tp2), hf_weights, "HF -> GPTModel -> HF at TP=2")
same(weights(tp2, torch.bfloat16), bf16_like(hf_weights), "bf16 export at TP=2")
samples = batch(0)
b = pack(samples, tok.pad_token_id, torch.device("cpu"))
with torch.no_grad():
    ref = unpack(algos.token_logprobs(response_logits(hf, b).float(), b.targets), b.lengths)
packed_tp2 = megatron(mesh_tp2, trainable=False, budget=21)
assert packed_tp2.packed and max(len(c) for c in common.chunks(samples, packed_tp2.split)) > 1, "rows of several samples"
for name, e in (("TP=1", tp1), ("TP=2", tp2), ("TP=2 without sequence parallelism", plain_tp2),
                ("TP=2 over packed rows", packed_tp2)):
    err = max(float((x - y).abs().max()) for x, y in zip(e.logprobs(samples), ref, strict=True))
    # fp32 with |logp| ~ 3: summation-order differences are ~1e-6; a wrong mapping is ~0.1 or more
    assert err < 1e-4, f"{name} log-probs differ from transformers by {err}"
    print(f"rank {comm.rank}: {name} log-probs within {err:.1e} of transformers", flush=True)

# -- exact resume at TP=2: 3 + 3 == 6 -------------------------------------------------------------
train(tp2, range(6))
resumes_exactly(lambda: megatron(mesh_tp2), train, TMP / "mcore3", weights(tp2), "TP=2 resume 3+3 vs 6")
assert not torch.equal(weights(tp2)["model.norm.weight"], hf_weights["model.norm.weight"]), "training changed nothing"

# -- weight sync from the TP=2 trainer to the hf engine: greedy output equals transformers' -------
trained = weights(tp2)
gen = HFInferenceEngine(EngineContext("actor_infer", HFArgs(), cfg.model, cfg.algo, tok, torch.device("cpu"),
                                      seed=SEED + 1, mesh=mesh_dp2))  # other initial weights: only sync makes them equal
with tp2.export_weights() as named:
    gen.load_weights(named)
ref_model = load_model(cfg.model, tok, SEED + 1)
ref_model.load_state_dict(trained, strict=False)  # tied: lm_head is embed_tokens
ref_model.eval()
g = torch.Generator().manual_seed(7)
prompts = [torch.randint(4, 18, (3 + k % 3,), generator=g).tolist() for k in range(6)]
got = [x.tokens for x in gen.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0))]
want = []
with torch.no_grad():
    for p in prompts:
        out = ref_model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=6,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        want.append(out[0, len(p):].tolist())
assert got == want, f"greedy after weight sync {got} != transformers {want}"

# -- fsdp <-> megatron checkpoints ---------------------------------------------------------------
shares_checkpoints_with_fsdp(lambda: fsdp(mesh_dp2), lambda: megatron(mesh_tp2), train, TMP, "megatron TP=2")
dist.barrier()
if comm.rank == 0:
    shutil.rmtree(TMP, ignore_errors=True)
print(f"rank {comm.rank}: megatron engine ok", flush=True)
end_script(comm)
