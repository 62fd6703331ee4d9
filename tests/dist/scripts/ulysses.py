"""Under mpiexec -n 4: Ulysses context parallelism (rlbatch.engines.ulysses) on a packed row of a
grouped-query Qwen2 (4 heads, 2 key/value heads, fp32) gives each sample's next-token log-probs
and the loss's parameter gradients of the unsplit model, which here runs every sample alone.

c=2 (ranks {0,1} and {2,3}, 2 KV heads split as they are) and c=4 (all ranks: the KV heads
repeated to 4). The row holds four samples (22 tokens) padded to a multiple of c; each rank runs
the model on its slice, its loss is its own tokens' share, the group sums the gradients. Then the
engines' packed rows (``batch.pack(flat=True)``) split by ``ulysses.split``: every rank gets the
whole batch's response log-probs, and a loss of them the unsplit row's gradients.
Tolerances: float32 sums over a few hundred terms in another order: 1e-5 on log-probs (|x| < 10),
1e-5 relative to the largest gradient entry."""

import sys
from dataclasses import replace

import torch
import torch.distributed as dist
from mpi4py import MPI
from mpi_exit import end_script
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlbatch.engines import ulysses
from rlbatch.engines.batch import pack, response_logprobs

comm = MPI.COMM_WORLD
port = comm.bcast(int(sys.argv[1]), root=0)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank, world_size=comm.size)
torch.manual_seed(0)
config = Qwen2Config(vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")
model = Qwen2ForCausalLM(config).float()
lengths = [5, 9, 3, 5]
ids = [torch.randint(3, 50, (n,)) for n in lengths]
weights = torch.rand(sum(lengths))  # a fixed weighted sum of the log-probs: the loss


def logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None])[:, 0]


def targets_of(row: list[torch.Tensor]) -> torch.Tensor:
    """Each token's next token inside its sample (the last token of a sample: itself, weight 0)."""
    return torch.cat([torch.cat([s[1:], s[-1:]]) for s in row])


valid = torch.cat([torch.cat([torch.ones(n - 1), torch.zeros(1)]) for n in lengths])

# The unsplit reference: each sample alone.
ref_lp = torch.cat([logprobs(model(input_ids=s[None]).logits[0], t) for s, t in
                    zip(ids, [torch.cat([s[1:], s[-1:]]) for s in ids], strict=True)])
(ref_lp * weights * valid).sum().backward()
ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
model.zero_grad()

# The engines' packed rows (batch.pack(flat=True)): response log-probs and the loss's gradients.
samples = [{"prompt": torch.randint(3, 50, (p,)), "response": torch.randint(3, 50, (r,))}
           for p, r in ((3, 4), (5, 1), (2, 6), (4, 3))]
packed = pack(samples, 0, torch.device("cpu"), flat=True)
token_w = torch.rand(packed.mask.shape) * packed.mask
flat_lp = response_logprobs(model, packed)[0]
(flat_lp * token_w).sum().backward()
flat_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
model.zero_grad()


def close_grads(group: dist.ProcessGroup, ref: dict[str, torch.Tensor]) -> float:
    """The largest difference of the group's summed gradients from ``ref``, relative to ref's largest entry."""
    worst = 0.0
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        worst = max(worst, float((g - ref[name]).abs().max()) / (float(ref[name].abs().max()) or 1.0))
    model.zero_grad()
    return worst


ulysses.use(model)
groups = {2: [dist.new_group([0, 1]), dist.new_group([2, 3])], 4: [dist.new_group([0, 1, 2, 3])]}
for c in (2, 4):
    group = groups[c][comm.rank // c if c == 2 else 0]
    n = ulysses.padded_length(sum(lengths), c)
    pad = n - sum(lengths)
    row_ids = torch.cat([*ids, torch.zeros(pad, dtype=torch.long)])[None]
    positions = torch.cat([torch.arange(k) for k in lengths] + [torch.arange(pad)])[None]
    targets = torch.cat([targets_of(ids), torch.zeros(pad, dtype=torch.long)])[None]
    w = torch.cat([weights * valid, torch.zeros(pad)])[None]
    with ulysses.over(group, positions):
        logits = model(input_ids=ulysses.local(row_ids, group), position_ids=ulysses.local(positions, group)).logits
    lp = logprobs(logits[0], ulysses.local(targets, group)[0])
    (lp * ulysses.local(w, group)[0]).sum().backward()
    whole = ulysses.gather(lp.detach()[None], group)[0][: sum(lengths)]
    err = float((whole - ref_lp.detach()).abs().max())
    assert err < 1e-5, f"c={c}: log-probs differ by {err}"
    worst = close_grads(group, ref_grads)
    assert worst < 1e-5, f"c={c}: gradients differ by {worst} of the largest entry"
    print(f"rank {comm.rank} c={c}: log-probs within {err:.1e}, gradients within {worst:.1e}", flush=True)

    mine = replace(packed, inputs=ulysses.split(packed.inputs, group))
    assert len(mine.inputs.keep) < len(packed.inputs.keep)  # each rank scores its own positions only
    lp = response_logprobs(model, mine)[0]  # the whole [B, R] on every rank
    err = float((lp - flat_lp).abs().max())
    assert err < 1e-5, f"c={c}: packed-row log-probs differ by {err}"
    (lp * token_w).sum().backward()
    worst = close_grads(group, flat_grads)
    assert worst < 1e-5, f"c={c}: packed-row gradients differ by {worst} of the largest entry"
    print(f"rank {comm.rank} c={c}: packed rows: log-probs within {err:.1e}, gradients within {worst:.1e}", flush=True)

print("ulysses ok", flush=True)
end_script(comm)
