"""Load the policy model and its tokenizer: a local HF directory, or a random-init tiny model.

Every rank builds the same random initialisation from ``cfg.seed``, so actor_train, actor_infer
and reference start identical without any transfer.

Two ways to build an engine's model, which give the same tensors: ``load_model`` /
``load_engine_model`` build it whole on the host (the inference engines, deepspeed, megatron,
export); ``engine_skeleton`` gives it with its parameters on the meta device and the source of its
weights (``rlbatch.models.weights``), so a sharded engine (fsdp) fills only its own shard: the
rows of the seeded random initialisation, or of the directory's safetensors files, that it holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

from rlbatch.models import lora
from rlbatch.models.spec import vlm_arch
from rlbatch.models.weights import (
    SafetensorsFiles,
    Tensors,
    TensorSource,
    allocate,
    cast_params,
    materialise,
    on_meta_by_default,
    params_on_meta,
    params_to_meta,
    random_init,
)

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    from rlbatch.config.schema import ModelConfig
    from rlbatch.engines.base import EngineContext
    from rlbatch.models.spec import ModelSpec
    from rlbatch.models.vlm import ImageOnly

log = logging.getLogger(__name__)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def model_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bf16 on GPU and fp32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def load_tokenizer(model_cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The policy's tokenizer; a random-init vision-language model's is the character tokenizer with
    Qwen2-VL's vision tokens added (``rlbatch.models.vlm.add_vision_tokens``)."""
    if model_cfg.path:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_cfg.path)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        return tok
    from rlbatch.data.tokenizer import build_char_tokenizer

    char = build_char_tokenizer()
    if vlm_arch(model_cfg) is not None:
        from rlbatch.models.vlm import add_vision_tokens

        add_vision_tokens(char)
    return char


