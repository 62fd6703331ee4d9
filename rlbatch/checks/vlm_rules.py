"""What validation refuses about a vision-language policy (``model.arch=qwen2_vl|qwen2_5_vl``, or a
``model.path`` whose config.json ``model_type`` is one): the engines and features whose image path
is not built, each named, before anything starts. The model itself: ``rlbatch.models.vlm``."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from rlbatch.config.schema import ModelConfig, RLBatchConfig
from rlbatch.engines.registry import spec_of
from rlbatch.models.lora import sync_form
from rlbatch.models.spec import vlm_arch
from rlbatch.placement.backend import RoleEngine

IMAGE_ENGINES = ("hf", "fsdp", "deepspeed")
"""Engines that run a vision-language model (generate from, or train on, prompts with images)."""

NO_IMAGE_PATH = {
    "megatron": "its model is Megatron-Core's GPT built from a Hugging Face text decoder's weights: it has no "
                "Qwen2-VL weight mapping and no vision tower (nor the multimodal rotary positions)",
}
"""Why an engine does not run a vision-language model, where there is more to say than that it does not."""

VLLM_IMAGE_PLUGIN = "rlbatch.engines.vllm.vlm_plugin"
"""The module that lets vLLM's CPU build load Qwen2-VL without torchvision: vLLM runs a VLM where it is built."""


def image_engines() -> tuple[str, ...]:
    """``IMAGE_ENGINES``, plus vllm where this build has its vision-language plugin."""
    try:
        plugin = importlib.util.find_spec(VLLM_IMAGE_PLUGIN) is not None
    except ModuleNotFoundError:  # rlbatch.engines.vllm itself absent
        plugin = False
    return (*IMAGE_ENGINES, "vllm") if plugin else IMAGE_ENGINES


def vlm_problems(cfg: RLBatchConfig, engines: Sequence[RoleEngine]) -> list[str]:
    """With a vision-language policy: each role whose engine has no image path, context parallelism,
    what LoRA adapters do not take (``vlm_lora_problems``), and a critic or a reward model built from
    the policy."""
    arch = vlm_arch(cfg.model)
    if arch is None:
        return []
    what = f"model {cfg.model.path or 'model.arch=' + arch} is a vision-language model ({arch})"
    ok = image_engines()
    problems = []
    for e in engines:
        if e.role in ("critic", "reward"):
            problems.append(f"roles.{e.role}: {what}: a {e.role} model built from a vision-language policy is not built "
                            f"in this build (a rule reward, roles.reward.world_size, and critic-free algorithms are)")
        elif e.backend.engine not in ok:
            why = f" ({NO_IMAGE_PATH[e.backend.engine]})" if e.backend.engine in NO_IMAGE_PATH else ""
            problems.append(f"roles.{e.role}.backend: {e.backend.engine}: {what}, and the {e.backend.engine} engine "
                            f"does not run vision-language models in this build{why}; use one of {', '.join(ok)}")
        elif e.backend.engine == "fsdp" and e.backend.dims.t > 1:
            problems.append(f"roles.{e.role}.backend: tensor parallelism t = {e.backend.dims.t} with {what}: the fsdp "
                            f"engine's tensor-parallel plan for a vision-language model is not built; use t1")
        elif e.backend.dims.c > 1:
            problems.append(f"roles.{e.role}.backend: context parallelism c = {e.backend.dims.c} with {what}: "
                            f"splitting a row would split its images' tokens and multimodal positions, not built; use c1")
    return problems + vlm_lora_problems(cfg, engines, what) + vlm_schedule_problems(cfg)


def vlm_lora_problems(cfg: RLBatchConfig, engines: Sequence[RoleEngine], what: str) -> list[str]:
    """``model.lora`` on a vision-language policy: adapters go on the language model only
    (``rlbatch.models.lora.VISION_MODULES``), trained by fsdp and deepspeed, synced merged. Refused:
    ``model.train_vision`` (the adapted model's base weights, the tower's included, stay frozen), and an
    adapter-only sync into an engine that loads adapters (vLLM's LoRA path for a vision-language model
    is untested here)."""
    lora = cfg.model.lora
    if lora.rank <= 0:
        return []
    problems = []
    if cfg.model.train_vision:
        problems.append(f"model.train_vision: true with model.lora.rank {lora.rank}: {what}; with adapters every base "
                        f"weight stays frozen and no adapter goes on the vision tower, so the tower would not train; "
                        f"use model.train_vision=false (adapters on the language model) or model.lora.rank=0")
    for e in engines:
        if e.role == "actor_infer" and sync_form(lora, spec_of(e.backend.engine).loads_adapters) == "adapter":
            problems.append(f"model.lora.sync: {lora.sync}: adapter-only syncs into the {e.backend.engine} engine of "
                            f"roles.{e.role} with {what} are not built in this build (its LoRA path for a "
                            f"vision-language model is untested); use model.lora.sync=merged")
    return problems


def image_data_problem(path: str, with_images: int, records: int, model: ModelConfig) -> str | None:
    """Why a run cannot train on a data file of which ``with_images`` of ``records`` records carry
    images, or None: a text policy cannot read them."""
    if vlm_arch(model) is not None:
        return None
    return (f"data.path: {path}: {with_images} of its {records} usable records carry images, and model "
            f"{model.path or 'model.arch=' + model.arch} is a text model; use a vision-language one "
            f"(model.arch=qwen2_vl|qwen2_5_vl, or a model.path of that model_type)")


IMAGE_TASKS = ("vlm_shapes",)
"""``data.name`` builders whose prompts carry images (``rlbatch.data.source.problems_of``)."""


def image_task_problems(cfg: RLBatchConfig, runnable: bool) -> list[str]:
    """A run with prompts that carry images (a built-in task of ``IMAGE_TASKS``, or a data file's,
    which ``image_data_problem`` checks): what their path through the run does not take yet, each
    named. A text policy cannot read them; with a vision-language policy the images go from the
    controller to the generate ranks with each prompt and the image fields move on to the trainers
    (``rlbatch.phases.IMAGE_FIELDS``); what that path does not take is ``vlm_schedule_problems``."""
    tasks = [(field, section.name) for field, section in (("data", cfg.data), ("eval.data", cfg.eval.data))
             if section.name in IMAGE_TASKS]
    if not tasks or not runnable:
        return []
    if vlm_arch(cfg.model) is None:
        return [f"{field}.name: {name}: its prompts carry images, and model {cfg.model.path or 'model.arch=' + cfg.model.arch} "
                f"is a text model; use a vision-language one (model.arch=qwen2_vl|qwen2_5_vl)" for field, name in tasks]
    return []


def vlm_schedule_problems(cfg: RLBatchConfig) -> list[str]:
    """What a run of a vision-language policy does not do yet: keep images in an asynchronous run's
    rollout buffer (``algo.max_staleness``), generate them under in-flight weight updates, or play
    them in an environment's turns."""
    arch = vlm_arch(cfg.model)
    if arch is None:
        return []
    problems = []
    if cfg.algo.max_staleness > 0:
        problems.append(f"algo.max_staleness: {cfg.algo.max_staleness}: asynchronous training of a {arch} policy is not "
                        f"built (the rollout buffer's images across a checkpoint are untested); use algo.max_staleness=0")
    if cfg.env.name:
        problems.append(f"env.name: {cfg.env.name}: multi-turn episodes with a {arch} policy are not built (an "
                        f"environment's observations are text); use a single-turn task")
    return problems
