"""The echo engine: each response the prompt's last ``echo`` tokens and EOS (``tests.plugins.echo``)."""

from __future__ import annotations

from rlbatch.engines.base import EngineContext, Generation, SamplingParams
from rlbatch.engines.inference import NoModelInference


class EchoEngine(NoModelInference):
    def __init__(self, ctx: EngineContext) -> None:
        self.echo = ctx.args.echo
        self.eos = ctx.tokenizer.eos_token_id

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        out = []
        for p in prompts:
            tokens = ([*p[-self.echo:], self.eos])[: params.max_new_tokens]
            out.append(Generation(tokens, [0.0] * len(tokens)))
        return out
