"""Random-initialised vision-language models (Qwen2-VL, Qwen2.5-VL) and their processors, built
offline and without torchvision.

    from rlbatch.models.vlm import VisionSpec, build_processor, build_tiny_vlm, encode
    proc = build_processor(tokenizer, VisionSpec())        # tokenizer with the vision tokens added
    model = build_tiny_vlm(text_spec, VisionSpec(), tokenizer, arch="qwen2_vl")
    batch = encode(proc, "<image>What colour is the shape?", [image])
    model(**batch).logits

The language model is described by the same ``ModelSpec`` as a text-only run (a Qwen2 decoder); the
vision tower by a ``VisionSpec``. The model is transformers' own ``Qwen2VLForConditionalGeneration``
or ``Qwen2_5_VLForConditionalGeneration``, its weights drawn as ``rlbatch.models.tiny`` draws a text
model's (``rlbatch.models.weights.random_init``: seeded by each tensor's name).

Why the processor is assembled here instead of through ``AutoProcessor``: without torchvision,
transformers cannot build ``Qwen2VLProcessor`` at all (its constructor checks the video processor's
class, which transformers registers only when torchvision is present, and ``from_pretrained`` loads
the video processor, which needs torchvision). Images need only the PIL image processor
(``Qwen2VLImageProcessorPil``), so ``ImageTextProcessor`` / ``Qwen25ImageTextProcessor`` are the
Qwen2-VL / Qwen2.5-VL processors without video.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from transformers import (
    AutoImageProcessor,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
)
from transformers.processing_utils import ProcessorMixin

from rlbatch.data.images import (  # noqa: F401 (re-exported: the model's tokens beside the model)
    IMAGE_PAD,
    IMAGE_PLACEHOLDER,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    VISION_TOKENS,
)
from rlbatch.models.spec import ModelSpec, VisionSizes, hf_config_kwargs

if TYPE_CHECKING:
    from PIL.Image import Image
    from transformers import BatchFeature

VLMArch = Literal["qwen2_vl", "qwen2_5_vl"]
VLM_ARCHS: tuple[VLMArch, ...] = ("qwen2_vl", "qwen2_5_vl")


IMAGE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML as Qwen2-VL-Instruct writes it, image parts included (without its default system turn)."""


@dataclass(frozen=True)
class VisionSpec(VisionSizes):
    """The vision tower and the image processor's resize bounds a VLM is built with: the fields and
    defaults (a tiny tower for tests) of ``rlbatch.models.spec.VisionSizes``, which the planner's
    ``VisionTower`` shares, so the tower built and the tower counted cannot drift apart."""

    def tokens(self, height: int, width: int) -> int:
        """Image tokens of an image of height x width pixels after the processor's resize."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch_size * self.merge_size
        h, w = smart_resize(height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        return (h // factor) * (w // factor)


def mrope_section(head_dim: int) -> list[int]:
    """The rotary frequencies of each of (time, height, width), as Qwen2-VL splits its head_dim 128:
    [16, 24, 24] of 64, i.e. 3/8 to each spatial axis and the rest to time."""
    half = head_dim // 2
    spatial = 3 * half // 8
    return [half - 2 * spatial, spatial, spatial]


def vision_problems(text: ModelSpec, vision: VisionSpec, arch: str) -> list[str]:
    """Everything about ``text``/``vision``/``arch`` that the builder cannot make, one line each."""
    out = []
    if arch not in VLM_ARCHS:
        out.append(f"arch {arch!r} is not one of {VLM_ARCHS}")
    if text.head_dim % 2 or min(mrope_section(text.head_dim)) < 1:
        out.append(f"text head_dim {text.head_dim} must be even and at least 6: the multimodal rotary embedding "
                   f"splits its {text.head_dim // 2} frequencies over time, height and width")
    for name in ("depth", "hidden", "heads", "ffn", "patch_size", "merge_size", "temporal_patch_size"):
        if getattr(vision, name) < 1:
            out.append(f"vision.{name} {getattr(vision, name)} must be at least 1")
    if out:
        return out
    if vision.hidden % vision.heads or (vision.hidden // vision.heads) % 4:
        out.append(f"vision.hidden {vision.hidden} / vision.heads {vision.heads} must be a whole head size divisible "
                   f"by 4: the vision rotary embedding turns pairs of dimensions along height and width")
    if arch == "qwen2_vl" and vision.ffn % vision.hidden:
        out.append(f"vision.ffn {vision.ffn} must be a multiple of vision.hidden {vision.hidden} for qwen2_vl "
                   f"(its config has mlp_ratio, not a width)")
    blocks = vision.full_attention_blocks
    if blocks is not None and any(not 0 <= b < vision.depth for b in blocks):
        out.append(f"vision.full_attention_blocks {list(blocks)} must lie in [0, depth={vision.depth})")
    factor = vision.patch_size * vision.merge_size
    if arch == "qwen2_5_vl" and vision.window_size % factor:
        out.append(f"vision.window_size {vision.window_size} must be a multiple of patch_size x merge_size = {factor}")
    if not factor * factor <= vision.min_pixels <= vision.max_pixels:
        out.append(f"vision.min_pixels {vision.min_pixels} / max_pixels {vision.max_pixels}: need "
                   f"(patch_size x merge_size)^2 = {factor * factor} <= min_pixels <= max_pixels")
    return out


def add_vision_tokens(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """Add Qwen2-VL's vision tokens to ``tokenizer`` as special tokens where it lacks them (in place);
    returns the id of each. A random-init model built afterwards sizes its vocabulary to hold them."""
    missing = [t for t in VISION_TOKENS if t not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    return {t: _token_id(tokenizer, t) for t in VISION_TOKENS}


def _token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    found = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(found, int), "one token gives one id"
    return found


class ImageOnly(ProcessorMixin):
    """A Qwen-VL processor for text and images only (no video processor, so no torchvision): the same
    prompt expansion (one ``<|image_pad|>`` per merged patch) and outputs (``input_ids``,
    ``attention_mask``, ``mm_token_type_ids``, ``pixel_values``, ``image_grid_thw``) as the class it
    is mixed into, which it stays an instance of (vLLM checks the processor's class)."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                 **kwargs: Any) -> None:
        # Qwen2VLProcessor.__init__ hands a video processor to ProcessorMixin, which checks its class;
        # ProcessorMixin reads the sub-processors from this signature, so without one it has none.
        self.image_token, self.video_token = IMAGE_PAD, VIDEO_PAD
        self.image_token_id = _token_id(tokenizer, IMAGE_PAD)
        self.video_token_id = _token_id(tokenizer, VIDEO_PAD)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)


