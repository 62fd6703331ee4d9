"""Observations as chat messages (rlbatch.envs.chat, ``data.chat_template=true`` with an env): a
rollout's tokens equal ``apply_chat_template`` of the conversation, turn by turn, whether a turn
ended with its EOS or was cut; templates that cannot be extended turn by turn are refused."""

from __future__ import annotations

from typing import Any

import pytest

from rlbatch.config.parse import parse, parsed
from rlbatch.engines.base import Generation, SamplingParams, TurnRequest
from rlbatch.envs.base import StepResult
from rlbatch.envs.chat import ChatTurns, PlainText
from rlbatch.envs.checks import env_problems
from rlbatch.envs.episode import Episode, EpisodeLimits
from rlbatch.envs.rollout import Rollout, Start
from rlbatch.errors import ConfigError
from tests.unit.chat_fixtures import BOS_CHAT, CHATML, chat_tokenizer

TOK = chat_tokenizer()
EOS = TOK.eos_token_id


def ids(text: str, tok: Any = TOK) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def templated(messages: list[dict[str, str]], tok: Any = TOK) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True)["input_ids"])


class Shown:
    """An env that shows three observations and ends after the third action."""

    def reset(self, task: Any, seed: int) -> str:
        self.n = 0
        return "3="

    def step(self, action: str) -> StepResult:
        self.n += 1
        return StepResult(["+5=", "+4=", ""][self.n - 1], 1.0, self.n == 3)


class Scripted:
    """Turns: answers every request of a trajectory with the next of ``turns``; keeps the contexts."""

    def __init__(self, turns: list[list[int]]) -> None:
        self.turns, self.pending, self.contexts = turns, [], []  # type: ignore[var-annotated]

    def submit(self, requests: list[TurnRequest], params: SamplingParams) -> None:
        for r in requests:
            turn = self.turns[len(self.contexts)]
            self.contexts.append(list(r.tokens))
            self.pending.append((r.key, Generation(turn, [-0.5] * len(turn))))

    def poll(self, block: bool = True) -> list[tuple[int, Generation]]:
        out, self.pending = self.pending, []
        return out

    def in_flight(self) -> int:
        return len(self.pending)


def play(observations: Any, prompt: list[int], turns: list[list[int]]) -> tuple[Any, Scripted]:
    engine = Scripted(turns)
    decode = lambda t: str(TOK.decode(t, skip_special_tokens=False))  # noqa: E731
    [traj] = Rollout(engine, observations, decode, SamplingParams(4)).run(
        [Start(0, prompt, Episode(Shown, EpisodeLimits(8, 10.0)), {}, 0)])
    return traj, engine


def test_a_chat_rollout_is_the_templated_conversation_token_for_token() -> None:
    # turn 1 stops with its EOS, turn 2 is cut at max_new_tokens (no EOS), turn 3 stops
    turns = [ids("3") + [EOS], ids("8"), ids("2") + [EOS]]
    traj, engine = play(ChatTurns(TOK, system_prompt="You are a helpful assistant."), [], turns)
    conversation = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "3="}]
    assert traj.prompt == templated(conversation)
    for turn, (reply, observation) in enumerate([("3", "+5="), ("8", "+4=")], start=1):
        conversation += [{"role": "assistant", "content": reply}, {"role": "user", "content": observation}]
        assert engine.contexts[turn] == templated(conversation), turn  # what the policy read before its next turn
    assert traj.prompt + traj.response == templated(conversation) + turns[2]
    generated = [t for t, m in zip(traj.response, traj.loss_mask, strict=True) if m]
    assert generated == [t for turn in turns for t in turn]
    assert traj.observed == len(traj.response) - len(generated)


def test_an_observation_after_a_rendered_task_prompt_is_a_message_of_its_own() -> None:
    question = [{"role": "user", "content": "Natalia sold clips in April."}]
    traj, _ = play(ChatTurns(TOK, role="tool"), templated(question), [ids("3") + [EOS]] * 3)
    assert traj.prompt == templated([*question, {"role": "tool", "content": "3="}])


