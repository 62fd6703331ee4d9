"""The compact tool-call format (``env.tool_call_format=compact``): parsed into the same calls and
outcomes as JSON, its bare form calling the episode's only tool; and experiment=tooluse's episode
written entirely in the tiny default model's alphabet, rewarded only through the lookup tool."""

from __future__ import annotations

from typing import Any

import pytest

from rlbatch.checks.validate import check
from rlbatch.config.compose import compose
from rlbatch.config.parse import parsed
from rlbatch.config.plain import to_plain
from rlbatch.data.tokenizer import EOS, char_vocab
from rlbatch.envs.lookup import Lookup
from rlbatch.envs.setup import EnvSetup
from rlbatch.envs.tools import Malformed, ToolCall, ToolCallFormat, run_call
from rlbatch.envs.trajectories import trajectory_stats
from tests.unit.configs import problems, set_

AT = ToolCallFormat("@", ";", "<r>", "</r>", "compact")


def test_compact_calls_are_named_or_bare_with_positional_and_keyword_text_arguments() -> None:
    assert AT.parse("@lookup(k3);") == [ToolCall("lookup", {}, ("k3",))]
    assert AT.parse("first @k3; then @add(1, b=2);") == [ToolCall("", {}, ("k3",)), ToolCall("add", {"b": "2"}, ("1",))]
    assert AT.parse("@now()") == [ToolCall("now", {})] and AT.parse("@") == [ToolCall("", {})]
    # the close tag may end the action; what follows the stop marker is not the action
    assert AT.parse("@key=k3<eos>@never;") == [ToolCall("", {"key": "k3"})]
    assert AT.parse("7<eos>") == [] and AT.parse("; only a close tag") == []
    assert AT.response("4711") == "<r>4711</r>"  # no newlines: every character is the model's to read
    assert ToolCallFormat().response("4711") == "<tool_response>\n4711\n</tool_response>"  # json as it was


@pytest.mark.parametrize(("action", "why"), [
    ("@lookup(k3;", "expected name(arguments), got 'lookup(k3'"),
    ("@a,,b;", "an empty argument in 'a,,b'"),
    ("@f(key=1, 2);", "positional argument '2' after a keyword argument"),
    ("@f(key=1, key=2);", "argument 'key' given twice"),
])
def test_a_malformed_compact_call_says_why(action: str, why: str) -> None:
    [call] = AT.parse(action)
    assert call == Malformed(why)
    assert run_call(call, {"f": lambda key: key}) == (f"error: malformed tool call: {why}", "malformed")


def lookup(key: str) -> str:
    return {"k1": "4711"}[key]


@pytest.mark.parametrize(("action", "tools", "outcome", "text"), [
    ("@k1", {"lookup": lookup}, "ok", "4711"),
    ("@lookup(key=k1)", {"lookup": lookup, "other": lookup}, "ok", "4711"),
    ("@k1", {"lookup": lookup, "other": lookup}, "unknown_tool",
     "error: a call without a tool name needs exactly one tool; tools: ['lookup', 'other']"),
    ("@search(k1)", {"lookup": lookup}, "unknown_tool", "error: unknown tool 'search'; tools: ['lookup']"),
    ("@k1, k2", {"lookup": lookup}, "bad_arguments", "error: tool 'lookup': too many positional arguments"),
    ("@", {"lookup": lookup}, "bad_arguments", "error: tool 'lookup': missing a required argument: 'key'"),
    ("@k9", {"lookup": lookup}, "tool_error", "error: tool 'lookup' raised KeyError: 'k9'"),
])
def test_compact_calls_have_the_json_outcomes(action: str, tools: dict[str, Any], outcome: str, text: str) -> None:
    [call] = AT.parse(action)
    got_text, got_outcome = run_call(call, tools)
    assert (got_outcome, got_text[:len(text)]) == (outcome, text)


def test_the_format_is_a_setting_checked_before_start(cfg: dict[str, Any]) -> None:
    c = set_(cfg, env__name="lookup", program="selftest", env__tool_call_format="xml")
    assert problems(c) == ["env.tool_call_format: expected one of ['json', 'compact'], got 'xml'"]
    with pytest.raises(ValueError, match="tool call format must be one of"):
        ToolCallFormat(syntax="xml")  # type: ignore[arg-type]


def preset_setup() -> EnvSetup:
    cfg = to_plain(compose(["experiment=tooluse"]))
    check(cfg, runnable=False)
    return EnvSetup(parsed(cfg))


def test_the_tooluse_episode_is_written_in_the_tiny_models_alphabet_and_pays_only_through_the_tool() -> None:
    setup, vocab = preset_setup(), char_vocab()  # the tiny model's: one token a character
    for seed in range(20):
        right, guess, wrong_key = setup.episode(), setup.episode(), setup.episode()
        question = right.start({}, seed).observation
        key = question[:-1]
        value = right.env.table[key]
        texts = [question, f"*{key}", right.step(f"*{key}").observation, f"{value}<eos>"]
        assert texts[2] == f"+{value}=", texts
        last = right.step(f"{value}<eos>")
        assert (last.reward, last.done, right.summary()["tool_calls"]) == (1.0, True, {"ok": 1})
        # every token of the right trajectory is one the tiny model can emit or read
        assert EOS in vocab and set("".join(texts).replace(EOS, "")) <= set(vocab), texts

        guess.start({}, seed)  # read_first: even the right value is not paid unread
        wrong = str(int(value) % 9 + 1)
        assert guess.step(f"{value}<eos>").reward == 0.0
        assert guess.summary()["tool_calls"] == {}
        wrong_key.start({}, seed)
        other = str((int(key) + 1) % 4)
        assert wrong_key.step(f"*{other}").observation == f"+{wrong_key.env.table[other]}="
        assert wrong_key.step(f"{wrong}<eos>").reward == 0.0  # looked up, but not the asked key

        found = setup.episode()
        found.start({}, seed)
        found.step(f"*{key}")
        assert found.step(f"{wrong}<eos>").reward == pytest.approx(setup.args["lookup_reward"])


def test_lookup_defaults_are_unchanged_and_bad_arguments_are_refused() -> None:
    env = Lookup()
    assert env.reset({}, 0).startswith("What is the value of k") and len(env.table) == 8
    assert env.step(f"{env.table[env.key]}<eos>").reward == 1.0  # a right guess is paid by default
    env.reset({}, 0)
    assert env.lookup(env.key) == env.table[env.key] and env.step("0<eos>").reward == 0.0  # no lookup_reward
    for bad in ({"question": "no key"}, {"key_prefix": 3}, {"lookup_reward": 1.0}, {"lookup_reward": -0.1},
                {"read_first": "yes"}):
        with pytest.raises(ValueError, match="lookup:"):
            Lookup(**bad)


def test_the_tool_call_rate_counts_trajectories_that_called() -> None:
    def ep(calls: dict[str, int]) -> dict[str, Any]:
        return {"turns": 1, "end": "done", "reward": 0.0, "env_seconds": 0.0, "generated": 2, "observed": 0,
                "tool_calls": calls}
    stats = trajectory_stats({0: ep({"ok": 2}), 1: ep({"malformed": 1}), 2: ep({}), 3: ep({"ok": 0})})
    assert (stats["env/tool_call_rate"], stats["env/tool_call_ok_rate"], stats["env/tool_calls/ok"]) == (0.5, 0.25, 2.0)
