"""``parse(raw) -> Parsed``: plain configuration mappings (Hydra's composition, a run's
``config.yaml``, the planner's candidates) read once into the typed ``RLBatchConfig``, with every
problem of their shape.

The schema says each field's type, default and range; this walks it: a key the schema does not
know, a value of the wrong type or out of its range, a name that is not one of a field's choices
or registries, each is one problem naming the field and the value. The typed config holds the
schema's default where a value was refused, so the rules in ``rlbatch.checks`` (which read the
typed config) still run and one pass reports everything. A None in a plain mapping means the
field's default; an Optional field's None means unset.

Roles are a mapping of role name to ``RoleConfig`` (any name: a CPU role is added with
``+roles.code_sandbox.world_size=8``); their fields are typed here, their placement (device
mappings, backends, sizes) is ``rlbatch.placement.place``'s. What a value may contain beyond its
type (the characters of a Slurm partition name, a reward function that imports) is the rules'
(``rlbatch.checks``) on the typed config, and each tracker's (``rlbatch.trackers``) on its typed
settings. The ``hardware`` section is a profile's name and fields, read into ``HardwareConfig``
with the profile loaded (``rlbatch.config.hardware_section``); ``logger`` and ``trackers`` are
refused in the words of ``rlbatch.config.tracker_shapes``. ``plugins`` alone is checked by the code
that imports it, before the rest is read.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rlbatch.algos.registry import (
    ADVANTAGES,
    AGGREGATIONS,
    KL_ESTIMATORS,
    LOOPS,
    OFF_POLICY,
    POLICY_LOSSES,
    Registry,
)
from rlbatch.config import tracker_shapes
from rlbatch.config.bounds import RANGE, Range, numeric_type, value_problem
from rlbatch.config.hardware_section import read_hardware
from rlbatch.config.plain import to_plain
from rlbatch.config.schema import RLBatchConfig, RoleConfig
from rlbatch.errors import ConfigError
from rlbatch.plugins import import_plugins

CHOICES: dict[str, tuple[str, ...]] = {  # the algorithm's names come from rlbatch.algos.registry
    "program": ("train", "eval", "selftest"),
    "cluster.name": ("local", "slurm"),
    "cluster.device": ("auto", "cuda", "cpu"),
    "cluster.preempt_signal": ("USR2", "TERM", "INT", "HUP", "URG", "XCPU"),
    "model.arch": ("qwen2", "llama", "qwen2_moe", "qwen2_vl", "qwen2_5_vl"),
    "model.dtype": ("auto", "bf16", "fp16", "fp32"),
    "data.name": ("synthetic", "word_arithmetic", "file", "synthetic_code", "code_file", "none", "vlm_shapes"),
    "eval.data.name": ("synthetic", "word_arithmetic", "vlm_shapes", "file", "synthetic_code", "code_file", "none"),
    "data.prompt_too_long": ("refuse", "drop", "truncate"),
    "eval.data.prompt_too_long": ("refuse", "drop", "truncate"),
    "data.truncation_side": ("left", "right"),
    "eval.data.truncation_side": ("left", "right"),
    "sandbox.isolation": ("auto", "namespaces", "process"),
    "sandbox.scoring": ("fraction", "all"),
    **tracker_shapes.CHOICES,
}
"""Fields whose value is one of a few names."""

REGISTRIES: dict[str, Registry] = {r.field: r for r in (ADVANTAGES, POLICY_LOSSES, KL_ESTIMATORS, AGGREGATIONS,
                                                        OFF_POLICY)}
"""Fields whose value names an entry of an algorithm registry (plugins may add entries)."""

CHECKED_BESIDE_USE = ("plugins",)
"""Fields whose strings, lists and mappings are checked by the code that uses them, in words of its
own (module docstring): a value of the wrong type leaves the typed config at the default without a
problem here."""

ROLE_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
ROLE_FIELDS = frozenset(f.name for f in dataclasses.fields(RoleConfig))


@dataclass
class Parsed:
    """A configuration as the schema's typed object, and what is wrong with it (empty: nothing)."""

    config: RLBatchConfig
    problems: list[str]


