"""Exact loss under any micro-batch split: ``common.weighted_updates`` with a token budget gives the
update of the whole mini-batch in one unsplit, unpadded pass, for every registered aggregation, on
one rank or two (data-parallel ranks simulated by threads whose all-reduce adds up their values,
and whose gradients are averaged as FSDP and DeepSpeed average them).

Tolerance: every gradient is a float32 sum of at most N = (tokens in the mini-batch) terms plus a
few products per term; recursive summation in another order moves it by at most about
N * eps32 * (sum of the terms' magnitudes) (Higham, gamma_N), and each term is bounded by the
largest gradient entry times a small factor, so ``TOL = 8 * N * eps32 * max|g|`` (elementwise,
plus the same on the loss). The split with today's mean of micro-batch means is off by far more,
which ``test_count_split_is_not_exact`` checks, so the equality tests can fail.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlbatch.algos.objective import LossInput, PolicyObjective
from rlbatch.algos.value import ValueInput, ValueObjective
from rlbatch.engines import training as common

EPS32 = torch.finfo(torch.float32).eps
V, H = 7, 5


def _algo(**kw: Any) -> SimpleNamespace:
    base = dict(loss_agg="token", policy_loss="ppo_clip", kl_estimator="k3", kl_coef=0.05, kl_in_reward=False,
                entropy_coef=0.01, off_policy="none", clip_low=0.2, clip_high=0.28, max_new_tokens=16,
                mini_batches=2, epochs=1, grad_accum=3, tis_cap=2.0, mask_ratio_low=0.5, mask_ratio_high=1.5,
                value_clip=0.2)
    return SimpleNamespace(**(base | kw))


def _samples(n: int = 12, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Ragged samples: prompts of 1-6 tokens, responses of 1-16, features per response token."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, r = int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 17, (1,), generator=g))
        s = {"prompt": torch.randint(0, V, (p,), generator=g), "response": torch.randint(0, V, (r,), generator=g),
             "x": torch.randn(r, H, generator=g), "id": torch.tensor(i)}
        s["old_logprobs"] = -torch.rand(r, generator=g) * 2
        s["behaviour_logprobs"] = s["old_logprobs"] + 0.3 * torch.randn(r, generator=g)
        s["ref_logprobs"] = -torch.rand(r, generator=g) * 2
        s["advantages"] = torch.randn(r, generator=g).expand(r).clone()
        s["returns"] = torch.randn(r, generator=g)
        s["values"] = torch.randn(r, generator=g)
        if i % 5 == 3:  # a sample out of the loss (DAPO's overlong filter)
            s["loss_mask"] = torch.zeros(r)
        out.append(s)
    return out


def _batch(samples: list[dict[str, torch.Tensor]], w: torch.Tensor, objective: Any) -> Any:
    """The objective's input for ``samples``, padded to their longest response (padding masked)."""
    R = max(len(s["response"]) for s in samples)
    B = len(samples)
    x = torch.zeros(B, R, H)
    targets = torch.zeros(B, R, dtype=torch.long)
    mask = torch.zeros(B, R)
    fields = {f: torch.zeros(B, R) for f in ("old_logprobs", "behaviour_logprobs", "ref_logprobs", "returns", "values")
              if all(f in s for s in samples)}  # as pack: a field only when every sample has it
    adv = torch.zeros(B, R)
    loss_mask = torch.ones(B, R)
    for b, s in enumerate(samples):
        r = len(s["response"])
        x[b, :r], targets[b, :r], mask[b, :r], adv[b, :r] = s["x"], s["response"], 1.0, s["advantages"]
        for f in fields:
            fields[f][b, :r] = s[f]
        if "loss_mask" in s:
            loss_mask[b, :r] = s["loss_mask"]
    if any("loss_mask" in s for s in samples):
        fields["loss_mask"] = loss_mask
    logits = x @ w
    if objective.head == "value":
        return ValueInput(logits[..., 0], mask, {f: fields[f] for f in ("returns", "values", "loss_mask") if f in fields})
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    return LossInput(logp, mask, adv, fields, logits)


