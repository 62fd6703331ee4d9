"""What validation refuses about ``model.lora`` (``lora_problems``): a trained policy on an engine that
does not train adapters, target modules the model does not have, an adapter sync into an inference
engine that does not load adapters. The adapters themselves: ``rlbatch.models.lora``."""

from __future__ import annotations

from collections.abc import Sequence

from rlbatch.config.schema import LoraConfig, ModelConfig, RLBatchConfig
from rlbatch.engines.registry import REGISTRY, spec_of
from rlbatch.models.lora import ALL_LINEAR, SYNC_FORMS
from rlbatch.models.spec import vlm_arch
from rlbatch.placement.backend import RoleEngine


def lora_problems(cfg: RLBatchConfig, engines: Sequence[RoleEngine]) -> list[str]:
    """What validation refuses about ``model.lora`` (``engines``: the roles' parsed backends): a
    trained policy on an engine that does not train adapters, target modules the model does not have."""
    lora = cfg.model.lora
    if lora.rank <= 0:
        return []  # off (its range is the schema's)
    problems = sync_problems(lora, engines)
    trains = [name for name, spec in REGISTRY.items() if spec.trains_adapters]
    for e in engines:
        if e.role == "actor_train" and not spec_of(e.backend.engine).trains_adapters:
            problems.append(f"model.lora.rank: {lora.rank}: the {e.backend.engine} engine of roles.actor_train does not "
                            f"train adapters in this build ({', '.join(trains)} do); use {' or '.join(trains)}, "
                            f"or model.lora.rank=0")
    targets = lora.target_modules
    if not targets or not all(isinstance(t, str) and t for t in targets):
        return [*problems, f"model.lora.target_modules: {targets!r}: expected a non-empty list of module names "
                           f"or [{ALL_LINEAR}]"]
    if targets == [ALL_LINEAR]:
        return problems
    if ALL_LINEAR in targets:
        return [*problems, f"model.lora.target_modules: {targets}: {ALL_LINEAR!r} stands alone"]
    layers = _linear_layers(cfg.model)
    if layers is None:
        return problems
    linear, tied = layers
    if absent := [t for t in targets if t not in linear]:
        model = "the language model (a vision-language model's tower gets no adapters)" if vlm_arch(cfg.model) else "the model"
        problems.append(f"model.lora.target_modules: {absent} name no linear layer of {model}; its linear layers: "
                        f"{sorted(linear)}")
    if shared := [t for t in targets if t in tied]:
        untie = ("set model.tie_word_embeddings=false" if not cfg.model.path
                 else "or untie them in the model's config.json")
        problems.append(f"model.lora.target_modules: {shared} share their weight with another module "
                        f"({'; '.join(f'{t}: {tied[t]}' for t in shared)}): an adapter merged into a shared weight "
                        f"reaches the inference engine as a different model than the trainer's; target other "
                        f"modules, {untie}")
    return problems


def _linear_layers(model_cfg: ModelConfig) -> tuple[set[str], dict[str, str]] | None:
    """The last names of the model's linear layers, and those among them whose weight is another
    module's too (an LM head tied to the input embedding) with that module's weight's name; built on
    meta (no memory). A vision-language model's: its language model's (adapters never go on its
    vision tower, ``rlbatch.models.lora.VISION_MODULES``). None when the model cannot be built here
    (its own checks say why)."""
    import torch

    from rlbatch.models.lora import has_vision

    vlm = vlm_arch(model_cfg)
    try:
        from rlbatch.models.spec import char_vocab_size

        if model_cfg.path:
            from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

            auto = AutoModelForImageTextToText if vlm is not None else AutoModelForCausalLM
            with torch.device("meta"):
                model = auto.from_config(AutoConfig.from_pretrained(model_cfg.path))
        elif vlm is not None:
            from rlbatch.engines.model import load_tokenizer
            from rlbatch.models.spec import spec_from_model_config
            from rlbatch.models.vlm import VisionSpec, vlm_skeleton

            tok = load_tokenizer(model_cfg)
            model = vlm_skeleton(spec_from_model_config(model_cfg, vocab=len(tok)), VisionSpec(), tok,
                                 "qwen2_5_vl" if vlm == "qwen2_5_vl" else "qwen2_vl")
        else:
            from rlbatch.models.spec import spec_from_model_config
            from rlbatch.models.tiny import tiny_skeleton

            with torch.device("meta"):
                model = tiny_skeleton(spec_from_model_config(model_cfg, vocab=char_vocab_size()))
    except Exception:  # noqa: BLE001 - the model's own checks report a model that does not build
        return None
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    linear, tied = set(), {}
    tower = "model.visual." if has_vision(model) else None
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and not (tower and name.startswith(tower)):
            last = name.rsplit(".", 1)[-1]
            linear.add(last)
            if others := [n for n in names.get(id(m.weight), []) if n != f"{name}.weight"]:
                tied[last] = f"{name}.weight is {others[0]}"
    return linear, tied


def sync_problems(lora: LoraConfig, engines: Sequence[RoleEngine]) -> list[str]:
    """What validation refuses about ``model.lora.sync`` (``engines``: the roles' parsed backends): a
    value not in ``SYNC_FORMS``, and 'adapter' into an inference engine that does not load adapters."""
    want = lora.sync
    if want not in SYNC_FORMS:
        return [f"model.lora.sync: {want!r} is not one of {list(SYNC_FORMS)}"]
    if want != "adapter":
        return []
    loaders = sorted(name for name, spec in REGISTRY.items() if spec.loads_adapters and spec.built)
    return [f"model.lora.sync: adapter: the {e.backend.engine} engine of roles.{e.role} does not load adapters "
            f"({', '.join(loaders)} does); use model.lora.sync=merged (or auto: adapters where the engine loads them)"
            for e in engines if e.role == "actor_infer" and not spec_of(e.backend.engine).loads_adapters]
