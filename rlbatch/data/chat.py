"""Prompts rendered with the model's chat template (``data.chat_template=true``).

A prompt is text (a question, after ``data.template``) or a record's chat messages; it becomes the
text ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)`` renders, with
``data.system_prompt`` put first unless the messages open with a system message of their own.
The ranks encode prompt text with ``tokenizer(text)``, which adds the tokenizer's own leading
special tokens: a template that writes the BOS itself would get a second one, so the BOS is taken
off the rendered text where the tokenizer adds it back. The ids the ranks then encode equal
``apply_chat_template(..., tokenize=True)``'s; ``ChatPrompts`` checks that on the first prompts.

``template_file`` finds a template by reading the model directory's files only (no transformers):
the launcher refuses a model without one before anything starts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from rlbatch.data.records import Message, Prompt
from rlbatch.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlbatch.config.schema import DataConfig, ModelConfig

CHECKED = 64
"""Prompts whose rank-side token ids are compared with apply_chat_template's at start."""


def template_file(model_dir: str | Path) -> str | None:
    """The file of ``model_dir`` that holds a chat template, or None.

    transformers 5 writes ``chat_template.jinja``; older versions ``chat_template.json`` or a
    ``chat_template`` entry in ``tokenizer_config.json``."""
    d = Path(model_dir).expanduser()
    if (d / "chat_template.jinja").is_file():
        return "chat_template.jinja"
    for name in ("chat_template.json", "tokenizer_config.json"):
        try:
            entry = json.loads((d / name).read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError):
            continue
        if entry:
            return name
    return None


def no_template_reason(model_dir: str | Path) -> str:
    return (f"model.path: {model_dir} has no chat template (no chat_template.jinja, chat_template.json or "
            f"'chat_template' in tokenizer_config.json), but data.chat_template=true; give a model directory "
            f"whose tokenizer has one, or set data.chat_template=false")


class ChatPrompts:
    """Renders prompts with ``tokenizer``'s chat template; refuses a tokenizer without one."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, system_prompt: str | None = None, where: str = "the tokenizer") -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(no_template_reason(where))
        self.tokenizer, self.system_prompt, self.where = tokenizer, system_prompt or None, where
        added = tokenizer("", add_special_tokens=True)["input_ids"]
        bos = tokenizer.bos_token_id
        if added and added != [bos]:
            # Tokens after the text would follow the generation prompt, where the response belongs.
            raise ConfigError(f"data.chat_template: {where}'s tokenizer adds {added} to every text it encodes, "
                              f"not only a BOS: the rendered prompts would not end with the generation prompt")
        self.bos_text = tokenizer.bos_token if added else None

    def messages(self, prompt: Prompt) -> list[Message]:
        messages: list[Message] = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def render(self, prompt: Prompt) -> str:
        """The prompt's text, as the ranks encode it."""
        text = str(self.tokenizer.apply_chat_template(self.messages(prompt), tokenize=False, add_generation_prompt=True))
        if self.bos_text and text.startswith(self.bos_text):
            text = text[len(self.bos_text):]
        return text

    def render_all(self, prompts: list[Prompt]) -> list[str]:
        """Every prompt's text; the first ``CHECKED`` encode as apply_chat_template encodes them."""
        texts = [self.render(p) for p in prompts]
        head = prompts[:CHECKED]
        if head:
            ranks = self.tokenizer(texts[: len(head)])["input_ids"]
            for i, (p, ids) in enumerate(zip(head, ranks, strict=True)):
                encoded = self.tokenizer.apply_chat_template(self.messages(p), tokenize=True, return_dict=True,
                                                             add_generation_prompt=True)
                assert isinstance(encoded, Mapping), "apply_chat_template(return_dict=True) returns a BatchEncoding"
                want = list(encoded["input_ids"])
                if list(ids) != want:
                    raise ConfigError(f"data.chat_template: prompt {i} of {self.where} encodes to {len(ids)} tokens "
                                      f"where apply_chat_template gives {len(want)} (first {ids[:8]} vs {want[:8]}); "
                                      f"this tokenizer's template and special tokens do not round-trip through text")
        return texts


def chat_prompts(data_cfg: DataConfig, model_cfg: ModelConfig | None) -> ChatPrompts | None:
    """The renderer ``data.chat_template`` asks for (None when false), from ``model.path``'s tokenizer."""
    if not getattr(data_cfg, "chat_template", False):
        return None
    if model_cfg is None:  # a caller's bug, not the user's: the stream's builder must pass cfg.model
        raise ConfigError("data.chat_template: true, but the prompt stream was built without the model's config "
                          "(make_stream(cfg.data, seed, cfg.model)), so there is no tokenizer to render with")
    path = getattr(model_cfg, "path", None)
    if not path:
        raise ConfigError("data.chat_template: true needs model.path: the built-in character tokenizer has no "
                          "chat template")
    from transformers import AutoTokenizer

    return ChatPrompts(AutoTokenizer.from_pretrained(str(path)), getattr(data_cfg, "system_prompt", None), str(path))
