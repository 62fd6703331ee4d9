"""Parse backend strings: ``<engine>:<dims>`` (AReaL's allocation syntax).

    fsdp:d4t2                                 data 4 x tensor 2 = 8 GPUs
    vllm:d2t4                                 2 inference engines of 4 GPUs each
    megatron:d2p2t4e4                         16 GPUs; e folds experts onto the same mesh
    megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)     MoE parallel folding: attention and experts
                                              use different layouts of the same 32 GPUs

Dims are ``d`` (data), ``t`` (tensor), ``p`` (pipeline), ``c`` (context), ``e`` (expert), each a
positive integer, at most once, in any order; a missing dim is 1. World size is d*t*p*c: expert
parallelism redistributes experts inside that mesh and adds no GPUs, except in a hybrid ``ffn``
section, whose world is d*t*p*e and must equal attn's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from rlbatch.engines.registry import REGISTRY, EngineKind
from rlbatch.errors import ConfigError

MAX_BACKEND_CHARS = 256
MAX_DIM = 1 << 20


DIM_NAMES = {"d": "data", "t": "tensor", "p": "pipeline", "c": "context", "e": "expert"}

_DIMS_RE = re.compile(r"(?:[dtpce][0-9]+)+")
_DIM_RE = re.compile(r"([dtpce])([0-9]+)")
_HYBRID_RE = re.compile(r"\(\s*attn\s*:\s*([^|()]*)\|\s*ffn\s*:\s*([^|()]*)\)")


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the parallel dimensions of one mesh."""

    d: int = 1
    t: int = 1
    p: int = 1
    c: int = 1
    e: int = 1

    @property
    def world_size(self) -> int:
        """GPUs in the mesh: d*t*p*c (expert parallelism folds into it)."""
        return self.d * self.t * self.p * self.c

    def spec(self, letters: str = "dptce") -> str:
        """Canonical dims string, omitting dims equal to 1 (``d1`` when all are 1)."""
        out = "".join(f"{k}{getattr(self, k)}" for k in letters if getattr(self, k) != 1)
        return out or "d1"


@dataclass(frozen=True)
class BackendSpec:
    """A parsed backend string. For a hybrid MoE spec, the top-level dims are attn's."""

    engine: str
    dims: ParallelDims
    attn: ParallelDims | None = None
    ffn: ParallelDims | None = None
    """For hybrid specs, the expert layout; its world is d*t*p*e."""

    @property
    def kind(self) -> EngineKind:
        return REGISTRY[self.engine].kind

    @property
    def is_hybrid(self) -> bool:
        return self.ffn is not None

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def d(self) -> int:
        return self.dims.d

    @property
    def t(self) -> int:
        return self.dims.t

    @property
    def p(self) -> int:
        return self.dims.p

    @property
    def c(self) -> int:
        return self.dims.c

    @property
    def e(self) -> int:
        return self.dims.e

    @property
    def num_gpus_per_worker(self) -> int:
        """ROLL's rule: 1 for training engines, t*p (one engine instance) for inference."""
        return 1 if self.kind is EngineKind.TRAIN else self.t * self.p

    def __str__(self) -> str:
        if self.attn is not None and self.ffn is not None:
            return f"{self.engine}:(attn:{self.attn.spec('dptc')}|ffn:{self.ffn.spec('dpte')})"
        return f"{self.engine}:{self.dims.spec()}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"spec": str(self), "engine": self.engine, "kind": self.kind.value,
                               "world_size": self.world_size, **_dims_dict(self.dims)}
        if self.attn is not None and self.ffn is not None:
            out["attn"] = _dims_dict(self.attn)
            out["ffn"] = _dims_dict(self.ffn) | {"world_size": _ffn_world(self.ffn)}
        return out


def _dims_dict(dims: ParallelDims) -> dict[str, int]:
    return {k: getattr(dims, k) for k in "dtpce"}


def _ffn_world(ffn: ParallelDims) -> int:
    return ffn.d * ffn.t * ffn.p * ffn.e