def parse(raw: object) -> Parsed:
    """Read ``raw`` (a mapping, an OmegaConf node or an ``RLBatchConfig``) into the typed config and
    its problems. Raises ConfigError only when ``raw`` is not a mapping at all."""
    plain = to_plain(raw)
    if not isinstance(plain, Mapping):
        raise ConfigError(f"config: expected a mapping, got {type(plain).__name__}")
    problems = import_plugins(plain.get("plugins"))  # first: they may register engines and algorithm parts
    config = _section(RLBatchConfig, plain, "", problems)
    return Parsed(config, problems)


def parsed(raw: object) -> RLBatchConfig:
    """The typed config; ConfigError listing the problems when there are any."""
    result = parse(raw)
    if result.problems:
        raise ConfigError(result.problems)
    return result.config


T = typing.TypeVar("T")


def _section(schema: type[T], node: Mapping[str, Any], key: str, problems: list[str]) -> T:
    """One dataclass of the schema from its mapping: known keys typed, refused ones left at the
    schema's default."""
    hints = typing.get_type_hints(schema)
    fields = {f.name: f for f in dataclasses.fields(schema)}  # type: ignore[arg-type]
    if unknown := sorted(str(k) for k in node if k not in fields):
        words = tracker_shapes.UNKNOWN_KEYS.get(key)
        problems.append(words(unknown) if words is not None else
                        f"{key or 'config'}: unknown field(s) {unknown}; known fields: {sorted(fields)}"[:400])
    values: dict[str, Any] = {}
    for name, f in fields.items():
        path = f"{key}.{name}" if key else name
        if schema is RLBatchConfig and name in READERS:
            values[name] = READERS[name](node.get(name), problems)
            continue
        if name not in node:
            continue
        ok, value = _value(path, node[name], hints[name], f, problems)
        if ok:
            values[name] = value
    return schema(**values)


SECTION_WORDS = {"algo": "algorithm settings", "env": "environment settings"}
"""What a section's mapping holds, where "its fields" would say less."""


def _tags(v: object) -> bool:
    return (isinstance(v, (list, tuple)) and len(v) == 2
            and all(isinstance(t, str) and t.strip() and len(t) <= 64 for t in v))


def _tags_words(key: str, v: object) -> str:
    return f"env.{key}: expected [open, close], two non-blank strings of at most 64 characters, got {v!r}"[:300]


ROLE_WORDS = ("env.observation_role: expected a message role such as 'user' or 'tool' (a name of at most 32 "
              "letters, digits, '_' or '-'), got {!r}")
"""The problem of an ``env.observation_role`` that is not a message role's name (the env rules' words too)."""


def _ports(v: object) -> bool:
    return (isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(p, int) and not isinstance(p, bool) for p in v)
            and 1024 <= v[0] < v[1] <= 65536)


def _routes(v: object) -> bool:
    return isinstance(v, Mapping) and all(isinstance(k, str) and isinstance(f, str) for k, f in v.items())


def _routes_words(key: str, v: object) -> str:
    return f"{key}.reward_fns: expected a mapping of data_source to 'module:function', got {v!r}"[:400]


