"""Image prompts for the ``vllm`` engine (Qwen2-VL / Qwen2.5-VL; vLLM's CPU build through
``rlbatch.engines.vllm.vlm_plugin``).

A prompt with images goes to vLLM as ``{"prompt_token_ids": ids, "multi_modal_data": {"image":
[PIL images]}}``. rlbatch's prompt ids are the processor's (``rlbatch.models.vlm.encode``): each
image already expanded to one ``<|image_pad|>`` per merged patch. vLLM 0.32 expands the pads itself
(its Qwen2-VL prompt update replaces each image's ``<|image_pad|>`` with as many as the image has
tokens), and does so on token-id prompts too: handed the expanded ids it expands them again (a 64x64
image's 4 pads become 7, measured). So ``vllm_prompt`` collapses each image's run of pads back to
one pad, and vLLM's expansion gives back exactly the processor's ids: ``check_prompt`` compares the
ids vLLM ran with the ids rlbatch has, so a processor whose resize differs from vLLM's (different
``min_pixels``/``max_pixels``) is an error naming both lengths, never a silent shift of the response.

Images arrive as PIL images or encoded bytes (PNG/JPEG, as samples carry them), and dedupe by prompt
ids must also key on the images: two prompts with the same text and different images of one size
have identical token ids (``prompt_key``).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from PIL.Image import Image
    from transformers import PreTrainedTokenizerBase
    from vllm.inputs import TokensPrompt

    from rlbatch.config.schema import ModelConfig

ImageLike: TypeAlias = "Image | bytes"
"""An image as a prompt carries it: a PIL image or its encoded bytes (PNG/JPEG)."""
IMAGE_PAD = "<|image_pad|>"
MAX_IMAGES_PER_PROMPT = 16
"""vLLM's ``limit_mm_per_prompt`` for images (vLLM sizes its encoder cache and profiling by it)."""
MM_LIMITS = {"image": MAX_IMAGES_PER_PROMPT, "video": 0}
"""``vllm.LLM(limit_mm_per_prompt=...)`` for a vision-language model: images, and no video (vLLM would
otherwise profile video inputs at start, which need torchvision)."""


def is_vlm_dir(model_dir: str | Path) -> bool:
    """Whether a saved model directory is a Qwen2-VL / Qwen2.5-VL (its ``config.json``'s model_type)."""
    import json

    from rlbatch.models.vlm import VLM_ARCHS

    config = Path(model_dir) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") in VLM_ARCHS


def save_processor(model_cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, model_dir: str | Path) -> None:
    """Beside a random-init model saved for vLLM: a vision-language model's processor files (image
    processor settings, chat template), which vLLM's processor (the plugin's image-only one) reads.
    Nothing for a text model."""
    from rlbatch.models.spec import vlm_arch

    if vlm_arch(model_cfg) is None:
        return
    from rlbatch.engines.model import load_processor

    load_processor(model_cfg, tokenizer).save_pretrained(str(model_dir))


def pil_image(image: ImageLike) -> Image:
    """A PIL image in RGB from a PIL image or encoded bytes."""
    from PIL import Image as PILImage

    if isinstance(image, (bytes, bytearray, memoryview)):
        image = PILImage.open(io.BytesIO(bytes(image)))
        image.load()
    return image if image.mode == "RGB" else image.convert("RGB")


def image_key(images: Sequence[ImageLike]) -> tuple[str, ...]:
    """A content key of a prompt's images (pixels and size, so the same picture as bytes or as PIL
    image keys alike)."""
    out = []
    for im in images:
        pil = pil_image(im)
        out.append(hashlib.sha1(f"{pil.size}".encode() + pil.tobytes()).hexdigest())
    return tuple(out)


