"""``hf`` inference engine: transformers ``generate`` with a KV cache, on CPU or GPU.

Shaped like an in-process vLLM engine (generate / load_weights / offloadable state), so the
scheduler treats both the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from rlbatch.engines.base import SamplingParams
from rlbatch.engines.batch import distinct_prompts, left_padded, prompt_cache
from rlbatch.engines.defaults import hf_max_batch, share_prompts, worth_sharing
from rlbatch.engines.flat import flatten_parameters, span
from rlbatch.engines.model import load_model, model_dtype
from rlbatch.scheduler.offload import TensorStash


class HFInferenceEngine:
    def __init__(self, *, model_cfg: Any, tokenizer: Any, device: torch.device, seed: int,
                 engine_args: dict[str, Any], **_: Any) -> None:
        self.device = device
        self.tokenizer = tokenizer
        self.max_batch = hf_max_batch(engine_args)
        self.share_prompts = share_prompts(engine_args)
        self.model = load_model(model_cfg, tokenizer, seed, model_dtype(model_cfg.dtype, device)).to(device).eval()
        flatten_parameters(self.model)  # weight sync can then receive straight into the model
        self.params = dict(self.model.named_parameters())
        self.stashes = {"params": TensorStash("params", self.model.parameters)}

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        torch.manual_seed(params.seed)
        out: list[list[int]] = []
        for i in range(0, len(prompts), self.max_batch):
            out += self._generate(prompts[i : i + self.max_batch], params)
        return out

    def _generate(self, prompts: list[list[int]], sp: SamplingParams) -> list[list[int]]:
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        ids, attn = left_padded(prompts, pad)
        width = ids.shape[1]
        # top_k=0 samples from the whole distribution: the policy the PPO ratio assumes (the
        # generation config may default to top-k 50).
        kwargs: dict[str, Any] = {}
        cache = self._shared_prompt_cache(prompts, ids, attn)
        if cache is not None:
            kwargs["past_key_values"] = cache
        if sp.stop_strings:
            kwargs |= {"stop_strings": list(sp.stop_strings), "tokenizer": self.tokenizer}
        seqs = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=attn.to(self.device), max_new_tokens=sp.max_new_tokens,
            do_sample=sp.temperature > 0, temperature=sp.temperature if sp.temperature > 0 else None,
            top_p=sp.top_p, top_k=0, pad_token_id=pad, eos_token_id=eos, use_cache=True, **kwargs,
        )
        responses = []
        for row in seqs[:, width:].tolist():
            if eos in row:
                row = row[: row.index(eos) + 1]
            else:
                while row and row[-1] == pad:  # finished early through a stop string
                    row.pop()
            responses.append(row)
        return responses

    def _shared_prompt_cache(self, prompts: list[list[int]], ids: torch.Tensor, attn: torch.Tensor) -> Any:
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
        nbytes = 0
        for name, tensor in named:
            self.params[name].copy_(tensor, non_blocking=True)  # casts and moves in one copy
            nbytes += tensor.numel() * tensor.element_size()
        return nbytes

    def weight_views(self, names: list[str], dtype: torch.dtype) -> torch.Tensor | None:
        return span([self.params[n] for n in names], dtype)