SHAPE_RULES: dict[str, tuple[Callable[[object], bool], Callable[[object], str]]] = {
    "algo.name": (lambda v: isinstance(v, str),  # which names: check()'s, as strict as its run (program_name_problem)
                  lambda v: f"algo.name: expected the name of a {LOOPS.what}, got {type(v).__name__} {v!r}"[:200]),
    "resume": (lambda v: isinstance(v, str) and bool(v),
               lambda v: f"resume: expected 'auto', 'never' or a checkpoint path, got {v!r}"),
    "run_dir": (lambda v: isinstance(v, str),
                lambda v: f"run_dir: expected the path of a directory, got {type(v).__name__} {v!r}"[:200]),
    "cluster.mpiexec": (lambda v: isinstance(v, str),
                        lambda v: f"cluster.mpiexec: expected the path of mpiexec, got {type(v).__name__} {v!r}"[:200]),
    "cluster.port_range": (_ports, lambda v: f"cluster.port_range: expected [low, high) with 1024 <= low < high <= "
                                             f"65536, got {v!r}"),
    "cluster.setup": (lambda v: isinstance(v, (list, tuple)) and all(isinstance(ln, str) for ln in v),
                      lambda v: f"cluster.setup: expected a list of shell lines, got {v!r}"[:300]),
    "cluster.sbatch_args": (lambda v: isinstance(v, Mapping),
                            lambda v: f"cluster.sbatch_args: expected a mapping of sbatch options, got {v!r}"[:300]),
    **{f"{key}.reward_fns": (_routes, functools.partial(_routes_words, key)) for key in ("data", "eval.data")},
    **{f"env.{key}": (_tags, functools.partial(_tags_words, key)) for key in ("tool_call_tags", "tool_response_tags")},
    "env.args": (lambda v: isinstance(v, Mapping) and all(isinstance(k, str) for k in v),
                 lambda v: f"env.args: expected a mapping of keyword arguments, got {v!r}"[:200]),
    "env.tools": (lambda v: isinstance(v, (list, tuple)),
                  lambda v: f"env.tools: expected a list of tool names, got {type(v).__name__} {v!r}"[:200]),
    "env.observation_role": (lambda v: isinstance(v, str), lambda v: ROLE_WORDS.format(v)[:200]),
    "env.name": (lambda v: isinstance(v, str),
                 lambda v: f"env.name: {f'expected the name of a environment, got {type(v).__name__} {v!r}'[:200]}"),
    **tracker_shapes.SHAPE_RULES,
}
"""Fields whose values have a shape of their own (a pair of ports, a mapping of names), or whose
problem says what the string is: what the value must be, and the problem's words."""
SHAPES: dict[object, tuple[type | tuple[type, ...], str]] = {
    list: ((list, tuple), "a list"), dict: (Mapping, "a mapping"), str: (str, "a string")}
"""What a value of a list, mapping or string field may be, and the words for it."""


def _value(path: str, v: Any, hint: Any, f: dataclasses.Field[Any], problems: list[str]) -> tuple[bool, Any]:
    """(True, the value as the field's type) or (False, None) with its problem appended (or, for a
    None where the field takes none, no problem: the default stands)."""
    optional, hint = _unwrap_optional(hint)
    if v is None:
        if optional:
            return True, None
        rng = f.metadata.get(RANGE)
        if rng is not None and rng.checked_by_place:
            problems.append(f"{path}: expected an integer, got None")
        return False, None
    if dataclasses.is_dataclass(hint):
        if not isinstance(v, Mapping):
            own = tracker_shapes.NOT_A_MAPPING.get(path)
            words = SECTION_WORDS.get(path, "its fields")
            problems.append(own(v) if own is not None else
                            f"{path}: expected a mapping of {words}, got {type(v).__name__} {v!r}"[:200])
            return False, None
        return True, _section(hint, v, path, problems)  # type: ignore[arg-type]
    if hint is bool:
        if not isinstance(v, bool):
            problems.append(f"{path}: expected true or false, got {v!r}"[:300])
            return False, None
        return True, v
    kind = numeric_type(hint)
    if kind is not None:
        rng = f.metadata.get(RANGE, Range())
        problem = _place_int_problem(path, v, rng) if rng.checked_by_place else value_problem(path, v, kind, rng)
        if problem is not None:
            problems.append(problem)
            return False, None
        return True, v
    if path in CHOICES:
        if v not in CHOICES[path]:
            problems.append(f"{path}: {v!r} is not one of {list(CHOICES[path])}")
            return False, None
        return True, v
    if path in REGISTRIES:
        registry = REGISTRIES[path]
        problem = (f"{path}: expected the name of a {registry.what}, got {type(v).__name__} {v!r}"[:200]
                   if not isinstance(v, str) else registry.problem(v))
        if problem is not None:
            problems.append(problem)
            return False, None
        return True, v
    if path in SHAPE_RULES:
        fits, problem_of = SHAPE_RULES[path]
        if not fits(v):
            problems.append(problem_of(v))
            return False, None
    origin = typing.get_origin(hint) or hint
    if origin in SHAPES and not isinstance(v, SHAPES[origin][0]):
        if not path.startswith(CHECKED_BESIDE_USE):
            problems.append(f"{path}: expected {SHAPES[origin][1]}, got {type(v).__name__} {v!r}"[:300])
        return False, None
    if origin is list:
        return True, list(v)
    if origin is dict:
        return True, dict(v)
    return True, v