def _run(objective: Any, micro: list[list[common.MicroBatch]], w: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(loss, gradient) of one rank's updates, summed over updates (as one accumulation)."""
    w = w.clone().requires_grad_(True)
    total = 0.0
    for update in micro:
        for m in update:
            loss, _ = m.objective(_batch(m.samples, w, objective))
            (loss / m.divisor).backward()
            total += float(loss.detach() / m.divisor) if m.divisor != float("inf") else 0.0
    assert w.grad is not None
    return total, w.grad


def _reference(objective: Any, samples: list[dict[str, torch.Tensor]], algo: Any, w: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Each mini-batch in one pass: the objective as configured (mean form) on all its samples."""
    w = w.clone().requires_grad_(True)
    total = 0.0
    for mb in common.mini_batches(samples, algo, objective):
        loss, _ = objective(_batch(mb, w, objective))
        loss.backward()
        total += float(loss.detach())
    assert w.grad is not None
    return total, w.grad


def _close(got: tuple[float, torch.Tensor], want: tuple[float, torch.Tensor], n_tokens: int) -> None:
    tol = 8 * n_tokens * EPS32 * max(float(want[1].abs().max()), abs(want[0]), 1e-3)
    assert abs(got[0] - want[0]) <= tol, (got[0], want[0], tol)
    err = float((got[1] - want[1]).abs().max())
    assert err <= tol, (err, tol)


OBJECTIVES: list[tuple[str, Callable[[Any], Any], dict[str, Any]]] = [
    ("token-ppo", PolicyObjective, {"loss_agg": "token"}),
    ("seq-ppo", PolicyObjective, {"loss_agg": "seq"}),
    ("seq_sum-ppo", PolicyObjective, {"loss_agg": "seq_sum"}),
    ("token-gspo", PolicyObjective, {"loss_agg": "token", "policy_loss": "gspo"}),
    ("seq-gspo", PolicyObjective, {"loss_agg": "seq", "policy_loss": "gspo"}),
    ("token-mask-correction", PolicyObjective, {"loss_agg": "token", "off_policy": "mask"}),
    ("seq-tis", PolicyObjective, {"loss_agg": "seq", "off_policy": "tis"}),
    ("token-value", ValueObjective, {"loss_agg": "token"}),
    ("seq-value", ValueObjective, {"loss_agg": "seq"}),
    ("seq_sum-value", ValueObjective, {"loss_agg": "seq_sum"}),
]


@pytest.mark.parametrize(("name", "make", "kw"), OBJECTIVES, ids=[o[0] for o in OBJECTIVES])
def test_token_budget_split_equals_unsplit_pass(name: str, make: Callable[[Any], Any], kw: dict[str, Any]) -> None:
    samples, algo = _samples(), _algo(**kw)
    objective = make(algo)
    w = torch.randn(H, V, generator=torch.Generator().manual_seed(1))
    want = _reference(objective, samples, algo, w)
    n_tokens = sum(len(s["response"]) for s in samples)
    for budget in (1, 9, 17, 30, 64, 10_000):
        micro = list(common.weighted_updates(samples, algo, objective, budget))
        for update in micro:
            assert all(common.sample_tokens(s) <= budget or len(m.samples) == 1 for m in update for s in m.samples)
        _close(_run(objective, micro, w), want, n_tokens)


def _threads(ranks: int, fn: Callable[[int], Any], monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """``fn(rank)`` on ``ranks`` threads whose ``common._dp_reduce`` all-reduces across them."""
    barrier = threading.Barrier(ranks)
    slots: list[float] = [0.0] * ranks
    local = threading.local()

    def reduce(value: float, group: Any, device: Any, op: str) -> float:
        slots[local.rank] = value
        barrier.wait()
        out = sum(slots) if op == "SUM" else max(slots)
        barrier.wait()
        return out

    monkeypatch.setattr(common, "_dp_reduce", reduce)
    monkeypatch.setattr(common, "_dp_size", lambda group: ranks)
    results: list[Any] = [None] * ranks
    errors: list[BaseException] = []

    def run(r: int) -> None:
        local.rank = r
        try:
            results[r] = fn(r)
        except BaseException as e:  # surfaced below, not lost in the thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return results


@pytest.mark.parametrize(("name", "make", "kw"), [OBJECTIVES[0], OBJECTIVES[1], OBJECTIVES[2], OBJECTIVES[9]],
                         ids=[OBJECTIVES[i][0] for i in (0, 1, 2, 9)])
def test_two_data_parallel_ranks_average_to_the_global_batch(name: str, make: Callable[[Any], Any],
                                                              kw: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank holds half of every mini-batch (a contiguous share, as the scheduler hands them);
    the mean of the ranks' gradients is the gradient of the global mini-batch in one pass, and every
    rank runs the same number of micro-batches (FSDP's collectives need it)."""
    samples, algo = _samples(16, seed=3), _algo(**kw)
    objective = make(algo)
    w = torch.randn(H, V, generator=torch.Generator().manual_seed(2))
    # Global mini-batch m is the union of rank 0's and rank 1's mini-batch m.
    shares = [samples[0:4] + samples[8:12], samples[4:8] + samples[12:16]]
    glob = [s for m in range(2) for r in range(2) for s in shares[r][m * 4 : (m + 1) * 4]]
    want = _reference(objective, glob, algo, w)
    for budget in (9, 25, 10_000):
        micro = _threads(2, lambda r, b=budget: list(common.weighted_updates(shares[r], algo, objective, b)), monkeypatch)
        assert [len(u) for u in micro[0]] == [len(u) for u in micro[1]]
        got = [_run(objective, m, w) for m in micro]
        mean = (sum(g[0] for g in got) / 2, (got[0][1] + got[1][1]) / 2)
        _close(mean, want, sum(len(s["response"]) for s in samples))


def test_count_split_is_not_exact() -> None:
    """Today's split (grad_accum micro-batches, each loss a mean over itself, divided by grad_accum)
    differs from the unsplit pass by far more than the tolerance: the equality tests can fail."""
    samples, algo = _samples(), _algo(loss_agg="token")
    objective = PolicyObjective(algo)
    w = torch.randn(H, V, generator=torch.Generator().manual_seed(1))
    want = _reference(objective, samples, algo, w)
    got = _run(objective, list(common.weighted_updates(samples, algo, objective, 0)), w)
    tol = 8 * sum(len(s["response"]) for s in samples) * EPS32 * float(want[1].abs().max())
    assert float((got[1] - want[1]).abs().max()) > 100 * tol


def test_count_split_keeps_todays_weights() -> None:
    """Without a budget: grad_accum micro-batches by count, each loss divided by grad_accum."""
    samples, algo = _samples(), _algo()
    micro = list(common.weighted_updates(samples, algo, PolicyObjective(algo), 0))
    assert [[len(m.samples) for m in u] for u in micro] == [[2, 2, 2], [2, 2, 2]]
    assert all(m.divisor == 3 and m.weight == 1 / 3 and m.objective.denominator is None for u in micro for m in u)


def test_token_bins_respect_the_budget_and_keep_every_sample_once() -> None:
    g = torch.Generator().manual_seed(5)
    tokens = [int(t) for t in torch.randint(1, 40, (50,), generator=g)]
    for budget in (1, 10, 39, 60, 1000):
        bins = common.token_bins(tokens, budget)
        assert sorted(i for b in bins for i in b) == list(range(50))
        assert all(sum(tokens[i] for i in b) <= budget or len(b) == 1 for b in bins)
        assert all(b == sorted(b) for b in bins) and [b[0] for b in bins] == sorted(b[0] for b in bins)
        k = len(bins) + 3
        more = common.exactly(bins, tokens, k)
        assert len(more) == min(k, 50) and sorted(i for b in more for i in b) == list(range(50))
        assert all(sum(tokens[i] for i in b) <= budget or len(b) == 1 for b in more)


def test_a_rank_with_too_few_samples_repeats_one_with_zero_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 holds one sample, rank 0 three that need three micro-batches: rank 1 runs its sample
    and two zero-loss repeats, and the average is still the global batch's gradient."""
    samples, algo = _samples(4, seed=7), _algo(mini_batches=1)
    for s in samples:
        s.pop("loss_mask", None)
    objective = PolicyObjective(algo)
    w = torch.randn(H, V, generator=torch.Generator().manual_seed(4))
    shares = [samples[:3], samples[3:]]
    want = _reference(objective, samples, algo, w)
    micro = _threads(2, lambda r: list(common.weighted_updates(shares[r], algo, objective, 1)), monkeypatch)
    assert [len(u) for u in micro[0]] == [len(u) for u in micro[1]] == [3]
    assert [m.divisor for m in micro[1][0]] == [1.0, float("inf"), float("inf")]
    got = [_run(objective, m, w) for m in micro]
    _close((sum(g[0] for g in got) / 2, (got[0][1] + got[1][1]) / 2), want, sum(len(s["response"]) for s in samples))


def test_mask_correction_without_old_logprobs_is_refused_under_a_budget_with_no_forward_to_get_them() -> None:
    samples, algo = _samples(4), _algo(off_policy="mask", mini_batches=1)
    del samples[0]["old_logprobs"]
    with pytest.raises(ValueError, match="denominator is unknown before the forward"):
        list(common.weighted_updates(samples, algo, PolicyObjective(algo), 20))


@pytest.mark.parametrize("off_policy", ["mask", "tis"])
def test_a_first_mini_batch_without_old_logprobs_gets_them_from_a_forward_and_splits_exactly(off_policy: str) -> None:
    """On-policy first mini-batch (old = current) under an off-policy correction: the keep mask, so
    the loss's denominator, needs the old log-probs before the forward; a forward-only pass under
    the current weights supplies them, and the split equals the unsplit pass that used the detached
    current log-probs. Only the samples lacking them are computed; the caller's dicts are kept."""
    samples, algo = _samples(), _algo(off_policy=off_policy, mini_batches=2)
    for s in samples[:6]:  # the first mini-batch
        del s["old_logprobs"]
    objective = PolicyObjective(algo)
    w = torch.randn(H, V, generator=torch.Generator().manual_seed(1))
    want = _reference(objective, samples, algo, w)
    asked: list[int] = []

    def forward(batch: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        asked.append(len(batch))
        with torch.no_grad():
            logp = _batch(batch, w, objective).logp
        return [logp[b, : len(s["response"])] for b, s in enumerate(batch)]

    n_tokens = sum(len(s["response"]) for s in samples)
    for budget in (1, 17, 10_000):
        asked.clear()
        micro = list(common.weighted_updates(samples, algo, objective, budget, old_logprobs=forward))
        assert asked == [6]  # the first mini-batch only, once
        assert all("old_logprobs" in s for update in micro for m in update for s in m.samples)
        _close(_run(objective, micro, w), want, n_tokens)
    assert all("old_logprobs" not in s for s in samples[:6])


def test_balance_tokens_keeps_mini_batches_and_counts_and_evens_tokens() -> None:
    """Each global mini-batch (a consecutive slice of the rollouts) reaches the shards in equal
    counts, its tokens spread within one sample's length, and a shard's m-th slice is its part of
    global mini-batch m, in rollout order."""
    from rlbatch.loop.controller import balance_tokens, split_even

    g = torch.Generator().manual_seed(11)
    for trial in range(30):
        shards, mbs = 1 + trial % 4, 1 + trial % 3
        n = shards * mbs * int(torch.randint(1, 6, (1,), generator=g))
        ids = list(range(100, 100 + n))
        tokens = {i: int(torch.randint(1, 200, (1,), generator=g)) for i in ids}
        parts = balance_tokens(ids, tokens, shards, mbs)
        assert sorted(i for p in parts for i in p) == ids
        per = n // (shards * mbs)
        for m, mb in enumerate(split_even(ids, mbs)):
            share = [p[m * per : (m + 1) * per] for p in parts]
            assert sorted(i for s in share for i in s) == mb
            assert all(s == sorted(s) for s in share)
            load = [sum(tokens[i] for i in s) for s in share]
            assert max(load) - min(load) <= max(tokens[i] for i in mb), (load, trial)


def _pipe(backend: str, engine_args: dict[str, Any], held: dict[int, int], mini_batches: int = 2,
          device: str = "cpu") -> Any:
    from rlbatch.placement import place

    cfg = {"cluster": {"gpus_per_node": 8}, "roles": {
        "actor_train": {"device_mapping": [0, 1], "backend": backend, "engine_args": engine_args},
        "actor_infer": {"device_mapping": [2], "backend": "hf:d1"}}}
    return SimpleNamespace(p=place(cfg), world=SimpleNamespace(members={"actor_train": (0, 1), "actor_infer": (2,)}),
                           holder=lambda ids, field="response": {i: held[i] for i in ids},
                           cfg=SimpleNamespace(algo=SimpleNamespace(mini_batches=mini_batches, critic_lr=None),
                                               cluster=SimpleNamespace(device=device)))


def test_a_token_budget_spreads_the_trainers_samples_by_tokens_and_reports_the_imbalance() -> None:
    from rlbatch.loop.controller import Role, Rollouts, Training, assign_local_first, token_imbalance

    ids = list(range(16))
    plen = dict.fromkeys(ids, 4)
    rlen = {i: (60 if i < 8 else 2) for i in ids}  # the long responses come first: a count split is lopsided
    ro = Rollouts(ids, ["a"] * 16, 4, plen, rlen)
    tokens = {i: plen[i] + rlen[i] for i in ids}
    held = dict.fromkeys(ids, 2)

    plain = Role(_pipe("fsdp:d2", {}, held), "actor_train")  # type: ignore[arg-type]
    assert plain._assign(ro) == {(0,): assign_local_first(ids, (0, 1), {})[0], (1,): assign_local_first(ids, (0, 1), {})[1]}
    assert token_imbalance(plain._assign(ro), tokens) > 1.4

    # unset: the device's default, padded on the CPU and packed on a GPU
    assert not Role(_pipe("fsdp:d2", {}, held, device="cpu"), "actor_train")._balance  # type: ignore[arg-type]
    assert Role(_pipe("fsdp:d2", {}, held, device="cuda"), "actor_train")._balance  # type: ignore[arg-type]
    assert not Role(_pipe("fsdp:d2", {"max_tokens_per_micro_batch": 0}, held, device="cuda"), "actor_train")._balance  # type: ignore[arg-type]

    role = Role(_pipe("fsdp:d2", {"max_tokens_per_micro_batch": 128}, held), "actor_train")  # type: ignore[arg-type]
    assign = role._assign(ro)
    assert [len(v) for v in assign.values()] == [8, 8]
    assert token_imbalance(assign, tokens) == 1.0
    pending = SimpleNamespace(result=lambda: {0: {"pg_loss": 1.0}, 1: {"pg_loss": 3.0}})
    assert Training(pending, [0, 1], token_imbalance(assign, tokens)).result() == {"pg_loss": 2.0, "token_imbalance": 1.0}  # type: ignore[arg-type]


def test_forward_chunks_keep_order_and_budget_and_match_across_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward-only passes: consecutive runs within the budget, every rank the same number of
    forwards (rank 1 has one long sample, so it repeats it), the outputs' first len(samples)
    entries are the samples in order."""
    short = _samples(9, seed=2)
    long = [_samples(1, seed=4)[0]]
    long[0]["response"] = torch.zeros(40, dtype=torch.long)
    shares = [short, long]
    budget = 20

    def run(r: int) -> list[list[dict[str, torch.Tensor]]]:
        return common.chunks(shares[r], common.Split(0, budget, group="dp"))

    out = _threads(2, run, monkeypatch)
    assert len(out[0]) == len(out[1]) >= 2
    for r, ch in enumerate(out):
        flat = [int(s["id"]) for c in ch for s in c]
        assert flat[: len(shares[r])] == [int(s["id"]) for s in shares[r]]
        assert all(sum(common.sample_tokens(s) for s in c) <= budget or len(c) == 1 for c in ch)
    assert out[1][1:] == [long] * (len(out[1]) - 1)
    assert common.chunks(short, common.Split(4)) == common.chunks(short, 4) == [short[0:4], short[4:8], short[8:]]
