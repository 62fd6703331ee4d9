"""Random-initialised small causal LMs built from a config: no weights are downloaded.

The model is an ordinary ``transformers`` Qwen2 or Llama, so everything that works on a
real checkpoint (``generate``, ``save_pretrained``, state-dict weight sync) works here too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

Arch = Literal["qwen2", "llama"]
AttnImpl = Literal["eager", "sdpa"]


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape and seed of a tiny causal LM.

    The defaults are the size used by the default experiment: big enough to learn a
    100-entry arithmetic table by RL in about a minute on one CPU core, small enough that a
    step's generation is dominated by Python overhead rather than matmuls.
    """

    arch: Arch = "qwen2"
    vocab_size: int = 18
    hidden_size: int = 64
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 64
    tie_word_embeddings: bool = True
    # HF's 0.02 suits widths in the thousands; at width 64 it leaves logits nearly constant
    # and learning stalls on a plateau (supervised sanity check: no progress in 300 steps at
    # lr 3e-3). 0.1 is close to 1/sqrt(hidden_size) and learns the task in tens of steps.
    initializer_range: float = 0.1
    seed: int = 0
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2
    attn_implementation: AttnImpl = "sdpa"

    def to_dict(self) -> dict[str, object]:
        """Plain dict, for logging and for storing next to checkpoints."""
        return asdict(self)


def _hf_config(cfg: TinyModelConfig) -> Qwen2Config | LlamaConfig:
    common: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        pad_token_id=cfg.pad_token_id,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
    )
    if cfg.arch == "qwen2":
        return Qwen2Config(**common)
    if cfg.arch == "llama":
        return LlamaConfig(**common)
    raise ValueError(f"unknown tiny-model arch {cfg.arch!r}; expected 'qwen2' or 'llama'")


def build_tiny_model(cfg: TinyModelConfig) -> PreTrainedModel:
    """Build a random-initialised ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` in float32.

    Initialisation uses a private RNG seeded with ``cfg.seed``: the same config gives the
    same weights whatever the caller's global RNG state, and building a model does not
    shift the caller's sampling stream. The generation config carries pad/bos/eos ids so
    ``generate`` stops at EOS without further arguments.
    """
    if cfg.hidden_size % cfg.num_heads or cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(
            f"hidden_size {cfg.hidden_size}, num_heads {cfg.num_heads} and num_kv_heads "
            f"{cfg.num_kv_heads} must divide evenly"
        )
    hf_cfg = _hf_config(cfg)
    hf_cfg._attn_implementation = cfg.attn_implementation
    model_cls = Qwen2ForCausalLM if cfg.arch == "qwen2" else LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = model_cls(hf_cfg)  # type: ignore[arg-type]  # the arch picks both
    model.generation_config = GenerationConfig(
        pad_token_id=cfg.pad_token_id,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
    )
    return model.float()
