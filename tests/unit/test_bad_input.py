"""Every field of the schema given what a new or hostile user might type: non-finite, negative,
zero, huge and wrongly typed values. Each is refused before anything starts, with a message that
names the field, or it is a value the field admits and the config passes.

The fields are found by walking the schema's dataclasses, so a field added later is covered (and
one without a declared range fails ``test_every_numeric_field_declares_a_range``). The config is
composed once; each case checks a mutated copy (``check(cfg, runnable=False)``: no paths, no
engines, no filesystem).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import subprocess
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlbatch.checks.validate import check
from rlbatch.config.bounds import FLOAT_MAX, INT_MAX, Range, numeric_fields
from rlbatch.config.compose import compose
from rlbatch.config.plain import to_plain
from rlbatch.config.schema import RLBatchConfig, RoleConfig
from rlbatch.errors import ConfigError

NUMERIC = numeric_fields(RLBatchConfig)
"""(dotted name, int or float, declared range) of every numeric field, nested ones included."""


def _other_fields(schema: type, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted name, annotation) of every field that is neither a number nor a nested section."""
    out: list[tuple[str, Any]] = []
    hints = typing.get_type_hints(schema)
    numeric = {name for name, _, _ in NUMERIC}
    for f in dataclasses.fields(schema):
        key, hint = f"{prefix}.{f.name}" if prefix else f.name, hints[f.name]
        if dataclasses.is_dataclass(hint):
            out.extend(_other_fields(hint, key))  # type: ignore[arg-type]
        elif key not in numeric:
            out.append((key, hint))
    return out


OTHER = _other_fields(RLBatchConfig)

CROSS_FIELD: dict[tuple[str, Any], str] = {
    ("model.hidden_size", 1): "model.hidden_size 1 must divide evenly into model.num_heads 4 heads",
    ("model.hidden_size", INT_MAX): f"model.hidden_size {INT_MAX} must divide evenly into model.num_heads 4 heads",
    ("model.num_heads", 1): "model.num_heads 1 must divide evenly into model.num_kv_heads 2 groups",
    ("model.num_heads", INT_MAX): f"model.hidden_size 64 must divide evenly into model.num_heads {INT_MAX} heads",
    ("model.num_kv_heads", INT_MAX): f"model.num_heads 4 must divide evenly into model.num_kv_heads {INT_MAX} groups",
    ("algo.samples_per_prompt", 1): "algo.samples_per_prompt: algo.advantage=grpo compares each sample with the "
                                    "others of its prompt's group",
    ("algo.mini_batches", INT_MAX): "algo: a batch of prompts_per_step*samples_per_prompt = ",
    ("algo.grad_accum", INT_MAX): "algo: a batch of prompts_per_step*samples_per_prompt = ",
    ("algo.overlong_buffer", INT_MAX): f"algo.overlong_buffer: {INT_MAX} tokens is longer than algo.max_new_tokens",
    ("data.max_prompt_tokens", INT_MAX): f"data.max_prompt_tokens: {INT_MAX} prompt tokens + algo.max_new_tokens",
}
"""Values in a field's own range that a rule tying it to other fields refuses (with the defaults of
the others), each with the start of that rule's message."""


@pytest.fixture(scope="module")
def base() -> Iterator[dict[str, Any]]:
    cfg = to_plain(compose([]))
    check(cfg, runnable=False)  # the defaults pass: every refusal below is the mutated field's
    pristine = copy.deepcopy(cfg)
    yield cfg
    assert cfg == pristine  # the cases share what they do not set; check() must not have changed it


