"""Where a model's weights come from, read by rows, and how a model whose parameters are still on
the meta device is filled from them.

A sharded engine builds only its own shard: FSDP2 splits every parameter along dim 0 into
``c = ceil(n / d)``-row chunks, rank ``r`` holding rows ``[r*c, min((r+1)*c, n))``, so each rank
reads just those rows of each tensor (``TensorSource.rows``), never a whole one. A model built
whole (the inference engines, the deepspeed and megatron engines, export) reads rows ``[0, n)``
of the same source: both hold the same numbers. Sources:

- ``RandomInit``: the seeded random initialisation of a random-init model. Each tensor is drawn
  in fixed blocks of rows, each block from its own generator seeded by (seed, tensor name, block
  index), so any range of rows is drawn without drawing the rest, and the numbers do not depend on
  the order tensors are built in or on how many ranks share them.
- ``SafetensorsFiles``: a model directory's safetensors files, read with ``get_slice`` (only the
  requested rows are touched).
- ``Tensors``: tensors in memory (a few head parameters; or a whole model read the ordinary way
  when its files cannot be read by rows).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

BLOCK_ELEMENTS = 1 << 20
"""Random-init tensors are drawn in blocks of rows of about this many elements (4 MiB of fp32):
a rank's rows cost at most one block more than the rows themselves."""