def _parse_dims(text: str, allowed: str, where: str, field: str, spec: str) -> dict[str, int]:
    """Parse ``d4t2``-style dims into a dict of the letters present."""
    text = text.strip()
    if not text:
        raise ConfigError(f"{field}: {where} has no dims in {spec!r}; write e.g. 'd4t2'")
    if not _DIMS_RE.fullmatch(text):
        raise ConfigError(
            f"{field}: cannot parse dims {text!r} in {spec!r}; dims are letters from 'dtpce' "
            f"each followed by a positive integer, e.g. 'd4t2'"
        )
    found: dict[str, int] = {}
    for letter, number in _DIM_RE.findall(text):
        if letter in found:
            raise ConfigError(f"{field}: dim '{letter}' appears more than once in {where} of {spec!r}")
        if len(number) > 7 or int(number) > MAX_DIM:
            raise ConfigError(f"{field}: {DIM_NAMES[letter]} size {number} in {spec!r} is larger than {MAX_DIM}")
        if int(number) < 1:
            raise ConfigError(f"{field}: {DIM_NAMES[letter]} size must be >= 1, got {letter}{number} in {spec!r}")
        if letter not in allowed:
            raise ConfigError(
                f"{field}: {where} does not accept '{letter}' ({DIM_NAMES[letter]} parallel) in "
                f"{spec!r}; it accepts {', '.join(allowed)}"
            )
        found[letter] = int(number)
    return found


def parse_backend(spec: object, field: str = "backend") -> BackendSpec:
    """Parse ``<engine>:<dims>`` or ``megatron:(attn:<dims>|ffn:<dims>)``.

    Raises ConfigError naming ``field`` for bare dims, unknown engines, dims the engine does not
    support, repeated or non-positive dims, and inconsistent hybrid sections.
    """
    if not isinstance(spec, str):
        raise ConfigError(f"{field}: expected a backend string like 'fsdp:d4t2', got {type(spec).__name__} {spec!r}"[:300])
    if len(spec) > MAX_BACKEND_CHARS:
        raise ConfigError(f"{field}: backend string has {len(spec)} characters; the limit is {MAX_BACKEND_CHARS}")
    text = spec.strip()
    known = ", ".join(REGISTRY)
    if ":" not in text:
        if _DIMS_RE.fullmatch(text):
            raise ConfigError(f"{field}: bare dims {text!r} need an engine prefix, e.g. 'fsdp:{text}' (engines: {known})")
        raise ConfigError(f"{field}: expected '<engine>:<dims>' such as 'fsdp:d4t2', got {spec!r} (engines: {known})")
    engine, _, rest = text.partition(":")
    engine = engine.strip()
    if engine not in REGISTRY:
        raise ConfigError(f"{field}: unknown engine {engine!r} in {spec!r}; known engines: {known}")
    allowed = REGISTRY[engine].planned_dims or REGISTRY[engine].dims
    rest = rest.strip()
    if rest.startswith("("):
        return _parse_hybrid(engine, rest, field, spec)
    dims = ParallelDims(**_parse_dims(rest, allowed, f"engine '{engine}'", field, spec))
    return BackendSpec(engine=engine, dims=dims)


def _parse_hybrid(engine: str, rest: str, field: str, spec: str) -> BackendSpec:
    if engine != "megatron":
        raise ConfigError(f"{field}: the hybrid (attn:...|ffn:...) form is only for megatron, not {engine!r}, in {spec!r}")
    m = _HYBRID_RE.fullmatch(rest)
    if m is None:
        raise ConfigError(f"{field}: cannot parse {spec!r}; the hybrid form is 'megatron:(attn:<dims>|ffn:<dims>)'")
    attn_d = _parse_dims(m.group(1), "dtpc", "the attn section", field, spec)
    ffn_d = _parse_dims(m.group(2), "dtpe", "the ffn section", field, spec)
    attn = ParallelDims(**attn_d)
    problems = []
    if attn.p != ffn_d.get("p", 1):
        problems.append(f"pipeline size must match: attn has p{attn.p}, ffn has p{ffn_d.get('p', 1)}")
    if "d" not in ffn_d:
        denom = ffn_d.get("t", 1) * ffn_d.get("p", 1) * ffn_d.get("e", 1)
        if attn.world_size % denom:
            problems.append(
                f"cannot derive ffn d: attn world {attn.world_size} is not divisible by "
                f"ffn t*p*e = {denom}"
            )
        else:
            ffn_d["d"] = attn.world_size // denom
    ffn = ParallelDims(**ffn_d)
    if not problems and _ffn_world(ffn) != attn.world_size:
        problems.append(
            f"world sizes differ: attn d*t*p*c = {attn.world_size}, ffn d*t*p*e = {_ffn_world(ffn)}"
        )
    if problems:
        raise ConfigError([f"{field}: {p} in {spec!r}" for p in problems])
    return BackendSpec(engine=engine, dims=attn, attn=attn, ffn=ffn)


@dataclass(frozen=True)
class RoleEngine:
    """A GPU role's parsed backend."""

    role: str
    backend: BackendSpec
    inherited: bool
    """The role has no backend of its own and takes actor_train's."""
