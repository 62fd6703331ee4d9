"""PPO's critic side by hand: GAE, the clipped value loss, explained variance, the value objective,
the value model built from the policy, and the phases/validation that make PPO a program."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlbatch.algos.value import ValueInput, ValueObjective, explained_variance, gae, gae_estimator, value_loss

T = torch.tensor


def close(a: torch.Tensor | float, b: list[float] | float, tol: float = 1e-6) -> None:
    a = torch.as_tensor(a, dtype=torch.float64)
    assert torch.allclose(a, torch.as_tensor(b, dtype=torch.float64), atol=tol, rtol=0), (a, b)


def written_out_gae(r: list[float], v: list[float], gamma: float, lam: float) -> list[float]:
    """GAE as its definition: A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t."""
    n = len(r)
    delta = [r[t] + gamma * (v[t + 1] if t + 1 < n else 0.0) - v[t] for t in range(n)]
    return [sum((gamma * lam) ** k * delta[t + k] for k in range(n - t)) for t in range(n)]


def test_gae_matches_hand_values() -> None:
    # t=2: 1 - 0.8 = 0.2; t=1: 0.9*0.8 - 0.2 + 0.72*0.2 = 0.664; t=0: 0.9*0.2 - 0.5 + 0.72*0.664 = 0.15808
    adv, ret = gae([T([0.0, 0.0, 1.0])], [T([0.5, 0.2, 0.8])], gamma=0.9, lam=0.8)
    close(adv[0], [0.15808, 0.664, 0.2])
    close(ret[0], [0.65808, 0.864, 1.0])


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.0), (0.99, 0.95), (0.5, 0.3)])
def test_gae_equals_its_written_out_sum(gamma: float, lam: float) -> None:
    g = torch.Generator().manual_seed(0)
    rewards = [torch.randn(n, generator=g) for n in (1, 4, 7)]
    values = [torch.randn(n, generator=g) for n in (1, 4, 7)]
    adv, ret = gae(rewards, values, gamma, lam)
    for r, v, a, R in zip(rewards, values, adv, ret, strict=True):
        close(a, written_out_gae(r.tolist(), v.tolist(), gamma, lam), 1e-5)
        close(R, (a + v).tolist(), 1e-5)


def test_gae_special_cases() -> None:
    r, v = T([0.0, 0.0, 2.0]), T([0.3, 0.1, -0.4])
    mc, _ = gae([r], [v], 1.0, 1.0)  # lam=1, gamma=1: the return minus the value
    close(mc[0], [2.0 - 0.3, 2.0 - 0.1, 2.0 + 0.4])
    td, _ = gae([r], [v], 1.0, 0.0)  # lam=0: one-step TD errors
    close(td[0], [0.1 - 0.3, -0.4 - 0.1, 2.0 + 0.4])
    empty_adv, empty_ret = gae([torch.zeros(0)], [torch.zeros(0)], 1.0, 0.95)
    assert empty_adv[0].numel() == 0 and empty_ret[0].numel() == 0
    with pytest.raises(ValueError, match="3 per-token rewards but 2 values"):
        gae([r], [T([0.0, 0.0])], 1.0, 1.0)


def algo(**kw: float | bool | str) -> SimpleNamespace:
    base = {"kl_coef": 0.1, "gamma": 1.0, "lam": 1.0, "whiten_advantages": False, "adv_eps": 1e-8,
            "loss_agg": "token", "value_clip": 0.2}
    return SimpleNamespace(**(base | kw))


def test_gae_estimator_puts_the_reward_on_the_last_token_and_the_kl_on_every_token() -> None:
    kl = [T([0.5, 1.0]), T([2.0])]
    values = [T([0.0, 0.0]), T([0.0])]
    adv, ret = gae_estimator(T([1.0, 0.0]), 1, algo(), lengths=[2, 1], kl=kl, values=values)
    # sample 0: per-token rewards [-0.05, 1 - 0.1]; returns-to-go [0.85, 0.9]
    close(ret[0], [0.85, 0.9])
    close(ret[1], [-0.2])
    close(adv[0], [0.85, 0.9])  # values are zero: advantages are the returns
    white, _ = gae_estimator(T([1.0, 0.0]), 1, algo(whiten_advantages=True), lengths=[2, 1], kl=kl, values=values)
    flat = torch.cat(white)
    close(flat.mean(), 0.0, 1e-6)
    close(flat.std(), 1.0, 1e-5)
    with pytest.raises(ValueError, match="needs the critic's values"):
        gae_estimator(T([1.0]), 1, algo(), lengths=[1])


def test_value_loss_clips_against_the_old_values() -> None:
    values, old, returns = T([[1.0, 0.0, 0.5]]), T([[0.5, 0.0, 0.45]]), T([[2.0, 1.0, 0.0]])
    mask = torch.ones(1, 3)
    per_token, clipped = value_loss(values, old, returns, mask, clip=0.2)
    # token 0: unclipped (1-2)^2 = 1; clipped 0.7 -> (0.7-2)^2 = 1.69: the larger one counts
    # token 1: no move, both 1; token 2: clipped 0.5 -> same 0.25 (inside the clip range)
    close(per_token, [[0.5 * 1.69, 0.5 * 1.0, 0.5 * 0.25]])
    close(clipped, [[1.0, 0.0, 0.0]])
    plain, none = value_loss(values, old, returns, mask, clip=0.0)
    close(plain, [[0.5, 0.5, 0.125]])
    assert none.sum() == 0


def test_value_objective_aggregates_over_response_tokens_and_reports_stats() -> None:
    values = T([[1.0, 3.0], [2.0, 9.0]]).requires_grad_()
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    fields = {"returns": T([[0.0, 1.0], [2.0, 0.0]]), "values": T([[1.0, 3.0], [2.0, 9.0]])}
    loss, stats = ValueObjective(algo(value_clip=0.0))(ValueInput(values, mask, fields))
    close(loss.item(), (0.5 * 1 + 0.5 * 4 + 0.0) / 3)  # token mean over the 3 response tokens
    close(stats["value_mean"], 2.0)
    loss.backward()
    assert values.grad is not None and values.grad[1, 1] == 0  # padding takes no gradient
    with pytest.raises(ValueError, match="returns"):
        ValueObjective(algo())(ValueInput(values, mask, {}))


def test_explained_variance() -> None:
    returns = [T([1.0, 2.0]), T([3.0])]
    close(explained_variance(returns, returns), 1.0)
    close(explained_variance([T([2.0, 2.0]), T([2.0])], returns), 0.0)  # the mean: explains nothing
    assert explained_variance([T([0.0, 0.0]), T([9.0])], returns) < 0
    assert explained_variance([T([1.0])], [T([1.0])]) != explained_variance([T([1.0])], [T([1.0])])  # nan


def test_value_model_starts_from_the_policy_with_a_zero_head() -> None:
    from rlbatch.config.compose import compose
    from rlbatch.engines import training as common
    from rlbatch.engines.batch import pack
    from rlbatch.engines.model import load_model, load_tokenizer, value_model

    cfg = compose([])
    tok = load_tokenizer(cfg.model)
    lm = load_model(cfg.model, tok, seed=3)
    critic = value_model(lm)
    body = {k: v for k, v in lm.state_dict().items() if k.startswith("model.")}
    for k, v in critic.state_dict().items():
        if k.startswith("model."):
            assert torch.equal(v, body[k]), k
    assert {k for k in critic.state_dict() if not k.startswith("model.")} == {"score.weight", "score.bias"}
    samples = [{"prompt": T([4, 5, 6]), "response": T([7, 8])}, {"prompt": T([4, 9]), "response": T([10, 11, 12])}]
    packed = lambda chunk: pack(chunk, tok.pad_token_id, torch.device("cpu"))  # noqa: E731
    zero = common.values(critic, samples, 0, packed)
    assert [v.tolist() for v in zero] == [[0.0, 0.0], [0.0, 0.0, 0.0]]
    # Values are read at the positions whose logits score each response token: P - 1 + j.
    with torch.no_grad():
        critic.score.weight.normal_(generator=torch.Generator().manual_seed(1))
        critic.score.bias.fill_(0.25)
        vals = common.values(critic, samples, 1, packed)
        for s, v in zip(samples, vals, strict=True):
            ids = torch.cat([s["prompt"], s["response"]])[None]
            per_pos = critic(input_ids=ids).logits[0, :, 0]
            p = len(s["prompt"])
            close(v, per_pos[p - 1 : p - 1 + len(s["response"])].tolist(), 1e-5)


def test_ppo_phases_run_values_and_critic_training() -> None:
    from rlbatch.phases import step_phases

    names = step_phases(kl_to_reference=True, has_reference=True, critic=True, reuse_batch=False, kl_in_reward=True)
    assert names == ["generate", "score", "ref_logprobs", "values", "old_logprobs", "critic_train", "train", "sync"]
    assert "values" not in step_phases(kl_to_reference=True, has_reference=True, critic=False, reuse_batch=False,
                                       kl_in_reward=False)


def test_critic_learning_rate_is_its_own() -> None:
    from rlbatch.config.schema import AlgoConfig, role_algo

    a = AlgoConfig(lr=1e-3, critic_lr=5e-3)
    assert role_algo("critic", a).lr == 5e-3 and role_algo("actor_train", a).lr == 1e-3
    assert role_algo("critic", AlgoConfig(lr=1e-3)).lr == 1e-3


def test_reward_model_scores_each_sequence_at_its_last_token_like_transformers() -> None:
    from rlbatch.config.compose import compose
    from rlbatch.engines import training as common
    from rlbatch.engines.batch import pack
    from rlbatch.engines.model import load_model, load_tokenizer, reward_model

    cfg = compose([])
    tok = load_tokenizer(cfg.model)
    lm = load_model(cfg.model, tok, seed=3)
    rm = reward_model(lm, seed=5)
    assert torch.equal(rm.model.embed_tokens.weight, lm.model.embed_tokens.weight)
    assert torch.equal(rm.score.weight, reward_model(lm, seed=5).score.weight)  # the head comes from the seed
    samples = [{"prompt": T([4, 5, 6]), "response": T([7, 8])}, {"prompt": T([4, 9]), "response": T([10, 11, 12, 13])}]
    packed = lambda chunk: pack(chunk, tok.pad_token_id, torch.device("cpu"))  # noqa: E731
    got = common.scores(rm, samples, 0, packed)
    with torch.no_grad():
        want = [rm(input_ids=torch.cat([s["prompt"], s["response"]])[None]).logits[0, 0].item() for s in samples]
    close(T(got), want, 1e-5)
    assert len(set(got)) == 2


def test_model_scorer_weighs_the_model_and_the_rule() -> None:
    from rlbatch.config.compose import compose
    from rlbatch.rewards.model import ModelScorer

    class Engine:
        def scores(self, samples: list[dict[str, torch.Tensor]]) -> list[float]:
            return [float(len(s["response"])) for s in samples]

    cfg = compose(["reward_model.model_weight=0.5", "reward_model.rule_weight=2",
                   "data.reward_fn=rlbatch.rewards.rules:exact_match"])
    tok = object()
    score = ModelScorer(Engine(), tok, tok, cfg)
    rewards, _ = score([T([1]), T([1])], [T([5, 6]), T([5, 6, 7, 8])], ["3", "4"], ["3", "5"])
    assert rewards == [0.5 * 2 + 2 * 1.0, 0.5 * 4 + 0.0]


def test_a_critic_starts_from_its_own_directory(tmp_path: Path) -> None:
    from rlbatch.config.compose import compose
    from rlbatch.config.schema import ModelConfig
    from rlbatch.engines.model import load_engine_model, load_model, load_tokenizer, value_model
    from rlbatch.models.spec import spec_from_config
    from rlbatch.models.tiny import build_tiny_model

    cfg = compose([])
    tok = load_tokenizer(cfg.model)
    trained = value_model(load_model(cfg.model, tok, seed=3))
    with torch.no_grad():
        trained.score.weight.fill_(0.5)
    trained.save_pretrained(tmp_path / "critic")  # what `rlbatch.export --role critic` writes
    lm = load_model(cfg.model, tok, seed=4)
    lm.save_pretrained(tmp_path / "lm")

    def ctx(path: Path) -> SimpleNamespace:
        return SimpleNamespace(head="value", model=ModelConfig(path=str(path)), tokenizer=tok, seed=9)

    loaded = load_engine_model(ctx(tmp_path / "critic"))
    assert all(torch.equal(v, trained.state_dict()[k]) for k, v in loaded.state_dict().items())
    body = load_engine_model(ctx(tmp_path / "lm"))  # a causal LM: its body, the head at zero
    assert torch.equal(body.model.embed_tokens.weight, lm.model.embed_tokens.weight)
    assert body.score.weight.abs().sum() == 0
    small = build_tiny_model(spec_from_config({}, vocab=8), seed=0)
    small.save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match=r"embeds 8 tokens, but the policy's tokenizer has \d+"):
        load_engine_model(ctx(tmp_path / "small"))


def test_an_engine_is_not_built_for_a_head_it_does_not_have(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from rlbatch.engines import registry
    from rlbatch.engines.base import build_engine
    from rlbatch.engines.registry import spec_of

    assert all(spec_of(e).heads == ("lm", "value", "reward") for e in ("fsdp", "deepspeed", "megatron"))
    # An engine that builds only the policy's head (a plugin, say) refuses a critic before building.
    monkeypatch.setitem(registry.REGISTRY, "megatron", dataclasses.replace(spec_of("megatron"), heads=("lm",)))
    with pytest.raises(NotImplementedError, match="engine 'megatron', role critic: a value head is not built"):
        build_engine("megatron", SimpleNamespace(head="value", role="critic"))  # type: ignore[arg-type]
