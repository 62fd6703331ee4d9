"""Shared by the engine scripts: an engine's full weights, bitwise comparison, checkpoint round trips."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlbatch.checkpoint.dcp import load_state, save_state


def weights(e, dtype=None):  # type: ignore[no-untyped-def]
    """The engine's full HF-named weights, cloned; in ``dtype`` (each shard cast before it is gathered)."""
    with e.export_weights() as named:
        return {n: t.clone() for n, t in named.tensors(dtype)}


def bf16_like(full):  # type: ignore[no-untyped-def]
    """What a bf16 export of these fp32 weights must give: each cast, bit for bit."""
    return {n: t.to(torch.bfloat16) for n, t in full.items()}


def same(a, b, what):  # type: ignore[no-untyped-def]
    assert a.keys() == b.keys(), f"{what}: names differ: {sorted(a.keys() ^ b.keys())}"
    bad = [n for n in a if not torch.equal(a[n], b[n])]
    assert not bad, f"{what}: not bitwise equal: {bad[:5]}"


def checkpoint(e, path):  # type: ignore[no-untyped-def]
    save_state(path, e.checkpoint_state())
    dist.barrier()


def restore(e, path):  # type: ignore[no-untyped-def]
    e.load_checkpoint_state(load_state(path, e.checkpoint_state()))


def resumes_exactly(make, train, path, want, what):  # type: ignore[no-untyped-def]
    """3 updates, a checkpoint through the DCP store, a new engine, 3 more: the weights ``want`` of 6
    updates in one go, bit for bit. Returns the resumed engine."""
    half = make()
    train(half, range(3))
    checkpoint(half, path)
    resumed = make()
    restore(resumed, path)
    train(resumed, range(3, 6))
    same(weights(resumed), want, what)
    return resumed


def shares_checkpoints_with_fsdp(make_fsdp, make, train, tmp, what):  # type: ignore[no-untyped-def]
    """An fsdp checkpoint after 3 updates loads into ``make()``'s engine (weights and Adam moments
    bitwise); that engine's checkpoint one update later loads back into fsdp (weights bitwise)."""
    f = make_fsdp()
    train(f, range(3))
    checkpoint(f, tmp / "fsdp3")
    m = make()
    restore(m, tmp / "fsdp3")
    same(weights(m), weights(f), f"fsdp checkpoint into {what}: weights")
    ms, fs = m.checkpoint_state().tensors, f.checkpoint_state().tensors
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in fs.items()}
    same({k: ms[k] for k in ms if ".exp_avg" in k}, {k: full[k] for k in ms if ".exp_avg" in k},
         f"fsdp checkpoint into {what}: Adam moments")
    train(m, range(3, 4))
    checkpoint(m, tmp / "other4")
    f2 = make_fsdp()
    restore(f2, tmp / "other4")
    same(weights(f2), weights(m), f"{what} checkpoint into fsdp: weights")


def critic_directory(cfg, tok, seed, path):  # type: ignore[no-untyped-def]
    """On rank 0, a token-classification critic with a random head saved to ``path`` (value_model's
    head is zero: every value would be 0); every rank waits for it. Returns a model config naming it."""
    import copy

    from rlbatch.engines.model import load_model, value_model

    if dist.get_rank() == 0:
        critic = value_model(load_model(cfg.model, tok, seed))
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            critic.score.weight.copy_(torch.randn(critic.score.weight.shape, generator=g) / 8)
            critic.score.bias.fill_(0.3)
        critic.save_pretrained(path)
    dist.barrier()
    model = copy.deepcopy(cfg.model)
    model.path = str(path)
    return model


def trains_like(name, e, train, ref_stats, ref_weights, tol, weight_tol):  # type: ignore[no-untyped-def]
    """``train(e, range(3))`` against a reference's three updates: the same losses and gradient norms
    (relative ``tol``), every weight within ``weight_tol`` after. Returns (stats, the weights' error)."""
    got = train(e, range(3))
    for step, (a, b) in enumerate(zip(got, ref_stats, strict=True)):
        for key in ("pg_loss", "grad_norm"):
            assert abs(a[key] - b[key]) < tol * max(1.0, abs(b[key])), f"{name} step {step} {key}: {a[key]} vs {b[key]}"
    w = weights(e)
    err = max(float((w[n] - ref_weights[n]).abs().max()) for n in ref_weights)
    assert err < weight_tol, f"{name}: weights {err} from the reference's after 3 updates"
    return got, err


def policy_steps(e, steps, batch, objective):  # type: ignore[no-untyped-def]
    """One update per step on ``batch(step)``, with old log-probs from ``e`` itself and reference
    log-probs 0.05 below them: the stats of each update."""
    stats = []
    for step in steps:
        samples = batch(step)
        for x, old in zip(samples, e.logprobs(samples), strict=True):
            x["old_logprobs"], x["ref_logprobs"] = old, old - 0.05
        stats.append(e.train(samples, objective))
    return stats


def scores_like_transformers(rm, cfg, tok, seed, samples, tol, what):  # type: ignore[no-untyped-def]
    """A reward engine's scores against transformers' sequence classification of the same
    random-init reward model (``reward_model`` from ``seed``): within ``tol``, and the reference
    not trivial. Returns the engine's scores."""
    from rlbatch.engines import training as common
    from rlbatch.engines.batch import pack
    from rlbatch.engines.model import load_model, reward_model

    ref = reward_model(load_model(cfg.model, tok, seed), seed).eval()
    want = common.scores(ref, samples, 0, lambda c: pack(c, tok.pad_token_id, torch.device("cpu"), share_prompts=False))
    got = rm.scores(samples)
    err = max(abs(x - y) for x, y in zip(got, want, strict=True))
    assert err < tol, f"{what} reward scores differ from transformers by {err}: {got} vs {want}"
    assert len(set(round(x, 4) for x in want)) > 4, f"the reference scores are trivial: {want}"
    print(f"rank {dist.get_rank()}: {what} reward scores within {err:.1e} of transformers", flush=True)
    return got