class ImageTextProcessor(ImageOnly, Qwen2VLProcessor):
    """``Qwen2VLProcessor`` without video."""


class Qwen25ImageTextProcessor(ImageOnly, Qwen2_5_VLProcessor):
    """``Qwen2_5_VLProcessor`` without video (for images it is Qwen2-VL's processor)."""


PROCESSORS: dict[str, type[ImageOnly]] = {"qwen2_vl": ImageTextProcessor, "qwen2_5_vl": Qwen25ImageTextProcessor}
"""The image-only processor of each architecture (its ``model_type``)."""


def image_processor(vision: VisionSpec) -> Qwen2VLImageProcessorPil:
    """The PIL image processor of ``vision`` (resize, rescale, CLIP normalisation, patchify)."""
    return Qwen2VLImageProcessorPil(min_pixels=vision.min_pixels, max_pixels=vision.max_pixels,
                                    patch_size=vision.patch_size, merge_size=vision.merge_size,
                                    temporal_patch_size=vision.temporal_patch_size)


def build_processor(tokenizer: PreTrainedTokenizerBase, vision: VisionSpec, arch: VLMArch = "qwen2_vl",
                    chat_template: str | None = None) -> ImageOnly:
    """The processor of a random-init ``arch`` model: ``tokenizer`` (it must hold the vision tokens:
    ``add_vision_tokens``) with the image processor of ``vision`` and a chat template (the
    tokenizer's, else ``IMAGE_CHAT_TEMPLATE``)."""
    lacking = [t for t in VISION_TOKENS if t not in tokenizer.get_vocab()]
    if lacking:
        raise ValueError(f"the tokenizer lacks the vision tokens {lacking}: add_vision_tokens(tokenizer) first")
    template = chat_template or getattr(tokenizer, "chat_template", None) or IMAGE_CHAT_TEMPLATE
    return PROCESSORS[arch](image_processor(vision), tokenizer, chat_template=template)


def load_processor(model_dir: str | Path) -> ImageOnly:
    """The processor of a model directory (a real Qwen2-VL/Qwen2.5-VL, or one ``save_pretrained``
    wrote): its tokenizer and chat template, its image processor on the PIL backend, and the class
    of its ``config.json``'s ``model_type`` (Qwen2-VL's without one)."""
    d = str(Path(model_dir).expanduser())
    config = Path(d) / "config.json"
    arch = str(json.loads(config.read_text()).get("model_type", "qwen2_vl")) if config.is_file() else "qwen2_vl"
    if arch not in PROCESSORS:
        raise ValueError(f"{d}: model_type {arch!r} is not one of the vision-language archs {VLM_ARCHS}")
    tokenizer = AutoTokenizer.from_pretrained(d)
    images = AutoImageProcessor.from_pretrained(d, backend="pil")
    if not isinstance(images, Qwen2VLImageProcessorPil):
        raise ValueError(f"{d}: image processor {type(images).__name__}, expected Qwen2-VL's (Qwen2VLImageProcessorPil)")
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(f"{d}: the tokenizer has no chat template to write the image placeholders with")
    return PROCESSORS[arch](images, tokenizer, chat_template=template)


