"""Parse a role's ``device_mapping``: the list of global GPU ranks it runs on.

ROLL writes device_mapping as a Python expression (``list(range(0,16))``) and hands it to
``eval``; that lets any config override run code. Here the same spellings are accepted by a
small grammar instead, and nothing is ever evaluated:

    mapping := term ('+' term)*
    term    := '[' [int (',' int)* [',']] ']'
             | 'range(' args ')'
             | 'list(range(' args '))'
    args    := int | int ',' int | int ',' int ',' int

The grammar has no nesting, so parsing is a single left-to-right scan over tokens: input size is
bounded up front, range lengths are computed before anything is materialised, and no input can
recurse, exhaust memory or hang.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from rlbatch.errors import ConfigError

MAX_SPEC_CHARS = 4096
"""Longer device_mapping strings are refused before they are tokenised."""
MAX_GPUS = 65536
"""No role may list more GPU ranks than this (larger than any cluster we know of)."""
_MAX_INT_DIGITS = 9

_TOKEN = re.compile(r"\s*(?:(?P<int>-?[0-9]+)|(?P<word>[A-Za-z_]+)|(?P<sym>[\[\](),+]))")


def _tokens(spec: str, field: str) -> list[str]:
    tokens: list[str] = []
    pos = 0
    end = len(spec.rstrip())
    while pos < end:
        m = _TOKEN.match(spec, pos)
        if m is None:
            raise ConfigError(
                f"{field}: unexpected character {spec[pos:].lstrip()[:1]!r} at position {pos} "
                f"in {spec!r}; expected integer lists, range(...), list(range(...)) joined by '+'"
            )
        tokens.append(m.group(m.lastgroup or "sym"))
        pos = m.end()
    return tokens


class _Scanner:
    """Token cursor with error messages that name the field and the spec."""

    def __init__(self, spec: str, field: str) -> None:
        self.spec, self.field = spec, field
        self.toks = _tokens(spec, field)
        self.i = 0

    def fail(self, what: str) -> ConfigError:
        near = " ".join(self.toks[self.i : self.i + 3]) or "end of input"
        return ConfigError(f"{self.field}: {what} near {near!r} in {self.spec!r}")

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise self.fail(f"expected {expected!r}" if expected else "unexpected end")
        self.i += 1
        return tok

    def integer(self) -> int:
        tok = self.peek()
        if tok is None or not re.fullmatch(r"-?[0-9]+", tok):
            raise self.fail("expected an integer")
        if len(tok.lstrip("-")) > _MAX_INT_DIGITS:
            raise self.fail(f"integer {tok[:12]}... is too large")
        self.i += 1
        return int(tok)


def _range(sc: _Scanner) -> range:
    sc.take("range")
    sc.take("(")
    args = [sc.integer()]
    while sc.peek() == "," and len(args) < 3:
        sc.take(",")
        args.append(sc.integer())
    sc.take(")")
    if len(args) == 3 and args[2] == 0:
        raise ConfigError(f"{sc.field}: range() step must not be zero in {sc.spec!r}")
    return range(*args)


def _term(sc: _Scanner) -> Sequence[int]:
    tok = sc.peek()
    if tok == "[":
        sc.take("[")
        values: list[int] = []
        while sc.peek() != "]":
            values.append(sc.integer())
            if len(values) > MAX_GPUS:
                raise ConfigError(f"{sc.field}: more than {MAX_GPUS} GPU ranks in {sc.spec[:40]!r}...")
            if sc.peek() != "]":
                sc.take(",")
        sc.take("]")
        return values
    if tok == "range":
        return _range(sc)
    if tok == "list":
        sc.take("list")
        sc.take("(")
        r = _range(sc)
        sc.take(")")
        return r
    raise sc.fail("expected '[', 'range(' or 'list(range('")


def _parse_string(spec: str, field: str) -> list[int]:
    if len(spec) > MAX_SPEC_CHARS:
        raise ConfigError(f"{field}: device_mapping string has {len(spec)} characters; the limit is {MAX_SPEC_CHARS}")
    sc = _Scanner(spec, field)
    if not sc.toks:
        raise ConfigError(f"{field}: device_mapping is an empty string")
    parts = [_term(sc)]
    total = len(parts[0])
    while sc.peek() == "+":
        sc.take("+")
        parts.append(_term(sc))
        total += len(parts[-1])
        if total > MAX_GPUS:
            break
    if total > MAX_GPUS:
        raise ConfigError(f"{field}: device_mapping {spec[:60]!r} lists {total} GPU ranks; the limit is {MAX_GPUS}")
    if sc.peek() is not None:
        raise sc.fail("unexpected trailing input")
    return [v for part in parts for v in part]


def _parse_sequence(spec: Sequence[object], field: str) -> list[int]:
    if len(spec) > MAX_GPUS:
        raise ConfigError(f"{field}: device_mapping lists {len(spec)} GPU ranks; the limit is {MAX_GPUS}")
    out: list[int] = []
    for i, v in enumerate(spec):
        # bool is a subclass of int; True must not silently mean GPU 1.
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{field}[{i}]: GPU ranks must be integers, got {type(v).__name__} {v!r}")
        out.append(v)
    return out


def parse_device_mapping(spec: object, field: str = "device_mapping") -> list[int]:
    """Return the GPU ranks that ``spec`` names, in order.

    ``spec`` is a list of ints or a string in the grammar of this module. ``field`` names the
    config field in error messages (e.g. ``roles.actor_train.device_mapping``).
    Raises ConfigError for anything else, for empty lists, negative ranks and duplicates.
    """
    if isinstance(spec, str):
        ranks = _parse_string(spec, field)
    elif isinstance(spec, (list, tuple)):
        ranks = _parse_sequence(spec, field)
    elif hasattr(spec, "__iter__") and hasattr(spec, "__len__") and not isinstance(spec, (bytes, dict)):
        ranks = _parse_sequence(spec, field)  # type: ignore[arg-type]  # omegaconf ListConfig; length checked before copying
    else:
        raise ConfigError(
            f"{field}: expected a list of GPU ranks or a string like 'list(range(0,8))', "
            f"got {type(spec).__name__} {spec!r}"[:300]
        )
    if not ranks:
        raise ConfigError(f"{field}: device_mapping is empty; a GPU role needs at least one GPU rank")
    negatives = sorted({r for r in ranks if r < 0})
    if negatives:
        raise ConfigError(f"{field}: GPU ranks must be >= 0, got {negatives[:8]}")
    seen: set[int] = set()
    dups: list[int] = []
    for r in ranks:
        if r in seen and r not in dups:
            dups.append(r)
        seen.add(r)
    if dups:
        raise ConfigError(f"{field}: GPU ranks listed more than once: {dups[:8]}")
    return ranks
