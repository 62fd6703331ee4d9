"""Tokenizers with a chat template, and a random-init tiny Qwen2 saved with one, built offline.

A byte-level BPE trained in a few milliseconds on a handful of sentences stands in for Qwen2.5's
tokenizer; the template is ChatML as Qwen2.5-Instruct writes it (system, user and assistant turns
between ``<|im_start|>`` and ``<|im_end|>``, then ``<|im_start|>assistant\\n`` as the generation
prompt). ``bos=True`` gives a Llama-style tokenizer that adds a BOS to every text and whose
template writes the BOS too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
BOS_CHAT = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
CORPUS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
          "You are a helpful assistant. Put the final answer in \\boxed{}.", "system user assistant 0123456789"]


def chat_tokenizer(template: str | None = CHATML, bos: bool = False) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                           special_tokens=[("<s>", tok.token_to_id("<s>"))])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  bos_token="<s>" if bos else None, padding_side="left")
    if template is not None:
        out.chat_template = template
    return out


def save_chat_tokenizer(path: Path, template: str | None = CHATML) -> Path:
    """A model directory as the launcher's checks and the prompt stream read it: the ChatML tokenizer
    (or one without a template) and a config.json, no weights (cheap: nothing imports torch)."""
    path.mkdir(parents=True, exist_ok=True)
    chat_tokenizer(template).save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    return path


def save_chat_model(path: Path, template: str | None = CHATML) -> Path:
    """A random-init tiny Qwen2 and a ChatML tokenizer (or one without a template) saved to ``path``:
    a model directory a run can start from (``model.path``), for launch tests."""
    from rlbatch.models.spec import spec_from_config
    from rlbatch.models.tiny import build_tiny_model

    tok = chat_tokenizer(template)
    spec = spec_from_config({"max_position_embeddings": 512}, vocab=len(tok))
    build_tiny_model(spec, seed=0, tokenizer=tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path