def content_parts(text: str, placeholder: str = IMAGE_PLACEHOLDER) -> list[dict[str, str]]:
    """A message's text with image placeholders as chat content: ``"<image>What is it?"`` ->
    ``[{"type": "image"}, {"type": "text", "text": "What is it?"}]`` (empty text parts dropped)."""
    parts: list[dict[str, str]] = []
    for i, piece in enumerate(re.split(f"({re.escape(placeholder)})", text)):
        if i % 2:
            parts.append({"type": "image"})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def encode(processor: ImageOnly, text: str, images: Sequence[Image],
           placeholder: str = IMAGE_PLACEHOLDER) -> BatchFeature:
    """One user prompt (``text`` with one ``placeholder`` per image, in order) as model inputs: the
    chat template's rendering with the generation prompt, each image expanded to its tokens, and the
    images' ``pixel_values`` and ``image_grid_thw``, as [1, L] / [patches, C*T*P*P] / [images, 3] tensors."""
    found = text.count(placeholder)
    if found != len(images):
        raise ValueError(f"prompt has {found} image placeholder(s) {placeholder!r} but {len(images)} image(s) "
                         f"came with it; each image needs one placeholder where it goes")
    messages: list[dict[str, Any]] = [{"role": "user", "content": content_parts(text, placeholder)}]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=[rendered], images=list(images) or None, return_tensors="pt")


def vlm_config(text: ModelSpec, vision: VisionSpec, tokenizer: PreTrainedTokenizerBase,
               arch: VLMArch = "qwen2_vl") -> Qwen2VLConfig | Qwen2_5_VLConfig:
    """The transformers config of a ``arch`` model: ``text``'s Qwen2 decoder with multimodal rotary
    positions, ``vision``'s tower, and ``tokenizer``'s vision-token, pad and eos ids."""
    if problems := vision_problems(text, vision, arch):
        raise ValueError(f"cannot build a {arch} model: " + "; ".join(problems))
    ids = {t: _token_id(tokenizer, t) for t in VISION_TOKENS}
    if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids.values():
        raise ValueError("the tokenizer lacks the vision tokens: add_vision_tokens(tokenizer) first")
    text_kw = hf_config_kwargs(replace(text, arch="qwen2", qkv_bias=True, o_bias=False))
    text_kw.pop("tie_word_embeddings")  # on the outer config in transformers 5
    text_kw["rope_parameters"] = {**text_kw["rope_parameters"], "mrope_section": mrope_section(text.head_dim)}
    text_kw.update(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                   bos_token_id=tokenizer.bos_token_id)
    common: dict[str, Any] = dict(
        text_config=text_kw, tie_word_embeddings=text.tied, image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END])
    patches = dict(depth=vision.depth, num_heads=vision.heads, patch_size=vision.patch_size,
                   spatial_merge_size=vision.merge_size, temporal_patch_size=vision.temporal_patch_size,
                   initializer_range=text.initializer_range)
    if arch == "qwen2_vl":
        return Qwen2VLConfig(vision_config=dict(patches, embed_dim=vision.hidden, hidden_size=text.hidden,
                                                mlp_ratio=vision.ffn // vision.hidden), **common)
    full = list(vision.full_attention_blocks if vision.full_attention_blocks is not None else (vision.depth - 1,))
    return Qwen2_5_VLConfig(vision_config=dict(patches, hidden_size=vision.hidden, intermediate_size=vision.ffn,
                                               out_hidden_size=text.hidden, window_size=vision.window_size,
                                               fullatt_block_indexes=full), **common)


def build_tiny_vlm(text: ModelSpec, vision: VisionSpec, tokenizer: PreTrainedTokenizerBase,
                   arch: VLMArch = "qwen2_vl", seed: int = 0,
                   attn_implementation: Literal["eager", "sdpa"] = "sdpa") -> PreTrainedModel:
    """A random-initialised ``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration``
    in float32. ``text.vocab`` must hold the tokenizer's ids (``len(tokenizer)`` once the vision tokens
    are added). Weights as ``rlbatch.models.tiny.build_tiny_model`` draws them (each tensor from its
    name and ``seed``; the caller's RNG left alone); under ``torch.device("meta")`` shapes only."""
    from rlbatch.models.weights import allocate, materialise, on_meta_by_default, random_init

    model = vlm_skeleton(text, vision, tokenizer, arch, attn_implementation)
    if on_meta_by_default():
        return model
    allocate(model, torch.device("cpu"))
    materialise(model, random_init(model, seed))
    return model


def vlm_skeleton(text: ModelSpec, vision: VisionSpec, tokenizer: PreTrainedTokenizerBase,
                 arch: VLMArch = "qwen2_vl", attn_implementation: Literal["eager", "sdpa"] = "sdpa") -> PreTrainedModel:
    """``build_tiny_vlm``'s model with its parameters on the meta device and its buffers real (what a
    sharded engine fills shard by shard, as ``rlbatch.models.tiny.tiny_skeleton``)."""
    from rlbatch.models.weights import params_on_meta

    if text.vocab < len(tokenizer):
        raise ValueError(f"text vocab {text.vocab} < {len(tokenizer)} tokens of the tokenizer (vision tokens included)")
    cfg = vlm_config(text, vision, tokenizer, arch)
    cfg._attn_implementation = attn_implementation
    cls = Qwen2VLForConditionalGeneration if arch == "qwen2_vl" else Qwen2_5_VLForConditionalGeneration
    with torch.random.fork_rng(devices=[]), params_on_meta():
        model = cls(cfg)
    model.generation_config = GenerationConfig(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id)
    return model
