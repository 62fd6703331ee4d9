"""Shared by the vLLM benchmarks: a random-init Qwen2 model directory with a word-level tokenizer,
prompts, and rlbatch inference engines built through the engine API.

The model directory has a vocabulary of ``vocab`` tokens (``t0`` ... ``t<vocab-1>``; ``t0`` is the
padding, ``t1`` the end of sequence), so a random-init model ends a sampled response on its own
about once in ``vocab`` tokens: responses run to the token cap, as a long-response workload needs
(the built-in character tokenizer has 18 tokens, which would end most responses in ~18).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
from pathlib import Path
from typing import Any


def add_workload_flags(p: argparse.ArgumentParser, *, prompts: int, samples: int, prompt_len: int, new_tokens: int,
                       repeats: int) -> None:
    """The flags that size a benchmark's batch and count its timed runs, with the caller's defaults."""
    p.add_argument("--prompts", type=int, default=prompts, help="distinct prompts")
    p.add_argument("--samples", type=int, default=samples, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=prompt_len)
    p.add_argument("--new-tokens", type=int, default=new_tokens)
    p.add_argument("--repeats", type=int, default=repeats)


def add_model_flags(p: argparse.ArgumentParser, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int,
                    vocab: int) -> None:
    g = p.add_argument_group("model (random-init Qwen2)")
    g.add_argument("--hidden", type=int, default=hidden)
    g.add_argument("--layers", type=int, default=layers)
    g.add_argument("--heads", type=int, default=heads, help="head_dim = hidden / heads must be >= 32 on CPU")
    g.add_argument("--kv-heads", type=int, default=kv_heads)
    g.add_argument("--ffn", type=int, default=ffn)
    g.add_argument("--vocab", type=int, default=vocab)
    g.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0")) or os.cpu_count() or 1,
                   help="torch threads (both engines; vLLM's CPU build reads OMP_NUM_THREADS)")
    g.add_argument("--seed", type=int, default=1)


def set_threads(n: int) -> None:
    """Before torch is imported: vLLM's CPU worker fixes torch's thread count from OMP_NUM_THREADS."""
    os.environ["OMP_NUM_THREADS"] = str(n)


def make_model_dir(path: Path, a: argparse.Namespace) -> int:
    """Write the tokenizer and a random-init Qwen2 (fp32, untied head) to ``path``; its parameter count."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = {f"t{i}": i for i in range(a.vocab)}
    tk = Tokenizer(WordLevel(words, unk_token="t2"))
    tk.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="t0", eos_token="t1", unk_token="t2")
    tok.save_pretrained(path)
    cfg = Qwen2Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=4096,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(a.seed)
    model = Qwen2ForCausalLM(cfg).float()
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` distinct prompts of ``length`` tokens, none of them padding or end of sequence."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def model_config(path: Path) -> Any:
    from rlbatch.config.compose import compose

    return compose([f"model.path={path}", "model.dtype=fp32"])


def build(engine: str, args: Any, cfg: Any, seed: int) -> Any:
    """An rlbatch inference engine, as a rank builds it (``rlbatch.engines.base.build_engine``)."""
    import torch

    from rlbatch.engines.base import EngineContext, build_engine
    from rlbatch.engines.model import load_tokenizer

    ctx = EngineContext("actor_infer", args, cfg.model, cfg.algo, load_tokenizer(cfg.model), torch.device("cpu"), seed)
    return build_engine(engine, ctx)


def summary(times: list[float]) -> str:
    return f"min {min(times):.2f} s, median {statistics.median(times):.2f} s over {len(times)}"


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.1f} / {five:.1f} / {fifteen:.1f} on {os.cpu_count()} cores"
