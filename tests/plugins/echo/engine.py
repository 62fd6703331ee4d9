"""The echo engine: each response the prompt's last ``echo`` tokens and EOS (``tests.plugins.echo``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rlbatch.engines.base import EngineContext, Generation, SamplingParams
from rlbatch.engines.offload import Transfer


class EchoEngine:
    state_kinds: tuple[str, ...] = ()

    def __init__(self, ctx: EngineContext) -> None:
        self.echo = ctx.args.echo
        self.eos = ctx.tokenizer.eos_token_id
        self.loaded_bytes = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        out = []
        for p in prompts:
            tokens = ([*p[-self.echo:], self.eos])[: params.max_new_tokens]
            out.append(Generation(tokens, [0.0] * len(tokens)))
        return out

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        self.loaded_bytes += nbytes
        return nbytes

    def weight_views(self, names: list[str], dtype: torch.dtype) -> torch.Tensor | None:
        return None

    def offload(self, kinds: Iterable[str]) -> Transfer:
        return Transfer()

    def reload(self, kinds: Iterable[str]) -> Transfer:
        return Transfer()