def _unwrap_optional(hint: Any) -> tuple[bool, Any]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) < len(typing.get_args(hint)):
            return True, args[0] if len(args) == 1 else hint
    return False, hint


def _place_int_problem(path: str, v: Any, rng: Range) -> str | None:
    """A placement count (``checked_by_place``) in the words the placement's own counts use."""
    if isinstance(v, bool) or not isinstance(v, int):
        return f"{path}: expected an integer, got {type(v).__name__} {v!r}"[:200]
    low = int(rng.ge if rng.ge is not None else (rng.gt or 0) + 1)
    if v < low or (rng.le is not None and v > rng.le):
        return f"{path}: must be {f'>= {low}' if rng.le is None else f'between {low} and {int(rng.le)}'}, got {v}"
    return None


def _roles(node: Any, problems: list[str]) -> dict[str, RoleConfig]:
    """Each role's fields typed; which roles are GPU roles, their mappings, backends and sizes are
    the placement's to check."""
    if not isinstance(node, Mapping) or not node:
        problems.append("roles: expected a mapping of role name to role config, e.g. roles.actor_train.device_mapping=[0,1]")
        return {}
    hints = typing.get_type_hints(RoleConfig)
    out: dict[str, RoleConfig] = {}
    for name, rc in node.items():
        if not isinstance(name, str) or not ROLE_NAME.fullmatch(name):
            problems.append(f"roles: role name {name!r} must be lower_snake_case (letters, digits, '_'), at most 64 characters"[:200])
            continue
        if rc is None:  # removed (``~roles.x`` leaves nothing; a null leaves the name)
            continue
        if not isinstance(rc, Mapping):
            problems.append(f"roles.{name}: expected a mapping of fields, got {type(rc).__name__}")
            continue
        if unknown := sorted(str(k) for k in rc if k not in ROLE_FIELDS):
            problems.append(f"roles.{name}: unknown field(s) {unknown}; known fields: {sorted(ROLE_FIELDS)}")
        values: dict[str, Any] = {}
        for f in dataclasses.fields(RoleConfig):
            if f.name not in rc or (v := rc[f.name]) is None:
                continue
            path = f"roles.{name}.{f.name}"
            if f.name == "engine_args":
                if isinstance(v, Mapping):
                    values[f.name] = dict(v)
                else:
                    problems.append(f"{path}: expected a mapping of engine keyword arguments, got {type(v).__name__} {v!r}"[:200])
            elif f.name in ("num_gpus_per_worker", "world_size"):  # their ranges depend on the role's kind: place()
                if isinstance(v, bool) or not isinstance(v, int):
                    problems.append(f"{path}: expected an integer, got {type(v).__name__} {v!r}"[:200])
                else:
                    values[f.name] = v
            elif f.name == "device_mapping":  # a list or the placement's grammar: place() parses it
                values[f.name] = list(v) if isinstance(v, (list, tuple)) else v
            elif hints[f.name] is bool and not isinstance(v, bool):
                problems.append(f"{path}: expected true or false, got {v!r}"[:300])
            elif f.name == "backend" and not isinstance(v, str):
                problems.append(f"{path}: expected a backend string like 'fsdp:d4t2', got {type(v).__name__} {v!r}"[:300])
            else:
                values[f.name] = v
        out[name] = RoleConfig(**values)
    return out


READERS: dict[str, Callable[[Any, list[str]], object]] = {"roles": _roles, "hardware": read_hardware}
"""Sections of ``RLBatchConfig`` read by a reader of their own (given the section's value, None when
absent): the roles (any name; no default placement under a config that names none) and the
hardware profile."""
