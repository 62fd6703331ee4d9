"""The range of every numeric field, declared where the field is (``bounded``), and the one check
that reads them all (``field_problems``).

A value that a field's type admits can still do damage far from the config: ``nan`` compares
false with everything, so ``kl_coef=nan`` silently drops the KL; ``inf`` runs a step and then
breaks sampling; ``10**30`` is a fine Python int and an overflow in torch or Slurm. So every int
and float field of the schema declares its range, and the check refuses, naming the field and the
value: a wrong type (a bool is not a number), a non-finite float, a value out of the range, and
a value beyond what the field's consumers can hold (``INT_MAX``, ``FLOAT_MAX``) where the field
declares no maximum of its own. No Hydra, no torch.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import types
import typing
from collections.abc import Mapping
from typing import Any

RANGE = "range"
"""The key of a field's ``Range`` in its dataclass metadata."""
INT_MAX = 2**63 - 1
"""Every integer field ends up in torch, numpy, a system call or Slurm, none of which holds more
than a signed 64-bit integer (a Python int has no bound, so 10**30 would fail far from here)."""
FLOAT_MAX = 3.4028234663852886e38
"""Every float field either scales float32 tensors (losses, rewards, optimizer steps), where a
larger value is inf, or is a time, which ``TIMEOUT_MAX_S`` bounds tighter."""
TIMEOUT_MAX_S = threading.TIMEOUT_MAX
"""The longest wait Python's locks, interval timers and selects take (about 292 years); a longer
one raises OverflowError where it is used."""


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric field admits: ``ge``/``gt`` below, ``le`` above (None: no bound of the
    field's own), and why, when the bound is not obvious from the field's docstring."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    why: str = ""
    checked_by_place: bool = False
    """``rlbatch.placement.place`` checks the field (it needs it to place the roles) and reports it."""

    def admits(self, v: float) -> bool:
        return ((self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le))

    def describe(self) -> str:
        """'>= 0', '> 0', 'in (0, 1]', 'in [0, 65535]'."""
        low = self.gt if self.gt is not None else self.ge
        if low is not None and self.le is not None:
            return f"in {'(' if self.gt is not None else '['}{_fmt(low)}, {_fmt(self.le)}]"
        if low is not None:
            return f"{'>' if self.gt is not None else '>='} {_fmt(low)}"
        return f"<= {_fmt(self.le)}" if self.le is not None else "any number"


def _fmt(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def bounded(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
            why: str = "", checked_by_place: bool = False) -> Any:
    """A numeric dataclass field with its range: ``x: int = bounded(1, ge=1)``."""
    return dataclasses.field(default=default, metadata={RANGE: Range(ge, gt, le, why, checked_by_place)})


def numeric_type(hint: Any) -> type | None:
    """int or float for a field annotated ``int``, ``float`` or either ``| None``; None otherwise
    (bool included: a flag is not a number)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else None
    return hint if hint in (int, float) else None


def value_problem(key: str, v: Any, kind: type, rng: Range) -> str | None:
    """What is wrong with ``v`` as the value of the ``kind`` field ``key`` of range ``rng``; None
    when nothing is."""
    why = f" ({rng.why})" if rng.why else ""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"{key}: expected a number, got {v!r}"[:300]
    if kind is int and not isinstance(v, int):
        return f"{key}: expected an integer, got {v}"
    if not math.isfinite(v):
        return f"{key}: must be a finite number {rng.describe()}{why}, got {v}"
    if not rng.admits(v):
        return f"{key}: must be {rng.describe()}{why}, got {v}"
    cap, holds = (INT_MAX, "a signed 64-bit integer") if kind is int else (FLOAT_MAX, "float32")
    if rng.le is None and v > cap:
        return f"{key}: must be {rng.describe()} and at most {_fmt(cap)} (the most {holds} holds), got {v}"
    return None


def field_problems(node: Mapping[str, Any], schema: type, prefix: str = "") -> list[str]:
    """Every numeric and boolean field of ``schema`` (a dataclass) that ``node`` sets, and those of
    the dataclasses nested in it (``sandbox.limits``), checked against their declared ranges. A
    field left out or None is not checked (a plain mapping's None means the default; an Optional
    field's None means unset)."""
    problems = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if f.name not in node or (v := node[f.name]) is None:
            continue
        key, hint = f"{prefix}.{f.name}" if prefix else f.name, hints[f.name]
        if dataclasses.is_dataclass(hint):
            if isinstance(v, Mapping):
                problems.extend(field_problems(v, hint, key))  # type: ignore[arg-type]
            continue
        if hint is bool:
            if not isinstance(v, bool):
                problems.append(f"{key}: expected true or false, got {v!r}"[:300])
            continue
        kind = numeric_type(hint)
        rng = f.metadata.get(RANGE, Range())
        if kind is not None and not rng.checked_by_place and (p := value_problem(key, v, kind, rng)) is not None:
            problems.append(p)
    return problems


def numeric_fields(schema: type, prefix: str = "") -> list[tuple[str, type, Range | None]]:
    """(dotted name, int or float, declared range) of every numeric field of ``schema`` and of the
    dataclasses nested in it; the range is None where the field declares none."""
    out: list[tuple[str, type, Range | None]] = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key, hint = f"{prefix}.{f.name}" if prefix else f.name, hints[f.name]
        if dataclasses.is_dataclass(hint):
            out.extend(numeric_fields(hint, key))  # type: ignore[arg-type]
        elif (kind := numeric_type(hint)) is not None:
            out.append((key, kind, f.metadata.get(RANGE)))
    return out
