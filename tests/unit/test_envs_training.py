"""Trajectories as training samples (rlbatch.envs.trajectories): the tokens trained are exactly the
tokens the policy generated; the observations between its turns are in the sequence (the model
reads them) and out of every loss term and of the aggregation's denominator (loss_mask). The hf
engine plays running_sum; the tiny model scores the packed samples; the objective's gradient shows
which positions are trained. Also: the score phase's env scorer and the per-step trajectory metrics."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlbatch.algos.objective import LossInput, PolicyObjective
from rlbatch.algos.split import aggregation_count
from rlbatch.algos.value import ValueInput, ValueObjective
from rlbatch.config.compose import compose
from rlbatch.config.parse import parsed
from rlbatch.engines.base import EngineContext, Generation, SamplingParams, TurnRequest, turns_of
from rlbatch.engines.batch import pack, response_logprobs
from rlbatch.engines.model import load_tokenizer
from rlbatch.envs.scoring import env_scorer
from rlbatch.envs.trajectories import MultiTurn, episode_seed, sample_fields, summary, trajectory_stats


class Recorded:
    """An engine's ``Turns`` that keeps every turn it generated, by trajectory."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.generated = inner, {}  # type: ignore[var-annotated]

    def submit(self, requests: list[TurnRequest], params: SamplingParams) -> None:
        self.inner.submit(requests, params)

    def poll(self, block: bool = True) -> list[tuple[int, Generation]]:
        out = self.inner.poll(block)
        for key, gen in out:
            self.generated.setdefault(key, []).append(list(gen.tokens))
        return out

    def in_flight(self) -> int:
        return int(self.inner.in_flight())


@pytest.fixture(scope="module")
def played() -> tuple[Any, list[Any], dict[int, list[list[int]]], Any]:
    """Six running_sum trajectories (two groups of three: one episode start each) by the hf engine,
    and the engine's model (the policy that generated them)."""
    from rlbatch.engines.hf import HFArgs
    from rlbatch.engines.hf.engine import HFInferenceEngine

    cfg = compose(["experiment=multiturn"])
    tok = load_tokenizer(cfg.model)
    engine = HFInferenceEngine(EngineContext("actor_infer", HFArgs(), cfg.model, cfg.algo, tok, torch.device("cpu"), seed=1))
    recorder = Recorded(turns_of(engine))
    rollout = MultiTurn(parsed(cfg), tok)
    seeds = [episode_seed(1, g) for g in (0, 0, 0, 1, 1, 1)]
    prompt = list(tok("")["input_ids"])  # data.name=none: the first observation is the prompt
    trajectories = rollout(recorder, [prompt] * 6, SamplingParams(2, temperature=1.0), [{}] * 6, seeds, seed=3)
    return engine.model, trajectories, recorder.generated, tok


