"""Low-rank adapters (``model.lora``): the one transformation of the model that a trained role
receives, through PEFT. Engines, checkpoints and the optimizer see an ordinary module whose base
weights do not require grad; what leaves it (weight sync, export) is merged back under the base
model's Hugging Face names (``merged``).

    adapted = adapt(model, cfg.model.lora)           # on meta (rlbatch.engines.model.engine_skeleton)
    weights = AdapterInit(base_weights, seed)        # base weights from the model's source, adapters seeded

The adapters start as PEFT starts them (``lora_A`` Kaiming-uniform, ``lora_B`` zero: the adapted
model is the base model at step 0), drawn from the run's seed by name, so every rank and every run
of a seed holds the same adapters whatever the sharding.

A vision-language model (Qwen2-VL / Qwen2.5-VL, ``rlbatch.models.vlm``) gets adapters on its
language model's modules only: its vision tower's are never targeted (``VISION_MODULES``, PEFT's
``exclude_modules``), whatever ``target_modules`` names (Qwen2.5-VL's tower has ``gate_proj``,
``up_proj`` and ``down_proj`` too). The tower stays frozen, as every base weight does under LoRA.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel

    from rlbatch.config.schema import LoraConfig
    from rlbatch.engines.base import EngineContext
    from rlbatch.models.weights import TensorSource

ALL_LINEAR = "all-linear"
VISION_MODULES = r"model\.visual\..*"
"""PEFT's ``exclude_modules`` for a vision-language model: every module of its vision tower (the
patch merger included), by its name in the transformers model."""
_LORA = re.compile(r"\.lora_([AB])\.[^.]+\.weight$")
_PREFIX = "base_model.model."


def enabled(lora: LoraConfig) -> bool:
    """Whether ``model.lora`` asks for adapters."""
    return lora.rank > 0


def of(ctx: EngineContext) -> LoraConfig | None:
    """The adapters an engine's model gets (``model.lora``), or None: only a trained policy (a
    trainable role with the LM head) is adapted; a reference, a critic and a reward model are not."""
    cfg = ctx.model.lora
    return cfg if ctx.trainable and ctx.head == "lm" and enabled(cfg) else None


def trained_names(model: torch.nn.Module) -> set[str]:
    """Names of the parameters that require grad (an adapted model's: its adapters)."""
    return {n for n, p in model.named_parameters() if p.requires_grad}


def peft_config(lora: LoraConfig, vision: bool = False) -> PeftLoraConfig:
    """PEFT's LoraConfig of ``model.lora``; ``vision``: for a vision-language model, its vision tower
    excluded (``VISION_MODULES``)."""
    from peft import LoraConfig

    targets = list(lora.target_modules)
    return LoraConfig(r=int(lora.rank), lora_alpha=float(lora.alpha),  # type: ignore[arg-type]  # a float scales as well
                      lora_dropout=float(lora.dropout), target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets, bias="none",
                      task_type="CAUSAL_LM", exclude_modules=VISION_MODULES if vision else None)


def has_vision(model: torch.nn.Module) -> bool:
    """Whether ``model`` (a transformers model) has a vision tower where Qwen2-VL keeps it (``model.visual``)."""
    return hasattr(getattr(model, "model", None), "visual")


def base_name(name: str) -> str | None:
    """The base model's name of a PEFT-wrapped model's parameter; None for an adapter's."""
    if _LORA.search(name):
        return None
    if name.startswith(_PREFIX):
        name = name[len(_PREFIX):]
    return name.replace(".base_layer.", ".")


def adapt(model: torch.nn.Module, lora: LoraConfig) -> PeftModel:
    """``model`` with adapters (PEFT's ``get_peft_model``): only the adapters require grad (a vision
    tower's modules get none: ``VISION_MODULES``). On a
    model whose parameters are on meta (a skeleton), the adapters are built on meta too."""
    from peft import get_peft_model

    from rlbatch.models.weights import params_on_meta

    cfg = peft_config(lora, vision=has_vision(model))
    if next(model.parameters()).device.type == "meta":
        with params_on_meta():
            return get_peft_model(model, cfg)
    return get_peft_model(model, cfg)


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """A context in which a PEFT-wrapped model (FSDP2 or not) computes as its base model.

    Only each adapted layer's switch is flipped: PEFT's own ``disable_adapter()`` also clears the
    adapters' ``requires_grad`` and sets it back on the module's parameters, which under FSDP2 are
    the sharded ones, while the unsharded parameters the forward uses take their flag when first
    gathered; a first gather inside the context would leave the adapters untrainable."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, was in zip(layers, before, strict=True):
            m._disable_adapters = was


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PEFT wrapper (itself otherwise)."""
    getter = getattr(model, "get_base_model", None)
    return getter() if callable(getter) else model


@dataclass
class AdapterInit:
    """A ``TensorSource`` of an adapted model: adapters as PEFT initialises them, seeded by name
    (``lora_A``: uniform in +-1/sqrt(fan_in), PEFT's Kaiming-uniform with a = sqrt(5); ``lora_B``:
    zeros), every other parameter ``base``'s under its base name."""

    base: TensorSource
    seed: int

    def rows(self, name: str, shape: tuple[int, ...], start: int, end: int) -> torch.Tensor:
        import torch

        m = _LORA.search(name)
        if m is None:
            base = base_name(name)
            assert base is not None
            return self.base.rows(base, shape, start, end)
        if m.group(1) == "B":
            return torch.zeros((end - start, *shape[1:]))
        digest = hashlib.sha256(f"{self.seed}/{name}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        bound = 1.0 / math.sqrt(shape[1])
        return (torch.rand(shape, generator=g) * 2 - 1).mul_(bound)[start:end]


def scaling(lora: LoraConfig) -> float:
    """PEFT's scale of an adapter's update: alpha / rank."""
    return float(lora.alpha) / int(lora.rank)


def merged(named: Iterable[tuple[str, torch.Tensor]], scale: float) -> list[tuple[str, torch.Tensor]]:
    """A PEFT-wrapped model's tensors (whole, e.g. one FSDP unit's, gathered) as the base model's:
    each adapted weight merged, ``W + scale * B @ A`` computed in fp32 and cast to W's dtype,
    under the base name; the adapters themselves dropped. Other tensors pass under their base names."""
    named = list(named)
    adapters = {(name[: m.start()], m.group(1)): t for name, t in named if (m := _LORA.search(name))}
    out = []
    for name, t in named:
        base = base_name(name)
        if base is None:
            continue
        stem = name.removesuffix(".base_layer.weight")
        if (stem, "A") in adapters and (stem, "B") in adapters:
            t = (t.float() + scale * (adapters[stem, "B"].float() @ adapters[stem, "A"].float())).to(t.dtype)
        out.append((base, t))
    return out


def base_shapes(named: Sequence[tuple[str, torch.Size]]) -> list[tuple[str, torch.Size]]:
    """(base name, shape) of a PEFT-wrapped model's non-adapter parameters, in order."""
    return [(b, shape) for n, shape in named if (b := base_name(n)) is not None]


def unwrapped(name: str) -> str:
    """A parameter's name inside PEFT's wrapper (``base_model.model.`` dropped; an adapter's keeps its
    ``lora_A``/``lora_B`` part): the Hugging Face layout, for grouping by decoder layer."""
    return name.removeprefix(_PREFIX)


SYNC_FORMS = ("auto", "merged", "adapter")
"""``model.lora.sync``: what a LoRA policy's weight sync moves (docs/lora.md)."""


def sync_form(lora: LoraConfig, loads_adapters: bool) -> str | None:
    """What a weight sync into an inference engine moves: 'adapter' (the adapters alone) when
    ``model.lora.sync`` asks for them or says 'auto' and the engine loads adapters
    (``EngineSpec.loads_adapters``), else 'merged'; None without adapters (every weight, as trained)."""
    if not enabled(lora):
        return None
    want = lora.sync
    return "adapter" if want == "adapter" or (want == "auto" and loads_adapters) else "merged"


def adapter_name(name: str) -> str | None:
    """An adapter parameter's name as PEFT saves it (the adapter's own name dropped:
    ``base_model.model.<module>.lora_A.weight``, what vLLM reads); None for a base parameter."""
    m = _LORA.search(name)
    return None if m is None else f"{name[: m.start()]}.lora_{m.group(1)}.weight"


def adapter_shapes(model: torch.nn.Module, lora: LoraConfig) -> dict[str, torch.Size]:
    """{``adapter_name``: shape} of the adapters ``adapt`` gives ``model`` (which it wraps in place:
    pass a model built for this, on meta or about to be dropped)."""
    return {a: p.shape for n, p in adapt(model, lora).named_parameters() if (a := adapter_name(n)) is not None}


def adapter_config(lora: LoraConfig) -> dict[str, object]:
    """PEFT's adapter_config.json of ``model.lora`` as a plain mapping (what an engine that loads
    adapters reads beside their tensors)."""
    cfg = peft_config(lora).to_dict()
    targets = cfg.get("target_modules")
    if isinstance(targets, (set, frozenset)):
        cfg["target_modules"] = sorted(targets)
    return cfg