def test_a_template_that_writes_the_bos_opens_once() -> None:
    tok = chat_tokenizer(BOS_CHAT, bos=True)
    turns = ChatTurns(tok)
    prompt = turns.opening(list(tok("")["input_ids"]), "3=")
    assert prompt == templated([{"role": "user", "content": "3="}], tok)
    assert prompt.count(tok.bos_token_id) == 1


def test_plain_text_observations_are_their_tokens_alone() -> None:
    traj, _ = play(PlainText(ids), [], [ids("3") + [EOS]] * 3)
    assert traj.prompt == ids("3=")
    assert traj.response == ids("3") + [EOS] + ids("+5=") + ids("3") + [EOS] + ids("+4=") + ids("3") + [EOS]


def test_a_template_that_rewrites_earlier_turns_is_refused() -> None:
    # past assistant turns lose their text (as reasoning templates drop past thinking)
    forgetful = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                 "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ConfigError, match=r"data.chat_template: .* cannot render observations turn by turn"):
        ChatTurns(chat_tokenizer(forgetful))
    assert ChatTurns(chat_tokenizer(CHATML)).closing == "<|im_end|>\n"


def test_the_observation_role_is_checked_before_start() -> None:
    env = {"name": "running_sum"}
    assert env_problems(parse({"env": env | {"observation_role": "tool"}, "data": {"chat_template": True}}).config,
                        load=False) == []
    [bad] = env_problems(parse({"env": env | {"observation_role": "tool\n<|im_start|>"}}).config, load=False)
    assert bad.startswith("env.observation_role: expected a message role")
    [plain] = env_problems(parse({"env": env | {"observation_role": "tool"}, "data": {"chat_template": False}}).config,
                           load=False)
    assert "data.chat_template=false" in plain


def test_a_run_with_a_chat_model_plays_running_sum_as_a_conversation(tmp_path: Any) -> None:
    """``data.chat_template=true`` with ``env.name``: the hf engine plays running_sum with a tiny
    ChatML model saved with its tokenizer; every observation between two turns is the template's
    end of the assistant's message (what its EOS left), a user message and the generation prompt."""
    import torch

    from rlbatch.config.compose import compose
    from rlbatch.data.source import problems_of
    from rlbatch.engines.base import EngineContext, turns_of
    from rlbatch.engines.hf import HFArgs
    from rlbatch.engines.hf.engine import HFInferenceEngine
    from rlbatch.engines.model import load_tokenizer
    from rlbatch.envs.trajectories import MultiTurn, episode_seed
    from tests.unit.chat_fixtures import save_chat_model

    cfg = compose(["experiment=multiturn", f"model.path={save_chat_model(tmp_path / 'chat')}", "data.chat_template=true",
                   "data.system_prompt=Add up.", "algo.max_new_tokens=2"])
    assert [s.prompt for s in problems_of(cfg.data, cfg.model)] == [""]  # the rollout renders the opening
    tok = load_tokenizer(cfg.model)
    engine = HFInferenceEngine(EngineContext("actor_infer", HFArgs(), cfg.model, cfg.algo, tok, torch.device("cpu"), seed=1))
    [traj] = MultiTurn(parsed(cfg), tok)(turns_of(engine), [[]], SamplingParams(2, temperature=1.0), [{}],
                                           [episode_seed(1, 0)], seed=3)
    assert tok.decode(traj.prompt).startswith("<|im_start|>system\nAdd up.<|im_end|>\n<|im_start|>user\n")
    assert tok.decode(traj.prompt).endswith("=<|im_end|>\n<|im_start|>assistant\n")
    runs: list[tuple[int, list[int]]] = []  # (loss_mask value, tokens) runs of the response
    for t, m in zip(traj.response, traj.loss_mask, strict=True):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(t)
        else:
            runs.append((m, [t]))
    observations = [(runs[i - 1][1], tokens) for i, (m, tokens) in enumerate(runs) if m == 0]
    assert len(observations) == traj.turns - 1 >= 1, (traj.turns, runs)
    for turn, tokens in observations:
        closing = "\n" if turn[-1] == tok.eos_token_id else "<|im_end|>\n"
        text = tok.decode(tokens)
        assert text.startswith(closing + "<|im_start|>user\n+") and text.endswith("=<|im_end|>\n<|im_start|>assistant\n"), text
