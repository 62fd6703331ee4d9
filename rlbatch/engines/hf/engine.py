"""``hf`` inference engine: transformers ``generate`` with a KV cache, on CPU or GPU.

Shaped like an in-process vLLM engine (generate / load_weights / offloadable state), so the
scheduler treats both the same way. Sampling (temperature, then top-p) runs in one logits
processor that also records the log-prob of each sampled token under that distribution: the
behaviour policy's log-probs, for off-policy corrections.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from rlbatch.engines.base import EngineContext, Generation, SamplingParams
from rlbatch.engines.batch import distinct_prompts, left_padded, prompt_cache, vision_of
from rlbatch.engines.defaults import worth_sharing
from rlbatch.engines.flat import flatten_parameters, span
from rlbatch.engines.hf import HFArgs
from rlbatch.engines.model import load_model, load_processor, model_dtype
from rlbatch.engines.offload import StashedState, Stashes, TensorStash

if TYPE_CHECKING:
    from transformers.cache_utils import Cache
    from transformers.generation.logits_process import LogitsProcessor

    from rlbatch.models.vlm import ImageOnly


PromptImages = Sequence[bytes]
"""A prompt's images, encoded (PNG/JPEG) in placeholder order: what samples carry and what the
vllm engine takes too (its prompt ids already hold each image's tokens: the processor's). The
generate rank passes ``rlbatch.data.images.ProcessedImages``: the same bytes with the processor's
``pixel_values`` / ``image_grid_thw``, which this engine then uses instead of processing the images."""


class SampledLogprobs:
    """The last logits processor of a sampling ``generate``: applies temperature and top-p (the
    same transformers warpers, in the same order, as ``generate`` would) and keeps the log-softmax
    of the result until the next step, whose ``input_ids`` end with the token sampled from it."""

    def __init__(self, temperature: float, top_p: float) -> None:
        from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

        self.warpers: list[LogitsProcessor] = []
        if temperature > 0 and temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(temperature))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=top_p))
        self.prev: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prev is not None:
            self._take(input_ids[:, -1])
        for w in self.warpers:
            scores = w(input_ids, scores)
        self.prev = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        assert self.prev is not None
        self.steps.append(self.prev.gather(1, tokens[:, None]).squeeze(1))
        self.prev = None

    def result(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """[B, steps] log-probs of the sampled tokens, given the tokens of the last step."""
        if self.prev is not None:
            self._take(last_tokens)
        return torch.stack(self.steps, dim=1) if self.steps else torch.zeros(last_tokens.shape[0], 0)


class HFInferenceEngine(StashedState):
    def __init__(self, ctx: EngineContext) -> None:
        self.device = ctx.device
        self.tokenizer = ctx.tokenizer
        args: HFArgs = ctx.args
        self.max_batch = args.max_batch
        self.share_prompts = args.share_prompts
        dtype = model_dtype(ctx.model.dtype, ctx.device)
        self.model = load_model(ctx.model, ctx.tokenizer, ctx.seed, dtype)
        self.dtype, self.model_cfg = dtype, ctx.model
        self.vision = vision_of(self.model)
        self.processor: ImageOnly | None = None
        """A vision-language model's processor, once a prompt brings images."""
        module: torch.nn.Module = self.model  # transformers' ``to`` (a functools.wraps) is untyped to mypy
        module.to(ctx.device).eval()  # in place: both return the model itself
        flatten_parameters(self.model)  # weight sync can then receive straight into the model
        self._params = dict(self.model.named_parameters())
        self.state = Stashes({"params": TensorStash("params", self.model.parameters)})

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 images: Sequence[PromptImages | None] | None = None) -> list[Generation]:
        """A response to each prompt. ``images`` (a vision-language model): each prompt's encoded
        images, empty or None for a prompt without, as ``ProcessedImages`` where the processor has
        already run on them; ``prompts`` are the processor's ids (each image's pad expanded to its
        tokens: ``rlbatch.data.images.prompt_inputs``)."""
        torch.manual_seed(params.seed)
        out: list[Generation] = []
        for i in range(0, len(prompts), self.max_batch):
            out += self._generate(prompts[i : i + self.max_batch], params,
                                  images[i : i + self.max_batch] if images is not None else None)
        return out

    def _generate(self, prompts: list[list[int]], sp: SamplingParams,
                  images: Sequence[PromptImages | None] | None = None) -> list[Generation]:
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        ids, attn = left_padded(prompts, pad)
        width = ids.shape[1]
        # top_k=0 samples from the whole distribution: the policy the PPO ratio assumes (the
        # generation config may default to top-k 50). Temperature and top-p are applied by the
        # recorder (SampledLogprobs), so generate's own warpers are off.
        kwargs: dict[str, object] = self._image_kwargs(ids, images)
        if self.vision is not None:
            # A Qwen2-VL keeps the rope deltas of its last forward as state, which ``generate`` reads
            # for its decode positions whenever it starts with a cache; a fresh start computes them.
            self.model.model.rope_deltas = None
            cache = None  # the shared prompt cache would start generate with a cache: stale deltas
        else:
            cache = self._shared_prompt_cache(prompts, ids, attn)
        if cache is not None:
            kwargs["past_key_values"] = cache
        if sp.stop_strings:
            kwargs |= {"stop_strings": list(sp.stop_strings), "tokenizer": self.tokenizer}
        sampling = sp.temperature > 0
        recorder = SampledLogprobs(sp.temperature if sampling else 1.0, sp.top_p if sampling else 1.0)
        # transformers types ``generate`` for its own checker (its ``self`` a Protocol mypy does not match)
        generate: Callable[..., torch.Tensor] = getattr(self.model, "generate")  # noqa: B009
        seqs = generate(
            input_ids=ids.to(self.device), attention_mask=attn.to(self.device), max_new_tokens=sp.max_new_tokens,
            do_sample=sampling, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=pad, eos_token_id=eos,
            use_cache=True, logits_processor=[recorder], **kwargs,
        )
        new = seqs[:, width:]
        logprobs = recorder.result(new[:, -1]).cpu() if new.shape[1] else torch.zeros(len(prompts), 0)
        out = []
        for row, lp in zip(new.tolist(), logprobs.tolist(), strict=True):
            if eos in row:
                row = row[: row.index(eos) + 1]
            elif sp.stop_strings:
                while row and row[-1] == pad:  # finished early through a stop string
                    row.pop()
            out.append(Generation(row, lp[: len(row)], [sp.version] * len(row)))
        return out

    def _image_kwargs(self, ids: torch.Tensor, images: Sequence[PromptImages | None] | None) -> dict[str, object]:
        """The image arguments of ``generate`` on the left-padded ``ids``: the rows' images in row
        order (the model takes them in the order of their image tokens), and where those tokens are.
        A row's ``ProcessedImages`` (the generate rank's processor outputs) are taken as they are;
        other images go through the model's image processor here, each distinct prompt's once."""
        found = [im for im in images or () if im]
        if not found:
            return {}
        if self.vision is None:
            raise ValueError(f"{type(self.model).__name__} is not a vision-language model: it cannot read "
                             f"the images of {len(found)} prompt(s)")
        from rlbatch.data.images import ProcessedImages, decode_image, images_key

        processed: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}  # a group's prompt once
        rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        for im in found:
            if isinstance(im, ProcessedImages):
                rows.append((im.pixel_values, im.image_grid_thw))
                continue
            if (key := images_key(im)) not in processed:
                if self.processor is None:
                    self.processor = load_processor(self.model_cfg, self.tokenizer)
                out = self.processor.image_processor(images=[decode_image(b) for b in im], return_tensors="pt")
                processed[key] = (out["pixel_values"], out["image_grid_thw"])
            rows.append(processed[key])
        return {"pixel_values": torch.cat([r[0] for r in rows]).to(self.device, self.dtype),
                "image_grid_thw": torch.cat([r[1] for r in rows]).to(self.device),
                "mm_token_type_ids": (ids == self.vision.image_token_id).long().to(self.device)}

    def _shared_prompt_cache(self, prompts: list[list[int]], ids: torch.Tensor, attn: torch.Tensor) -> Cache | None:
        """The KV cache of every prompt but its last token, computed once per distinct prompt and
        selected for each row, when prompts repeat enough to pay (GRPO's groups); ``generate``
        then runs only the last prompt token of each row before decoding. None otherwise."""
        if not self.share_prompts or ids.shape[1] < 2:
            return None
        firsts, group = distinct_prompts(prompts)
        if not worth_sharing(len(firsts), len(prompts)):
            return None
        rows = torch.tensor(firsts)
        _, cache = prompt_cache(self.model, ids[rows, :-1].to(self.device), attn[rows, :-1].to(self.device),
                                  group.to(self.device))
        return cache

    @torch.no_grad()
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy each tensor into the parameter of its name (cast and moved in one copy). Blocking from
        host memory, so the caller may free or overwrite the tensors once this returns; a copy
        between device tensors is ordered on the stream before any later use of their memory."""
        nbytes = 0
        for name, tensor in named:
            self._params[name].copy_(tensor)
            nbytes += tensor.numel() * tensor.element_size()
        return nbytes

    def weight_views(self, names: list[str], dtype: torch.dtype) -> torch.Tensor | None:
        return span([self._params[n] for n in names], dtype)