class TensorSource(Protocol):
    def rows(self, name: str, shape: tuple[int, ...], start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` (dim 0) of the parameter ``name`` of full ``shape``, in the source's dtype."""
        ...


@dataclass(frozen=True)
class InitRule:
    """How one parameter starts: 'normal' (mean 0, the model's initializer_range), 'ones' or 'zeros';
    ``zero_row``: a row set to zero after drawing (an embedding's padding row)."""

    kind: str
    zero_row: int | None = None


def init_rules(model: torch.nn.Module) -> dict[str, InitRule]:
    """The distribution of every parameter of a transformers model as its own ``_init_weights``
    draws it: linear and embedding weights normal (the embedding's padding row zero), biases zero,
    norm weights one; anything else with two or more dims (routers, experts) normal."""
    rules: dict[str, InitRule] = {}
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            if name in rules:
                continue
            cls = type(module).__name__
            if isinstance(module, torch.nn.Embedding):
                rules[name] = InitRule("normal", module.padding_idx)
            elif p_name == "bias":
                rules[name] = InitRule("zeros")
            elif "Norm" in cls or p.dim() < 2:
                rules[name] = InitRule("ones")
            else:
                rules[name] = InitRule("normal")
    # A tied parameter is listed once by named_parameters(): under its first name.
    return {n: rules[n] for n, _ in model.named_parameters()}


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class RandomInit:
    """The seeded initialisation of a random-init model (see the module docstring)."""

    seed: int
    std: float
    rules: dict[str, InitRule]

    def rows(self, name: str, shape: tuple[int, ...], start: int, end: int) -> torch.Tensor:
        rule = self.rules[name]
        rest = tuple(shape[1:])
        if rule.kind == "ones":
            return torch.ones((end - start, *rest))
        if rule.kind == "zeros":
            return torch.zeros((end - start, *rest))
        out = torch.empty((end - start, *rest))
        if end <= start:
            return out
        per_block = max(1, BLOCK_ELEMENTS // max(1, int(torch.Size(rest).numel())))
        for block in range(start // per_block, (end - 1) // per_block + 1):
            b0, b1 = block * per_block, min((block + 1) * per_block, shape[0])
            g = torch.Generator().manual_seed(_block_seed(self.seed, name, block))
            drawn = torch.randn((b1 - b0, *rest), generator=g).mul_(self.std)
            lo, hi = max(b0, start), min(b1, end)
            out[lo - start : hi - start] = drawn[lo - b0 : hi - b0]
        if rule.zero_row is not None and start <= rule.zero_row < end:
            out[rule.zero_row - start] = 0
        return out


def random_init(model: torch.nn.Module, seed: int) -> RandomInit:
    """The random initialisation of ``model`` (a transformers model: its config's initializer_range)."""
    std = float(getattr(model.config, "initializer_range", None) or 0.02)
    return RandomInit(seed, std, init_rules(model))


class SafetensorsFiles:
    """A model directory's weights: ``model.safetensors``, or the files its
    ``model.safetensors.index.json`` maps names to."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.path / f for name, f in weight_map.items()}
        elif single.is_file():
            with safe_open(single, framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), single)
        else:
            raise FileNotFoundError(f"{self.path}: no model.safetensors or model.safetensors.index.json")

    @staticmethod
    def found(path: str | Path) -> bool:
        p = Path(path)
        return (p / "model.safetensors.index.json").is_file() or (p / "model.safetensors").is_file()

    def names(self) -> set[str]:
        return set(self.files)

    def rows(self, name: str, shape: tuple[int, ...], start: int, end: int) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.files[name], framework="pt") as f:
            sl = f.get_slice(name)
            stored = tuple(sl.get_shape())
            if stored != tuple(shape):
                raise ValueError(f"{self.files[name]}: {name} has shape {stored}, the model's is {tuple(shape)}")
            return sl[start:end]


@dataclass
class Tensors:
    """Whole tensors in memory by name, and for every other name ``base``'s."""

    tensors: Mapping[str, torch.Tensor]
    base: TensorSource | None = None

    def rows(self, name: str, shape: tuple[int, ...], start: int, end: int) -> torch.Tensor:
        if name in self.tensors:
            t = self.tensors[name]
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: shape {tuple(t.shape)}, the model's is {tuple(shape)}")
            return t[start:end]
        if self.base is None:
            raise KeyError(f"no weights for {name}")
        return self.base.rows(name, shape, start, end)


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Build modules with their parameters on the meta device and their buffers real (rotary
    tables: computed in the modules' constructors, nowhere else). A parameter is moved to meta as
    it is registered, before any initialisation writes it: its host memory is never touched. Not for
    threads: while it is active, every module built in the process gets meta parameters."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        p = module._parameters[name]
        if p is not None and p.device.type != "meta":
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def params_to_meta(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Move an already built model's parameters to the meta device (tied ones stay tied); returns
    the tensors they held, by name, as a source for ``materialise``."""
    held = {n: p.detach() for n, p in model.named_parameters()}
    originals = list(model.parameters())  # alive through the loop: their ids stay theirs
    moved: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None:
                if id(p) not in moved:
                    moved[id(p)] = type(p)(p.detach().to("meta"), requires_grad=p.requires_grad)
                module._parameters[key] = moved[id(p)]
    del originals
    return held


def cast_params(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Parameters (on meta: free) to ``dtype``; buffers (rotary tables) keep theirs."""
    for p in model.parameters():
        if p.dtype != dtype:
            p.data = p.data.to(dtype)


def allocate(model: torch.nn.Module, device: torch.device) -> None:
    """Give every meta parameter uninitialised memory on ``device`` (FSDP2 shards: only the local
    shard), keeping the buffers' values."""
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    slots: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((module, key))
    model.to_empty(device=device)
    # to_empty gives each module's slot a Parameter of its own: a tied parameter (the lm head that is
    # the embedding) would come apart. Every slot gets the one of its first holder, the name
    # named_parameters() (and FSDP2) know it by.
    for (first, key), *others in slots.values():
        for module, other in others:
            module._parameters[other] = first._parameters[key]
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])


def local_rows(p: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The tensor this rank holds of parameter ``p`` and the global index of its first row: an
    FSDP2 shard (a DTensor sharded along dim 0: ``to_local()``; over each mesh dimension that shards
    it, ``ceil(n/m)``-row chunks as ``torch.chunk`` makes them, rank r taking the r-th), or the
    whole tensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor):
        return p.detach(), 0
    local = p.to_local()
    start, rows = 0, p.shape[0]
    for dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard) and placement.dim == 0:
            chunk = -(-rows // p.device_mesh.size(dim))
            offset = min(p.device_mesh.get_local_rank(dim) * chunk, rows)
            start, rows = start + offset, min(chunk, rows - offset)
        elif not isinstance(placement, Replicate):
            raise NotImplementedError(f"only dim-0 shards are filled by rows, not {p.placements}")
    assert rows == local.shape[0], f"local shard of {local.shape[0]} rows, FSDP2's layout gives {rows}"
    return local, start


@torch.no_grad()
def materialise(model: torch.nn.Module, source: TensorSource) -> None:
    """Fill every parameter this rank holds (``allocate`` first) from ``source``: its rows only."""
    for name, p in model.named_parameters():
        if p.dim() == 0:
            raise NotImplementedError(f"{name}: a 0-dim parameter is not read by rows")
        local, start = local_rows(p)
        if local.numel():
            local.copy_(source.rows(name, tuple(p.shape), start, start + local.shape[0]))


def on_meta_by_default() -> bool:
    """Whether the caller builds under ``torch.device('meta')`` (shapes only: nothing to fill)."""
    return torch.get_default_device().type == "meta"