def prompt_key(prompt: Sequence[int], images: Sequence[ImageLike]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """A prompt's identity for grouping its samples: its token ids and its images."""
    return tuple(prompt), image_key(images)


def collapse_image_pads(prompt: Sequence[int], pad_id: int, n_images: int) -> list[int]:
    """``prompt`` with each run of ``pad_id`` (one image's expanded tokens) as one pad: the form
    vLLM expands itself. The runs must be as many as the images."""
    out: list[int] = []
    runs = 0
    for i, t in enumerate(prompt):
        if t == pad_id and i and prompt[i - 1] == pad_id:
            continue
        runs += t == pad_id
        out.append(int(t))
    if runs != n_images:
        raise ValueError(f"vllm engine: the prompt has {runs} image(s) ({IMAGE_PAD} runs) but {n_images} image(s) "
                         f"came with it")
    return out


def vllm_prompt(prompt: Sequence[int], images: Sequence[ImageLike], pad_id: int) -> TokensPrompt:
    """vLLM's request for a prompt with images (``prompt``: the processor's ids, pads expanded)."""
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=collapse_image_pads(prompt, pad_id, len(images)),
                        multi_modal_data={"image": [pil_image(im) for im in images]})


def check_prompt(ran: Sequence[int], prompt: Sequence[int]) -> None:
    """vLLM's expansion of a collapsed prompt (``ran``, its ``RequestOutput.prompt_token_ids``) must
    be rlbatch's prompt: else the image processors disagree on an image's token count."""
    if list(ran) != list(prompt):
        raise RuntimeError(f"vllm engine: vLLM expanded an image prompt to {len(ran)} tokens, the processor's prompt "
                           f"has {len(prompt)}: vLLM's image processor resizes the images differently (compare "
                           f"min_pixels/max_pixels of the model's preprocessor_config.json with the data's processor)")


def image_pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id of ``<|image_pad|>`` in ``tokenizer`` (a vision-language model's tokenizer holds it)."""
    found = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    if not isinstance(found, int) or found == tokenizer.unk_token_id:
        raise ValueError(f"vllm engine: image prompts, but the tokenizer has no {IMAGE_PAD} token")
    return found


def group_prompts(prompts: Sequence[Sequence[int]],
                  images: Sequence[Sequence[ImageLike]] | None) -> dict[Hashable, list[int]]:
    """Distinct prompts (by ids, and by images where given) -> their positions in ``prompts``."""
    if images is not None and len(images) != len(prompts):
        raise ValueError(f"vllm engine: {len(images)} image lists for {len(prompts)} prompts")
    groups: dict[Hashable, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(p) if images is None else prompt_key(p, images[i]), []).append(i)
    return groups


def requests(prompts: Sequence[Sequence[int]], images: Sequence[Sequence[ImageLike]] | None,
             firsts: Sequence[int], tokenizer: PreTrainedTokenizerBase | None) -> list[TokensPrompt]:
    """vLLM's request for each prompt ``prompts[i]``, ``i`` in ``firsts``: a token prompt, with its
    images where it has any (``tokenizer``: the model's, needed only then)."""
    from vllm.inputs import TokensPrompt

    pad = -1
    if images is not None and any(images[i] for i in firsts):
        if tokenizer is None:
            raise ValueError("vllm engine: image prompts need the model's tokenizer (its image pad token)")
        pad = image_pad_id(tokenizer)
    return [vllm_prompt(prompts[i], images[i], pad) if images is not None and images[i]
            else TokensPrompt(prompt_token_ids=list(prompts[i])) for i in firsts]


def check_prompts(prompts: Sequence[Sequence[int]], images: Sequence[Sequence[ImageLike]] | None,
                  firsts: Sequence[int], ran: Sequence[Sequence[int] | None]) -> None:
    """``check_prompt`` on every image prompt of a ``requests`` call (``ran``: vLLM's prompt ids of each)."""
    if images is None:
        return
    for i, ids in zip(firsts, ran, strict=True):
        if images[i]:
            check_prompt(ids or [], prompts[i])


def parameter_names(model_cfg: ModelConfig) -> set[str]:
    """A vision-language model directory's parameter names as a trainer exports them (transformers'
    model in memory: ``model.language_model.*``, ``model.visual.*``, ``lm_head.*``; the files hold
    the older names, which vLLM's loader also maps), built on the meta device; empty for a text model."""
    from rlbatch.models.spec import vlm_arch

    if not model_cfg.path or vlm_arch(model_cfg) is None:
        return set()
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(str(model_cfg.path)))
    return {n for n, _ in model.named_parameters()}
