"""Tool calls in actions: the documented format parsed (and its tags configurable), each failure an
observation with its outcome counted, never an exception; the python tool runs in the code sandbox."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import pytest

from rlbatch.config.parse import parse
from rlbatch.envs.base import StepResult, ToolError
from rlbatch.envs.episode import Episode, EpisodeLimits
from rlbatch.envs.python_tool import python_tool
from rlbatch.envs.tools import Malformed, ToolCall, ToolCallFormat, run_call
from tests.conftest import RUNS_ROOT

FMT = ToolCallFormat()


def test_the_qwen_format_is_parsed_with_several_calls_and_string_arguments() -> None:
    action = ('Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "k3"}}\n</tool_call>\n'
              '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call><|im_end|>')
    assert FMT.parse(action) == [ToolCall("lookup", {"key": "k3"}), ToolCall("add", {"a": 1, "b": 2})]
    assert FMT.parse('<tool_call>{"name": "now"}</tool_call>') == [ToolCall("now", {})]
    assert FMT.parse("7<eos>") == [] and FMT.parse("</tool_call> only a close tag") == []


@pytest.mark.parametrize(("action", "why"), [
    ("<tool_call>{not json}</tool_call>", "not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'expected a JSON object {"name"'),
    ('<tool_call>["lookup"]</tool_call>', 'expected a JSON object {"name"'),
    ('<tool_call>{"name": "lookup", "arguments": [1]}</tool_call>', "arguments: expected a JSON object, got list"),
    ('<tool_call>{"name": "lookup", "arguments": "{oops"}</tool_call>', "arguments: not JSON"),
    ('<tool_call>{"name": "lookup"}', "<tool_call> without </tool_call>"),
])
def test_a_malformed_call_says_why(action: str, why: str) -> None:
    [call] = FMT.parse(action)
    assert isinstance(call, Malformed) and why in call.why, call


def test_the_tags_are_configurable() -> None:
    fmt = ToolCallFormat("[[", "]]", "<<", ">>")
    assert fmt.parse('x [[{"name": "t", "arguments": {"v": 1}}]]') == [ToolCall("t", {"v": 1})]
    assert fmt.parse('<tool_call>{"name": "t"}</tool_call>') == []
    assert fmt.response("out") == "<<\nout\n>>"


def lookup(key: str) -> str:
    return {"k1": "4711"}[key]


def failing(key: str) -> str:
    raise ToolError(f"no entry {key}")


def not_text() -> str:
    return 42  # type: ignore[return-value]


TOOLS = {"lookup": lookup, "failing": failing, "not_text": not_text}


@pytest.mark.parametrize(("call", "outcome", "text"), [
    (ToolCall("lookup", {"key": "k1"}), "ok", "4711"),
    (Malformed("not JSON"), "malformed", "error: malformed tool call: not JSON"),
    (ToolCall("search", {}), "unknown_tool", "error: unknown tool 'search'; tools: ['failing', 'lookup', 'not_text']"),
    (ToolCall("lookup", {"key": "k1", "x": 1}), "bad_arguments", "error: tool 'lookup': got an unexpected keyword argument"),
    (ToolCall("lookup", {}), "bad_arguments", "error: tool 'lookup': missing a required argument: 'key'"),
    (ToolCall("lookup", {"key": "k9"}), "tool_error", "error: tool 'lookup' raised KeyError: 'k9'"),
    (ToolCall("failing", {"key": "k9"}), "tool_error", "error: no entry k9"),
    (ToolCall("not_text", {}), "tool_error", "error: tool 'not_text' returned int, not text"),
])
def test_every_outcome_of_a_call_is_text_and_a_counted_reason(call: Any, outcome: str, text: str) -> None:
    got_text, got_outcome = run_call(call, TOOLS)
    assert got_outcome == outcome and got_text.startswith(text), (got_outcome, got_text)


class Quiz:
    """Answers '4711' win; has a tool of its own."""

    def __init__(self) -> None:
        self.tools = {"lookup": lookup}

    def reset(self, task: Mapping[str, Any], seed: int) -> str:
        return "value of k1?"

    def step(self, action: str) -> StepResult:
        return StepResult("", float(action.strip() == "4711"), True)


def test_tool_steps_in_an_episode_count_outcomes_and_go_on() -> None:
    ep = Episode(Quiz, EpisodeLimits(max_turns=6, step_timeout_s=10), tools={"failing": failing})
    ep.start({}, 0)
    actions = ['<tool_call>{"name": "nope"}</tool_call>', "<tool_call>{bad}</tool_call>",
               '<tool_call>{"name": "failing", "arguments": {"key": "x"}}</tool_call>'
               '<tool_call>{"name": "lookup", "arguments": {"key": "k1"}}</tool_call>']
    steps = [ep.step(a) for a in actions]
    assert [s.done for s in steps] == [False, False, False] and [s.reward for s in steps] == [0.0, 0.0, 0.0]
    assert steps[2].observation == "<tool_response>\nerror: no entry x\n</tool_response><tool_response>\n4711\n</tool_response>"
    assert steps[2].info["tool_calls"] == ["tool_error", "ok"]
    assert dict(ep.tool_outcomes) == {"unknown_tool": 1, "malformed": 1, "tool_error": 1, "ok": 1}
    last = ep.step("4711")
    assert last.done and last.end == "done" and ep.rewards == [0.0, 0.0, 0.0, 1.0]


def test_without_tools_a_tag_is_plain_text_for_the_env() -> None:
    class Echo(Quiz):
        def __init__(self) -> None:
            self.tools = {}

        def step(self, action: str) -> StepResult:
            return StepResult(action, 0.0, True)

    ep = Episode(Echo)
    ep.start({}, 0)
    assert ep.step('<tool_call>{"name": "x"}</tool_call>').observation == '<tool_call>{"name": "x"}</tool_call>'


SANDBOX = {"isolation": "auto", "limits": {"timeout_s": 6.0, "test_timeout_s": 1.5, "cpu_s": 4, "memory_mb": 256}}


@pytest.fixture(scope="module")
def python() -> Any:
    tool = python_tool(parse({"sandbox": SANDBOX}).config)
    assert tool(code="print('ready')") == "ready\n"  # starts the sandbox once for the module
    return tool


def test_the_python_tool_runs_code_in_the_sandbox(python: Any) -> None:
    assert python(code="import math\nprint(math.factorial(5), 6 * 7)") == "120 42\n"
    with pytest.raises(ToolError, match="partial\nerror: ZeroDivisionError"):
        python(code="print('partial')\n1 / 0")
    with pytest.raises(ToolError, match="syntax"):
        python(code="def (")
    # The sandbox's isolation: the file system outside its private /tmp is read-only, and the
    # worker's environment variables are not passed in.
    RUNS_ROOT.mkdir(exist_ok=True)
    probe = RUNS_ROOT / "envs-python-tool-probe"
    probe.unlink(missing_ok=True)
    with pytest.raises(ToolError, match="error: OSError"):
        python(code=f"open({str(probe)!r}, 'w')")
    assert not probe.exists()
    assert python(code="import os\nprint(sorted(os.environ))") == "['HOME', 'LANG', 'PATH', 'PYTHONDONTWRITEBYTECODE', " \
                                                                   "'PYTHONHASHSEED', 'TMPDIR']\n"


def test_a_runaway_python_call_is_killed_by_the_sandbox_and_reported(python: Any) -> None:
    start = time.monotonic()
    with pytest.raises(ToolError, match="timeout"):
        python(code="while True:\n    pass")
    assert time.monotonic() - start < 6.0 + 2.0  # the execution's limit, not the step's


def test_the_python_tool_through_an_episode(python: Any) -> None:
    """A scripted policy computes with the tool, then answers with what it printed."""
    ep = Episode(Quiz, EpisodeLimits(max_turns=3, step_timeout_s=20), tools={"python": python})
    ep.start({}, 0)
    step = ep.step('<tool_call>{"name": "python", "arguments": {"code": "print(4700 + 11)"}}</tool_call>')
    assert step.observation == "<tool_response>\n4711\n\n</tool_response>" and step.info["tool_calls"] == ["ok"]
    answer = step.observation.split("\n")[1]
    assert ep.step(answer).reward == 1.0 and ep.end == "done"
