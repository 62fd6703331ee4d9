"""Algorithm parts come from registries by name; the objective an engine minimises is assembled
from them and equals the hand-written sum of its terms."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rlbatch.algos import core
from rlbatch.algos.objective import LossInput, PolicyObjective
from rlbatch.algos.registry import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, LOOPS, POLICY_LOSSES, Registry
from rlbatch.config.schema import AlgoConfig
from rlbatch.engines.batch import pack


def test_registries_name_their_field_and_entries() -> None:
    assert ADVANTAGES.problem("grpo") is None
    msg = KL_ESTIMATORS.problem("k9")
    assert msg is not None and "algo.kl_estimator" in msg and "k3" in msg
    assert LOOPS.problem("ppo") is None and LOOPS.problem("dpo") is not None
    with pytest.raises(KeyError, match="registered"):
        AGGREGATIONS.get("mean")


def test_register_adds_an_entry_by_callable_or_path() -> None:
    r = Registry("thing", "algo.thing", {"a": "rlbatch.algos.core:masked_mean"})
    r.register("b", lambda x: x + 1)
    assert r.names() == ["a", "b"] and r.get("b")(1) == 2 and r.get("a") is core.masked_mean


def test_registry_import_needs_no_torch() -> None:
    code = "import sys, rlbatch.algos.registry; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def _batch(T: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, T, 7, generator=g, requires_grad=True)
    targets = torch.randint(0, 7, (3, T), generator=g)
    logp = core.token_logprobs(logits, targets)
    old = logp.detach() + 0.1 * torch.randn(3, T, generator=g)
    ref = logp.detach() - 0.05
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    return logits, logp, old, ref, mask


@pytest.mark.parametrize("agg", ["token", "seq"])
def test_objective_is_policy_loss_plus_kl_minus_entropy(agg: str) -> None:
    algo = AlgoConfig(kl_coef=0.3, entropy_coef=0.02, loss_agg=agg, kl_estimator="k3", clip_low=0.2, clip_high=0.28)
    logits, logp, old, ref, mask = _batch()
    adv = torch.tensor([1.0, -0.5, 2.0])[:, None].expand_as(logp)
    loss, stats = PolicyObjective(algo)(LossInput(logp, mask, adv, {"old_logprobs": old, "ref_logprobs": ref}, logits))
    pg, _ = core.ppo_clip_loss(logp, old, adv, mask, 0.2, 0.28, agg)  # type: ignore[arg-type]
    kl = core.aggregate(core.kl_penalty(logp, ref, "k3"), mask, agg)  # type: ignore[arg-type]
    ent = core.aggregate(core.entropy_from_logits(logits), mask, agg)  # type: ignore[arg-type]
    expected = pg + 0.3 * kl - 0.02 * ent
    assert torch.allclose(loss, expected) and stats["kl_ref"] == pytest.approx(kl.item())
    assert stats["entropy"] == pytest.approx(ent.item()) and stats["pg_loss"] == pytest.approx(pg.item())


def test_kl_in_reward_leaves_the_loss_alone() -> None:
    logits, logp, old, ref, mask = _batch()
    adv = torch.ones_like(logp)
    x = LossInput(logp, mask, adv, {"old_logprobs": old, "ref_logprobs": ref})
    with_kl, stats = PolicyObjective(AlgoConfig(kl_coef=0.3, kl_in_reward=True))(x)
    plain, _ = PolicyObjective(AlgoConfig(kl_coef=0.0))(x)
    assert torch.equal(with_kl, plain) and "kl_ref" not in stats


def test_per_token_advantages_reach_the_loss() -> None:
    """A sample may carry per-token advantages (GAE, REINFORCE++): they are packed response-aligned
    and used token by token; a per-sequence advantage is broadcast over its tokens."""
    samples = [{"prompt": torch.tensor([4, 5]), "response": torch.tensor([6, 7, 8]),
                "advantages": torch.tensor([1.0, -1.0, 0.5])},
               {"prompt": torch.tensor([4]), "response": torch.tensor([9]), "advantages": torch.tensor([2.0])}]
    b = pack(samples, 0, torch.device("cpu"))
    assert torch.equal(b.token_advantages(), torch.tensor([[1.0, -1.0, 0.5], [2.0, 0.0, 0.0]]))
    scalar = [{"prompt": s["prompt"], "response": s["response"], "advantage": torch.tensor(float(k))}
              for k, s in enumerate(samples)]
    assert torch.equal(pack(scalar, 0, torch.device("cpu")).token_advantages()[0], torch.zeros(3))
    assert torch.equal(pack(scalar, 0, torch.device("cpu")).token_advantages()[1], torch.ones(3))


def test_registered_policy_loss_and_kl_are_the_core_functions() -> None:
    _, logp, old, ref, mask = _batch()
    algo = AlgoConfig()
    a, _ = POLICY_LOSSES.get("ppo_clip")(logp, old, torch.ones_like(logp), mask, algo, "token")
    b, _ = core.ppo_clip_loss(logp, old, torch.ones_like(logp), mask, algo.clip_low, algo.clip_high, "token")
    assert torch.equal(a, b)
    for k in ("k1", "k2", "k3", "abs"):
        assert torch.equal(KL_ESTIMATORS.get(k)(logp, ref), core.kl_penalty(logp, ref, k))  # type: ignore[arg-type]
    assert torch.equal(ADVANTAGES.get("grpo")(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, algo),
                       core.grpo_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, algo.adv_eps))