def _with(cfg: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """``cfg`` with one field set: the mappings on the field's path are copied, the rest shared."""
    out = node = copy.copy(cfg)
    *parents, last = dotted.split(".")
    for key in parents:
        node[key] = node = copy.copy(node[key])
    node[last] = value
    return out


def problems(cfg: dict[str, Any], dotted: str, value: Any) -> list[str]:
    try:
        check(_with(cfg, dotted, value), runnable=False)
    except ConfigError as e:
        return list(e.problems)
    return []


def assert_refused(cfg: dict[str, Any], dotted: str, value: Any, fragment: str = "") -> None:
    got = problems(cfg, dotted, value)
    named = [p for p in got if re.search(rf"(?<![\w.]){re.escape(dotted)}(?!\w)", p)]
    assert named, f"{dotted}={value!r} was not refused by name: {got}"
    assert fragment in "\n".join(named), (dotted, value, fragment, named)


def assert_admitted(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    got = problems(cfg, dotted, value)
    if (dotted, value) in CROSS_FIELD:
        assert got and got[0].startswith(CROSS_FIELD[dotted, value]), got
    else:
        assert got == [], f"{dotted}={value!r} is in its declared range, yet: {got}"


def test_every_numeric_field_declares_a_range() -> None:
    assert len(NUMERIC) >= 60, NUMERIC  # the walk found the nested sections (cluster, sandbox.limits, ...)
    undeclared = [name for name, _, rng in NUMERIC if rng is None]
    assert undeclared == [], f"numeric fields without a declared range (rlbatch.config.bounds.bounded): {undeclared}"
    for name, _, rng in NUMERIC:
        assert rng is not None and (rng.ge is not None or rng.gt is not None), f"{name}: no lower bound"


def _in_range(kind: type, rng: Range, v: float) -> bool:
    cap = INT_MAX if kind is int else FLOAT_MAX
    return rng.admits(v) and v <= (rng.le if rng.le is not None else cap)


@pytest.mark.parametrize(("name", "kind", "rng"), NUMERIC, ids=[n for n, _, _ in NUMERIC])
def test_a_number_is_finite_typed_and_in_its_range_or_refused(
        base: dict[str, Any], name: str, kind: type, rng: Range) -> None:
    for bad in (math.nan, -math.inf):
        assert_refused(base, name, bad, "finite" if kind is float else "expected an integer")
    for wrong in ("1", True, [1]):
        assert_refused(base, name, wrong, "expected a")  # place() says "an integer" for its fields
    if kind is int:
        assert_refused(base, name, 1.5, "expected an integer")
        assert_refused(base, name, 10**30, "got 1000000000000000000000000000000")
    else:
        assert_refused(base, name, 1e308, "got 1e+308")
    # Negative, zero, huge and the declared bounds themselves: refused exactly where the range says.
    low = rng.gt if rng.gt is not None else rng.ge
    assert low is not None
    high = rng.le if rng.le is not None else (INT_MAX if kind is int else FLOAT_MAX)
    step = (lambda x, d: x + d) if kind is int else (lambda x, d: math.nextafter(x, math.inf if d > 0 else -math.inf))
    values = {kind(-1), kind(0), kind(high), step(kind(low), -1), step(kind(high), +1), kind(low)}
    for v in sorted(values):
        if _in_range(kind, rng, v):
            assert_admitted(base, name, v)
        else:
            assert_refused(base, name, v, "must be")


@pytest.mark.parametrize(("name", "value", "message"), [
    # values that did damage after the start while they went unchecked; now refused by field and value
    ("algo.lr", math.nan, "algo.lr: must be a finite number >= 0, got nan"),
    ("algo.lr", math.inf, "algo.lr: must be a finite number >= 0, got inf"),
    ("algo.kl_coef", math.nan, "algo.kl_coef: must be a finite number >= 0, got nan"),
    ("algo.entropy_coef", math.nan, "algo.entropy_coef: must be a finite number >= 0"),
    ("algo.entropy_coef", -0.1, "algo.entropy_coef: must be >= 0"),
    ("model.hidden_size", -64, "model.hidden_size: must be >= 1, got -64"),
    ("model.num_layers", 0, "model.num_layers: must be >= 1, got 0"),
    ("model.hidden_size", 12, "model.hidden_size 12 / model.num_heads 4 = head size 3 must be even"),
    ("model.num_kv_heads", 3, "model.num_heads 4 must divide evenly into model.num_kv_heads 3 groups"),
    ("model.initializer_range", 0.0, "model.initializer_range: must be > 0"),
    ("algo.adv_eps", 0.0, "algo.adv_eps: must be > 0"),
    ("algo.top_p", 0.0, "algo.top_p: must be in (0, 1], got 0.0"),
    ("algo.gamma", 1.5, "algo.gamma: must be in (0, 1] (a discount), got 1.5"),
    ("steps", 10**30, "steps: must be >= 1 and at most 9223372036854775807"),
    ("seed", -1, "seed: must be in [0, 4294967295]"),
    ("seed", 2**32, "seed: must be in [0, 4294967295]"),
    ("cluster.mem_gb", -5, "cluster.mem_gb: must be in [1, "),
    ("cluster.time_min", 2**32 - 1, "cluster.time_min: must be in [1, 4294967293]"),
    ("cluster.signal_delay_s", 65536, "cluster.signal_delay_s: must be in [0, 65535]"),
    ("cluster.timeout_s", 1e10, "cluster.timeout_s: must be in [0.001, "),
    ("cluster.gpus_per_node", 0, "cluster.gpus_per_node: must be between 1 and 1024, got 0"),
    ("sandbox.limits.memory_mb", 63, "sandbox.limits.memory_mb: must be in [64, "),
    ("sandbox.limits.timeout_s", math.inf, "sandbox.limits.timeout_s: must be a finite number"),
    ("reward_model.model_weight", -1.0, "reward_model.model_weight: must be >= 0, got -1.0"),
    ("algo.samples_per_prompt", "8", "algo.samples_per_prompt: expected a number, got '8'"),
    ("algo.max_new_tokens", False, "algo.max_new_tokens: expected a number, got False"),
    ("model.check_path", "false", "model.check_path: expected true or false, got 'false'"),
])
def test_what_did_damage_is_refused_naming_the_field(base: dict[str, Any], name: str, value: Any, message: str) -> None:
    assert_refused(base, name, value, message)


@pytest.mark.parametrize(("name", "value"), [
    ("algo.kl_coef", 0.0), ("algo.lr", 0.0), ("algo.entropy_coef", 0.0), ("algo.temperature", 0.0),
    ("algo.warmup_steps", 0), ("algo.grad_clip", 0.0), ("algo.max_staleness", 0), ("save_every", 0),
    ("seed", 0), ("seed", 2**32 - 1), ("cluster.signal_delay_s", 0), ("cluster.mem_gb", None),
    ("algo.top_p", 1.0), ("algo.gamma", 1.0), ("algo.lam", 0.0), ("algo.critic_lr", None), ("algo.lr", 1),
])
def test_a_value_the_field_admits_passes(base: dict[str, Any], name: str, value: Any) -> None:
    assert_admitted(base, name, value)


@pytest.mark.parametrize(("name", "hint"), OTHER, ids=[n for n, _ in OTHER])
def test_every_other_field_refuses_cleanly_or_admits(base: dict[str, Any], name: str, hint: Any) -> None:
    """Strings, flags, lists and mappings given numbers and wrong types: check() reports a problem
    that names the field, or admits the value; it never fails with anything but ConfigError."""
    for v in (math.nan, -1, 0, 10**30, "x", True, [1], {"x": 1}):
        try:
            got = problems(base, name, v)
        except Exception as e:  # noqa: BLE001 - the point: nothing but ConfigError escapes check()
            pytest.fail(f"{name}={v!r}: check() raised {type(e).__name__}: {e}")
        if hint is bool and not isinstance(v, bool):
            assert any(p.startswith(f"{name}: expected true or false") for p in got), (name, v, got)


ROLE_NUMBERS = [f.name for f in dataclasses.fields(RoleConfig)
                if f.name in ("world_size", "num_gpus_per_worker")]


@pytest.mark.parametrize("field", ROLE_NUMBERS)
@pytest.mark.parametrize("role", ["actor_train", "actor_infer", "reward"])
def test_role_numbers_are_refused_by_name(base: dict[str, Any], role: str, field: str) -> None:
    cpu_role = role == "reward"
    if cpu_role and field == "num_gpus_per_worker":
        assert problems(base, f"roles.{role}.{field}", 0) == []  # a CPU role asks for no GPUs
    for v in (math.nan, math.inf, -1, *(() if cpu_role and field == "num_gpus_per_worker" else (0,)), 10**30, "2", True):
        got = problems(base, f"roles.{role}.{field}", v)
        assert any(p.startswith(f"roles.{role}") and field in p for p in got), (role, field, v, got)


def test_overrides_arrive_as_numbers_and_are_refused_together() -> None:
    """Through Hydra, 'nan' and '1e999' become floats and a quoted 'nan' too (the schema types the
    field); a huge int stays an int. One compose, every problem in one error."""
    cfg = compose(["algo.lr=nan", "algo.kl_coef='nan'", "algo.entropy_coef=1e999", "model.hidden_size=-64",
                   "steps=1000000000000000000000000000000"])
    with pytest.raises(ConfigError) as e:
        check(cfg, runnable=False)
    assert [p.split(":")[0] for p in e.value.problems] == [
        "steps", "model.hidden_size", "algo.lr", "algo.kl_coef", "algo.entropy_coef"], e.value.problems


def test_the_launcher_exits_2_and_starts_nothing(tmp_path: Path) -> None:
    """From a directory of its own, so that anything the launcher wrote (a run directory, Hydra's
    outputs) would show."""
    out = subprocess.run([sys.executable, "-m", "rlbatch.launch", "algo.kl_coef=nan", "model.num_layers=0",
                          "run_dir=run"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    assert "algo.kl_coef: must be a finite number >= 0, got nan" in out.stderr, out.stderr
    assert "model.num_layers: must be >= 1, got 0" in out.stderr, out.stderr
    assert list(tmp_path.iterdir()) == []


ENGINE_NUMBERS = [(engine, f.name) for engine, spec in sorted(__import__("rlbatch.engines.registry", fromlist=["REGISTRY"]).REGISTRY.items())
                  for f in dataclasses.fields(spec.args) if f.type in ("int", "float", int, float)]


@pytest.mark.parametrize(("engine", "key"), ENGINE_NUMBERS)
def test_every_numeric_engine_arg_refuses_non_finite_negative_and_huge(engine: str, key: str) -> None:
    from rlbatch.engines.registry import REGISTRY, parse_args

    where = "roles.r.engine_args"
    for bad in (math.nan, math.inf, -1, 10**30 if isinstance(getattr(REGISTRY[engine].args(), key), int) else 1e39):
        problems = parse_args(engine, {key: bad}, where).problems
        assert problems and problems[0].startswith(f"{where}.{key}: "), (engine, key, bad, problems)


def test_hardware_profile_numbers_are_finite_and_in_range() -> None:
    from rlbatch.config.hardware import FIELDS, load_hardware

    numbers = [n for n, f in FIELDS.items() if f.type in ("int", "float", int, float)]
    assert len(numbers) > 15
    for name in numbers:
        for bad in (math.nan, math.inf, -1):
            with pytest.raises(ConfigError, match=rf"hardware h100_sxm\.yaml: {name}(: must be|=\S+ is not)"):
                load_hardware("h100_sxm", {name: bad})
    with pytest.raises(ConfigError, match=r"mfu: must be in \(0, 1\], got 2"):
        load_hardware("h100_sxm", {"mfu": 2})