def load_processor(model_cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> ImageOnly:
    """The image-text processor of a vision-language policy (``rlbatch.models.vlm``): ``model.path``'s
    (its tokenizer, PIL image processor and chat template), or for a random-init model ``tokenizer``
    (``load_tokenizer``'s) with the default ``VisionSpec``'s image processor."""
    from rlbatch.models.vlm import VisionSpec, build_processor
    from rlbatch.models.vlm import load_processor as load_dir_processor

    arch = vlm_arch(model_cfg)
    if arch is None:
        raise ValueError(f"model: {model_cfg.path or model_cfg.arch} is not a vision-language model")
    if model_cfg.path:
        return load_dir_processor(model_cfg.path)
    return build_processor(tokenizer, VisionSpec(), "qwen2_5_vl" if arch == "qwen2_5_vl" else "qwen2_vl")


VISION_PREFIX = "model.visual."
"""Where a Qwen2-VL / Qwen2.5-VL model (transformers 5, in memory) keeps its vision tower, the patch
merger included."""


def freeze_vision(model: torch.nn.Module, train_vision: bool) -> list[str]:
    """Unless ``train_vision``, the vision tower's parameters (``VISION_PREFIX``, under PEFT's or
    FSDP's wrappers too) get requires_grad False, so they get no gradient and an optimizer built
    from the trainable parameters holds no state for them. The names frozen."""
    if train_vision:
        return []
    frozen = [(n, p) for n, p in model.named_parameters() if f".{VISION_PREFIX}" in f".{n}"]
    for _, p in frozen:
        p.requires_grad_(False)
    return [n for n, _ in frozen]


def load_model(model_cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int,
               dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A transformers causal LM in ``dtype`` on the CPU (engines move it to their device).

    Random-init: the ``ModelSpec`` of ``model_cfg`` with the tokenizer's vocabulary, the same
    description the planner counts, initialised from ``seed``. A model directory: its safetensors
    files read one tensor at a time into the model's own memory, so loading holds the model and one
    tensor of the files, not the memory-mapped files beside it; files that cannot be read by name
    are loaded by ``from_pretrained``. Under ``torch.device("meta")``: shapes only."""
    if model_cfg.path:
        try:
            sk = model_skeleton(model_cfg, tokenizer, seed)
        except _ReadWhole:
            return _from_pretrained(str(model_cfg.path), dtype, vlm_arch(model_cfg) is not None)
        cast_params(sk.model, dtype)
        if not on_meta_by_default():
            sk.materialise(torch.device("cpu"))
        from transformers import GenerationConfig

        try:  # as from_pretrained: the directory's generation defaults, when it has any
            sk.model.generation_config = GenerationConfig.from_pretrained(model_cfg.path)
        except OSError:
            pass
        return sk.model.eval()
    from rlbatch.models.spec import spec_from_model_config
    from rlbatch.models.tiny import build_tiny_model

    spec = spec_from_model_config(model_cfg, vocab=len(tokenizer))
    if (arch := vlm_arch(model_cfg)) is not None:
        tiny_model = _tiny_vlm(spec, tokenizer, arch, seed)
    else:
        tiny_model = build_tiny_model(spec, seed, tokenizer)
    module: torch.nn.Module = tiny_model  # transformers' ``to`` (a functools.wraps) is untyped to mypy
    module.to(dtype)  # in place: ``to`` returns the model itself
    return tiny_model


def _tiny_vlm(spec: ModelSpec, tokenizer: PreTrainedTokenizerBase, arch: str, seed: int) -> PreTrainedModel:
    """A random-init vision-language model: ``spec``'s decoder, the default ``VisionSpec`` tower (on
    meta under ``torch.device("meta")``, as ``build_tiny_model``)."""
    from rlbatch.models.vlm import VisionSpec, build_tiny_vlm

    return build_tiny_vlm(spec, VisionSpec(), tokenizer, "qwen2_5_vl" if arch == "qwen2_5_vl" else "qwen2_vl", seed)


def _auto_class(vlm: bool) -> type[_BaseAutoModelClass]:
    """The transformers auto class of the policy: a causal LM, or for a vision-language model
    (``AutoModelForCausalLM`` refuses Qwen2-VL's config) the image-text-to-text one."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if vlm else AutoModelForCausalLM


def _from_pretrained(path: str, dtype: torch.dtype, vlm: bool = False) -> PreTrainedModel:
    model = _auto_class(vlm).from_pretrained(path, dtype=dtype)
    for t in [*model.parameters(), *model.buffers()]:
        if not t.untyped_storage().resizable():  # memory-mapped from safetensors: own a copy,
            t.data = t.data.clone()               # so offload can free and re-grow it
    return model


def _with_head(lm: PreTrainedModel, auto_class: type[_BaseAutoModelClass], **config: object) -> PreTrainedModel:
    """``lm``'s architecture under another transformers head class (one label, no output embedding to
    tie), built without touching the caller's RNG, its body the LM's weights. The head's parameters
    (``score.*``) are the only ones left to set."""
    import copy

    cfg = copy.deepcopy(lm.config)
    cfg.num_labels, cfg.tie_word_embeddings = 1, False
    for key, value in config.items():
        setattr(cfg, key, value)
    with torch.random.fork_rng(devices=[]):
        model = auto_class.from_config(cfg, dtype=next(lm.parameters()).dtype)
    missing, unexpected = model.load_state_dict(lm.state_dict(), strict=False)
    head = {name for name, _ in model.named_parameters() if name.startswith("score.")}
    if set(missing) != head or set(unexpected) - {"lm_head.weight"}:
        raise ValueError(f"{auto_class.__name__} from {type(lm).__name__}: weights did not map (missing {missing}, "
                         f"unexpected {unexpected})")
    return model


def value_model(lm: PreTrainedModel) -> PreTrainedModel:
    """A critic from a causal LM: the same architecture with a scalar head per token
    (transformers' ``...ForTokenClassification`` with one label, no dropout), its body the LM's
    weights and its head zero, so every value starts at 0 and the first advantages are the
    rewards' own. Parameter names stay Hugging Face's (``model.*``, ``score.weight``, ``score.bias``):
    ``save_pretrained`` output loads with ``AutoModelForTokenClassification``."""
    from transformers import AutoModelForTokenClassification

    model = _with_head(lm, AutoModelForTokenClassification, classifier_dropout=0.0)
    _set_head(model, head_weights("value", model, 0))
    return model


def reward_model(lm: PreTrainedModel, seed: int) -> PreTrainedModel:
    """A sequence-classification model (one score per sequence, read at its last non-pad token)
    from a causal LM: its body the LM's weights, its head drawn from ``seed`` (std 1/sqrt(hidden)).
    A stand-in that knows nothing about the task, for runs without a trained reward model."""
    from transformers import AutoModelForSequenceClassification

    model = _with_head(lm, AutoModelForSequenceClassification)
    _set_head(model, head_weights("reward", model, seed))
    return model


def head_weights(head: str, model: PreTrainedModel, seed: int) -> dict[str, torch.Tensor]:
    """The initial ``score.*`` parameters of a head model (its parameters may be on meta): a value
    head all zero; a reward head's weight drawn from ``seed`` (std 1/sqrt(hidden)), its bias zero."""
    out = {}
    for name, p in model.named_parameters():
        if not name.startswith("score."):
            continue
        if head == "reward" and name == "score.weight":
            g = torch.Generator().manual_seed(seed)
            out[name] = torch.randn(tuple(p.shape), generator=g) / model.config.hidden_size ** 0.5
        else:
            out[name] = torch.zeros(tuple(p.shape))
    return out


def _set_head(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in weights.items():
            params[name].copy_(w)


def load_engine_model(ctx: EngineContext, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The model of an engine's role by its head: the policy (a causal LM, 'lm'), the value model
    built from it ('value': the critic), or a reward model ('reward': the directory's
    sequence-classification model when ``ctx.model.path`` names one, else one built from the policy)."""
    if ctx.head == "reward" and ctx.model.path and _architecture_is(ctx.model.path, "ForSequenceClassification"):
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_pretrained(ctx.model.path, num_labels=1, dtype=dtype)
        if model.config.pad_token_id is None:  # the score is read at the last non-pad token
            model.config.pad_token_id = ctx.tokenizer.pad_token_id
        return model
    if ctx.head == "value" and ctx.model.path and _architecture_is(ctx.model.path, "ForTokenClassification"):
        from transformers import AutoModelForTokenClassification

        critic = AutoModelForTokenClassification.from_pretrained(ctx.model.path, dtype=dtype)
        _check_vocab(critic, ctx.tokenizer, ctx.model.path)
        return critic
    lm = load_model(ctx.model, ctx.tokenizer, ctx.seed, dtype)
    if ctx.head == "value":
        if ctx.model.path:
            _check_vocab(lm, ctx.tokenizer, ctx.model.path)
        return value_model(lm)
    return reward_model(lm, ctx.seed) if ctx.head == "reward" else lm


ModelT = TypeVar("ModelT", bound="PreTrainedModel | PeftModel")


@dataclass
class Skeleton(Generic[ModelT]):
    """A model with its parameters on the meta device (buffers real), and where its weights come from."""

    model: ModelT
    """A transformers model, or with adapters (``rlbatch.models.lora.adapt``) PEFT's wrapper of one."""
    weights: TensorSource
    whole: str = ""
    """Why the weights were read whole on this rank (files that cannot be read by rows), else ''."""

    def materialise(self, device: torch.device) -> None:
        """Give the parameters memory on ``device`` and fill them: only this rank's rows when the
        model has been sharded (FSDP2) since it was built."""
        allocate(self.model, device)
        materialise(self.model, self.weights)


class _ReadWhole(Exception):
    """The model directory's weights cannot be read by rows (the reason)."""


def _directory_skeleton(auto_class: type[_BaseAutoModelClass], config: PretrainedConfig,
                        path: str) -> Skeleton[PreTrainedModel]:
    """``auto_class``'s model of ``config`` with parameters on meta, its weights ``path``'s
    safetensors files, read by rows. Where the files do not hold every parameter under the model's
    own name (no safetensors files; names transformers maps on loading, such as per-expert MoE
    checkpoints), rows cannot be read: ``_ReadWhole``."""
    if not SafetensorsFiles.found(path):
        raise _ReadWhole(f"{path} has no safetensors files")
    with params_on_meta():
        model = auto_class.from_config(config)
    if getattr(model, "_keep_in_fp32_modules", None) or getattr(model, "_keep_in_fp32_modules_strict", None):
        raise _ReadWhole(f"{type(model).__name__} keeps some modules in fp32 whatever the dtype")
    files = SafetensorsFiles(path)
    missing = sorted({n for n, _ in model.named_parameters()} - files.names())
    if missing:
        raise _ReadWhole(f"{path}'s files do not hold {len(missing)} of the model's parameters by name "
                         f"(e.g. {missing[0]})")
    return Skeleton(model, files)


def model_skeleton(model_cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> Skeleton[PreTrainedModel]:
    """``load_model``'s causal LM as a ``Skeleton`` (fp32): a directory's files, or the seeded random
    init of the config's ``ModelSpec``."""
    vlm = vlm_arch(model_cfg)
    if model_cfg.path:
        from transformers import AutoConfig

        return _directory_skeleton(_auto_class(vlm is not None), AutoConfig.from_pretrained(model_cfg.path),
                                   model_cfg.path)
    from rlbatch.models.spec import spec_from_model_config
    from rlbatch.models.tiny import tiny_skeleton

    spec = spec_from_model_config(model_cfg, vocab=len(tokenizer))
    if vlm is not None:
        from rlbatch.models.vlm import VisionSpec, vlm_skeleton

        model = vlm_skeleton(spec, VisionSpec(), tokenizer, "qwen2_5_vl" if vlm == "qwen2_5_vl" else "qwen2_vl")
    else:
        model = tiny_skeleton(spec, tokenizer)
    return Skeleton(model, random_init(model, seed))


def _head_skeleton(lm: Skeleton[PreTrainedModel], head: str, auto_class: type[_BaseAutoModelClass], seed: int,
                   **config: object) -> Skeleton[PreTrainedModel]:
    """``_with_head`` on a skeleton: the head model's body reads the LM's weights, ``score.*`` are
    ``head_weights``."""
    import copy

    cfg = copy.deepcopy(lm.model.config)
    cfg.num_labels, cfg.tie_word_embeddings = 1, False
    for key, value in config.items():
        setattr(cfg, key, value)
    with params_on_meta():
        model = auto_class.from_config(cfg)
    lm_names = {n for n, _ in lm.model.named_parameters()}
    strays = sorted(n for n, _ in model.named_parameters() if not n.startswith("score.") and n not in lm_names)
    if strays:
        raise ValueError(f"{auto_class.__name__} from {type(lm.model).__name__}: weights did not map ({strays})")
    return Skeleton(model, Tensors(head_weights(head, model, seed), base=lm.weights))


def _skeleton(ctx: EngineContext) -> Skeleton[PreTrainedModel]:
    path = ctx.model.path
    if ctx.head == "reward" and path and _architecture_is(path, "ForSequenceClassification"):
        from transformers import AutoConfig, AutoModelForSequenceClassification

        sk = _directory_skeleton(AutoModelForSequenceClassification, AutoConfig.from_pretrained(path, num_labels=1), path)
        if sk.model.config.pad_token_id is None:  # the score is read at the last non-pad token
            sk.model.config.pad_token_id = ctx.tokenizer.pad_token_id
        return sk
    if ctx.head == "value" and path and _architecture_is(path, "ForTokenClassification"):
        from transformers import AutoConfig, AutoModelForTokenClassification

        sk = _directory_skeleton(AutoModelForTokenClassification, AutoConfig.from_pretrained(path), path)
        _check_vocab(sk.model, ctx.tokenizer, path)
        return sk
    lm = model_skeleton(ctx.model, ctx.tokenizer, ctx.seed)
    if ctx.head == "value":
        from transformers import AutoModelForTokenClassification

        if path:
            _check_vocab(lm.model, ctx.tokenizer, path)
        return _head_skeleton(lm, "value", AutoModelForTokenClassification, ctx.seed, classifier_dropout=0.0)
    if ctx.head == "reward":
        from transformers import AutoModelForSequenceClassification

        return _head_skeleton(lm, "reward", AutoModelForSequenceClassification, ctx.seed)
    return lm


def engine_skeleton(ctx: EngineContext,
                    dtype: torch.dtype = torch.float32) -> Skeleton[PreTrainedModel] | Skeleton[PeftModel]:
    """``load_engine_model(ctx, dtype)`` as a ``Skeleton``: the same model and, once materialised
    whole, the same tensors. A directory whose files cannot be read by rows is loaded whole on
    this rank (``load_engine_model``), and the skeleton's weights are those tensors
    (``Skeleton.whole`` says why)."""
    try:
        sk = _skeleton(ctx)
    except _ReadWhole as e:
        log.warning("%s: %s; every rank reads the whole model before it takes its shard", ctx.role, e)
        full = load_engine_model(ctx)
        sk = Skeleton(full, Tensors(params_to_meta(full)), f"{e}: read whole")
    out: Skeleton[PreTrainedModel] | Skeleton[PeftModel] = sk
    if (adapters := lora.of(ctx)) is not None:  # the trained policy learns adapters only: adapted on meta,
        # its base weights the skeleton's, its adapters drawn from the seed by name (lora.AdapterInit)
        out = Skeleton(lora.adapt(sk.model, adapters), lora.AdapterInit(sk.weights, ctx.seed), sk.whole)
    cast_params(out.model, dtype)
    return out


def _architecture_is(path: str, suffix: str) -> bool:
    import json
    from pathlib import Path

    config = json.loads((Path(path) / "config.json").read_text())
    return any(a.endswith(suffix) for a in config.get("architectures") or [])


def _check_vocab(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str) -> None:
    """A critic reads the policy's token ids: its embedding must have a row for each."""
    rows = model.get_input_embeddings().get_parameter("weight").shape[0]
    if rows < len(tokenizer):
        raise ValueError(f"critic_model.path: {path} embeds {rows} tokens, but the policy's tokenizer has "
                         f"{len(tokenizer)}: the critic must read the policy's token ids (the same tokenizer)")