def test_the_positions_trained_are_exactly_the_generated_tokens(played: Any) -> None:
    model, trajectories, generated, tok = played
    samples = [sample_fields(t) for t in trajectories]
    for t, s in zip(trajectories, samples, strict=True):
        at = s["loss_mask"].bool()
        assert s["response"][at].tolist() == [x for turn in generated[t.key] for x in turn]  # every turn, in order
        assert t.observed > 0 and int((~at).sum()) == t.observed  # the env's tokens are there, masked
        assert s["behaviour_logprobs"][~at].eq(0).all() and s["behaviour_logprobs"][at].lt(0).all()
    # one group starts from one episode: its trajectories share the prompt (the first observation)
    assert samples[0]["prompt"].tolist() == samples[1]["prompt"].tolist() == samples[2]["prompt"].tolist()

    objective = PolicyObjective(compose(["experiment=multiturn"]).algo)

    def trained(batch_samples: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradient of the loss wrt each response token's log-prob, and the packed mask."""
        packed = pack([s | {"advantage": torch.tensor(1.0)} for s in batch_samples], tok.pad_token_id, torch.device("cpu"))
        logp, _, logits = response_logprobs(model, packed)
        logp.retain_grad()
        ref = {"ref_logprobs": packed.fields.get("behaviour_logprobs", torch.zeros_like(logp))}
        loss, _ = objective(LossInput(logp, packed.mask, packed.token_advantages(), packed.fields | ref, logits))
        loss.backward()
        assert logp.grad is not None
        return logp.grad, packed.mask

    grad, mask = trained(samples)
    want = torch.nn.utils.rnn.pad_sequence([s["loss_mask"] for s in samples], batch_first=True)
    assert torch.equal(grad.ne(0).float(), want)  # nothing of the env's tokens reaches the loss, KL or entropy
    assert aggregation_count(objective, samples) == sum(t.generated for t in trajectories)  # the token mean's denominator
    # without the mask the same batch trains the observations too: what the mask is for
    unmasked, _ = trained([{k: v for k, v in s.items() if k != "loss_mask"} for s in samples])
    assert bool((unmasked.ne(0) & (want == 0) & mask.bool()).any())


def test_the_critic_is_not_fit_on_observation_tokens() -> None:
    algo = compose([]).algo
    values = torch.zeros(1, 4, requires_grad=True)
    fields = {"returns": torch.ones(1, 4), "loss_mask": torch.tensor([[1.0, 0.0, 0.0, 1.0]])}
    loss, _ = ValueObjective(algo)(ValueInput(values, torch.ones(1, 4), fields))
    loss.backward()
    assert values.grad is not None and values.grad.ne(0).tolist() == [[True, False, False, True]]
    assert ValueObjective(algo).token_mask({"response": torch.zeros(4), "loss_mask": fields["loss_mask"][0]}).tolist() \
        == [1.0, 0.0, 0.0, 1.0]


def test_the_reward_is_the_env_s_plus_the_weighted_reward_fn_and_the_step_metrics(played: Any) -> None:
    _, trajectories, _, _ = played
    cfg = SimpleNamespace(env=SimpleNamespace(name="running_sum", reward_fn_weight=0.0),
                          data=SimpleNamespace(reward_fn="rlbatch.rewards:exact_match"))
    env_rewards = [t.reward for t in trajectories]
    got, _ = env_scorer(cfg)(["x"] * 6, ["7"] * 6, None, env_rewards=env_rewards)
    assert got == env_rewards
    cfg.env.reward_fn_weight = 0.5
    got, _ = env_scorer(cfg)(["7<eos>"] * 3 + ["3"] * 3, ["7"] * 6, None, env_rewards=env_rewards)
    assert got == [r + 0.5 * (k < 3) for k, r in enumerate(env_rewards)]
    with pytest.raises(ValueError, match="got 0 trajectory rewards for 6 responses"):
        env_scorer(cfg)(["x"] * 6, ["7"] * 6)

    stats = trajectory_stats({k: summary(t) for k, t in enumerate(trajectories)})
    assert stats["env/turns_mean"] == sum(t.turns for t in trajectories) / 6
    assert stats["env/turns_max"] == max(t.turns for t in trajectories)
    assert stats["tokens/generated"] == sum(t.generated for t in trajectories)
    assert stats["tokens/observed"] == sum(t.observed for t in trajectories)
    assert sum(v for k, v in stats.items() if k.startswith("env/end/")) == pytest.approx(1.0)
    assert stats["env/seconds"] > 0


class Unreachable:
    """An env whose every step fails (the service it asks is down)."""

    def __init__(self, turns: int = 3) -> None:
        self.turns = turns

    def reset(self, task: Any, seed: int) -> str:
        return "3="

    def step(self, action: str) -> Any:
        raise ConnectionError("no route to the grader at 10.0.0.7")


def test_a_round_in_which_every_trajectory_fails_stops_the_run_naming_the_first_failure() -> None:
    """Every episode ending in its env's error would train on rewards of 0 and exit 0: the round's
    rollouts refuse it instead (``all_failed``, raised by the controller when a round completes)."""
    from rlbatch.engines.hf import HFArgs
    from rlbatch.engines.hf.engine import HFInferenceEngine
    from rlbatch.envs.trajectories import all_failed

    cfg = compose(["experiment=multiturn", f"env.name={__name__}:Unreachable"])
    tok = load_tokenizer(cfg.model)
    engine = HFInferenceEngine(EngineContext("actor_infer", HFArgs(), cfg.model, cfg.algo, tok, torch.device("cpu"), seed=1))
    played = MultiTurn(parsed(cfg), tok)(turns_of(engine), [list(tok("")["input_ids"])] * 4, SamplingParams(2),
                                         [{}] * 4, [episode_seed(1, g) for g in (0, 0, 1, 1)], seed=3)
    episodes = {k + 10: summary(t) for k, t in enumerate(played)}
    assert all_failed(episodes) == (
        "every trajectory of the round (4) ended in a failure of env.name's environment (4 error); the first "
        "(sample 10): error: step raised ConnectionError: no route to the grader at 10.0.0.7")
    episodes[12] = episodes[12] | {"end": "done", "detail": ""}
    assert all_failed(episodes) is None  # one that ran: the env works, the policy has something to learn from
    assert all_failed({}) is None  # single-turn rollouts
