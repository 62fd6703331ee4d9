"""The config's ``env`` section: names resolved (registered, or a plugin's ``module:Class`` imported
by name) and limits checked before anything starts, each problem naming the field and the value;
no env (the default) changes nothing."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from rlbatch.checks.validate import check
from rlbatch.config.parse import parse
from rlbatch.envs.checks import env_problems
from rlbatch.envs.registry import ENVS, UnknownName, resolve_env
from rlbatch.envs.setup import EnvSetup
from tests.unit.configs import problems, set_

PLUGIN = "tests.plugins.env_plugin"




def test_the_default_has_no_env_and_passes(cfg: dict[str, Any]) -> None:
    assert cfg["env"]["name"] is None and env_problems(parse(cfg).config) == []
    check(cfg, runnable=False)


def test_a_plugin_env_is_imported_by_its_path_and_plays() -> None:
    sys.modules.pop(PLUGIN, None)
    cls = resolve_env(f"{PLUGIN}:Countdown")
    assert cls is not None and cls.__module__ == PLUGIN and "countdown" in ENVS  # importing registered it
    ep = EnvSetup(parse({"env": {"name": f"{PLUGIN}:Countdown", "args": {"start": 2}, "max_turns": 5,
                                 "step_timeout_s": 5}}).config).episode()
    assert ep.start({}, 0).observation == "2"
    assert [ep.step(a).reward for a in ("1", "0")] == [1.0, 1.0] and ep.end == "done"


@pytest.mark.parametrize(("name", "why"), [
    ("nope", "'nope' is not a registered environment; registered: ['countdown', 'frozenlake', 'lookup', "
             "'running_sum'] (or a plugin path 'package.module:Name')"),
    ("os; rm -rf /:X", "'os; rm -rf /:X' is not a registered environment nor a plugin path"),
    ("__import__('os').system('x'):X", "is not a registered environment nor a plugin path"),
    (f"{PLUGIN}:Missing", f"module '{PLUGIN}' has no attribute 'Missing'"),
    (f"{PLUGIN}:NoStep", f"'{PLUGIN}:NoStep' ({PLUGIN}.NoStep) has no step method"),
    (f"{PLUGIN}:register_env", "is a function, not an environment class"),
    ("tests.plugins.no_such_module:Env", "importing 'tests.plugins.no_such_module' for "
                                         "'tests.plugins.no_such_module:Env' failed: ModuleNotFoundError"),
    (3, "expected the name of a environment, got int 3"),
])
def test_a_bad_env_name_is_refused_with_the_reason(cfg: dict[str, Any], name: Any, why: str) -> None:
    __import__(PLUGIN)  # registers 'countdown': the registered list is the same in any test order
    with pytest.raises(UnknownName, match=None) as e:
        resolve_env(name)
    assert why in str(e.value), str(e.value)
    assert f"env.name: {e.value}" in problems(set_(cfg, env__name=name, program="selftest"))


def test_a_plugin_module_registers_an_env_by_name_before_validation(cfg: dict[str, Any]) -> None:
    sys.modules.pop(PLUGIN, None)
    ENVS.pop("countdown", None)
    c = set_(cfg, plugins=[PLUGIN], env__name="countdown", program="selftest")
    alone = parse(c | {"plugins": []}).config  # env_problems itself imports no plugin
    assert env_problems(alone)[0].startswith("env.name: 'countdown' is not a registered environment")
    check(c)  # imports the plugins first, as for engines
    assert "countdown" in ENVS


def test_the_planner_checks_the_form_of_a_plugin_path_without_importing_it(cfg: dict[str, Any]) -> None:
    check(set_(cfg, env__name="mylab.envs:FrozenLake"), runnable=False)
    assert problems(set_(cfg, env__name="mylab.envs:Frozen.Lake"), runnable=False) == [
        "env.name: 'mylab.envs:Frozen.Lake' is not a registered environment nor a plugin path "
        "'package.module:Name' (dotted identifiers, one ':')"]
    assert problems(set_(cfg, env__name="mylab.envs:FrozenLake", program="selftest")) == [
        "env.name: importing 'mylab.envs' for 'mylab.envs:FrozenLake' failed: ModuleNotFoundError: No module "
        "named 'mylab'"]


@pytest.mark.parametrize(("env", "line"), [
    ({"args": {"turn": 3}}, "env.args: ['turn'] do not fit RunningSum(turns: 'int' = 3, modulo: 'int' = 10, "
                            "scoring: 'str' = 'fraction'): got an unexpected keyword argument 'turn'"),
    ({"args": [1]}, "env.args: expected a mapping of keyword arguments, got [1]"),
    ({"args": {"modulo": 11}}, "env.args: {'modulo': 11} refused by RunningSum(turns: 'int' = 3, modulo: 'int' = 10, "
                               "scoring: 'str' = 'fraction'): building it raised ValueError: running_sum: modulo must "
                               "be an integer in [2, 10]"),
    ({"args": {"scoring": "most"}}, "env.args: {'scoring': 'most'} refused by RunningSum("),
    ({"tools": ["search"]}, "env.tools: 'search' is not a registered tool; registered: ['python']"),
    ({"tools": "python"}, "env.tools: expected a list of tool names, got str 'python'"),
    ({"tool_call_tags": ["<call>"]}, "env.tool_call_tags: expected [open, close], two non-blank strings"),
    ({"tool_response_tags": ["<r>", " "]}, "env.tool_response_tags: expected [open, close], two non-blank strings"),
    ({"max_context_tokens": 129}, "env.max_context_tokens: 129 tokens is longer than the random-init model's "
                                  "longest sequence, model.max_position_embeddings = 128"),
    ({"tools": ["python"], "step_timeout_s": 10.0}, "env.step_timeout_s: 10.0 s is not longer than "
                                                    "sandbox.limits.timeout_s = 10.0 s"),
    ({"max_turns": 0}, "env.max_turns: must be >= 1, got 0"),
    ({"step_timeout_s": 0.0}, "env.step_timeout_s: must be in (0, "),
    ({"bogus": 1}, "env: unknown field(s) ['bogus']"),
])
def test_bad_settings_are_refused_naming_the_field_and_value(cfg: dict[str, Any], env: dict[str, Any],
                                                             line: str) -> None:
    c = set_(cfg, env__name="running_sum", program="selftest", **{f"env__{k}": v for k, v in env.items()})
    got = problems(c)
    assert len(got) == 1 and got[0].startswith(line), got
    ok = set_(c, env__max_context_tokens=128, env__step_timeout_s=10.5, env__max_turns=1)
    for key in env:
        if key in cfg["env"]:
            ok["env"][key] = cfg["env"][key]
        else:
            del ok["env"][key]
    check(ok)  # the same config with the field at its default or its bound passes


def test_a_train_run_with_an_env_passes_and_what_it_does_not_combine_with_is_refused(cfg: dict[str, Any]) -> None:
    assert problems(set_(cfg, env__tools=["python"]), runnable=False) == [
        "env.tools: ['python'] are called inside an environment's episodes, and env.name is not set"]
    env = set_(cfg, env__name="running_sum")
    check(env)  # a train run with an environment: multi-turn rollouts run in the generate phase
    assert problems(set_(cfg, data__name="none")) == [
        "data.name: 'none' gives every trajectory an empty task for an environment to draw from its seed, "
        "and env.name is not set"]
    check(set_(env, data__name="none"))
    got = problems(set_(env, algo__overlong_filter=True))
    assert len(got) == 1 and got[0].startswith("algo.overlong_filter / algo.overlong_buffer: env.name='running_sum'")
    check(set_(env, algo__overlong_filter=True), runnable=False)  # the planner's check: the build's gap is not its
