"""Observations as tokens: plain text, or messages of the model's chat template (``data.chat_template``).

A trajectory is one token sequence; each observation is tokenized once and appended (token in,
token out). ``PlainText`` appends the observation's text as it is. ``ChatTurns`` appends what the
model's chat template writes between the policy's turn and its next one:

    ...<the turn's tokens, ending in its EOS><|im_end|>      generated (<|im_end|> is ChatML's EOS)
    \\n<|im_start|>user\\n<observation><|im_end|>\\n<|im_start|>assistant\\n     appended

that is: the template's end of an assistant message (less the EOS the turn already generated; all
of it when the turn was cut at max_new_tokens), the observation as a message of
``env.observation_role`` ('user', or 'tool' where the template renders tool messages), then the
generation prompt. The first observation opens the conversation: one user message (after
``data.system_prompt``) when the task has no prompt of its own, else a message after the prompt's
(which ``data.chat_template`` rendered, ending in the generation prompt). The tokens then equal
``apply_chat_template`` of the whole conversation, the policy's turns as assistant messages.

The pieces are read off the template at start by rendering placeholder conversations; a template
that does not render a conversation as its shorter prefixes followed by the new message (one that
rewrites earlier turns, as reasoning templates that drop past thinking do) is refused then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from rlbatch.data.chat import ChatPrompts
from rlbatch.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

USER, ASSISTANT, OBSERVATION = "RLBATCH_USER_TEXT", "RLBATCH_ASSISTANT_TEXT", "RLBATCH_OBSERVATION_TEXT"
"""Placeholders the template is rendered with to find where its messages begin and end."""


class Observations(Protocol):
    """How an env's observations become a trajectory's tokens (``rlbatch.envs.rollout.Rollout``)."""

    def opening(self, prompt: list[int], text: str) -> list[int]:
        """The prompt the first turn reads: the task's ``prompt`` tokens with the first observation."""

    def after(self, turn: list[int], text: str) -> list[int]:
        """The tokens appended after a generated ``turn``: the observation the next turn reads."""


class PlainText:
    """Observations appended as their text's tokens (``encode``: text -> tokens, no special tokens)."""

    def __init__(self, encode: Callable[[str], list[int]]) -> None:
        self.encode = encode

    def opening(self, prompt: list[int], text: str) -> list[int]:
        return list(prompt) + self.encode(text)

    def after(self, turn: list[int], text: str) -> list[int]:
        return self.encode(text)


class ChatTurns:
    """Observations as chat messages of ``tokenizer``'s template (see the module's docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, role: str = "user", system_prompt: str | None = None,
                 where: str = "the tokenizer") -> None:
        self.tokenizer, self.role, self.where = tokenizer, role, where
        self.prompts = ChatPrompts(tokenizer, system_prompt, where)  # refuses a tokenizer without a template
        user, assistant = {"role": "user", "content": USER}, {"role": "assistant", "content": ASSISTANT}
        turn = self._render([user, assistant], False)
        if turn.count(ASSISTANT) != 1:
            raise self._refused("an assistant message's text does not appear once in its rendering")
        self.closing = turn[turn.index(ASSISTANT) + len(ASSISTANT):]
        """The template's end of an assistant message (ChatML: '<|im_end|>\\n')."""
        self.before, self.after_text = self._message_after([user, assistant])
        self.before_opening, self.after_opening = self._message_after([user])
        self.generation_prompt = self._render([user], True)[len(self._render([user], False)):]
        self._eos = {t for t in (tokenizer.eos_token_id,) if t is not None}

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt))

    def _message_after(self, messages: list[dict[str, str]]) -> tuple[str, str]:
        """The template's text before and after an observation message that follows ``messages``,
        the generation prompt included."""
        head = self._render(messages, False)
        full = self._render([*messages, {"role": self.role, "content": OBSERVATION}], True)
        if not full.startswith(head) or full.count(OBSERVATION) != 1:
            raise self._refused(f"a conversation with a {self.role!r} message after "
                                f"{'/'.join(m['role'] for m in messages)} does not render as the shorter one "
                                f"followed by that message")
        before, after = full[len(head):].split(OBSERVATION)
        return before, after

    def _refused(self, why: str) -> ConfigError:
        return ConfigError(f"data.chat_template: {self.where}'s chat template cannot render observations turn by "
                           f"turn (env.observation_role={self.role!r}): {why}; set data.chat_template=false to append "
                           f"observations as plain text")

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def opening(self, prompt: list[int], text: str) -> list[int]:
        bos = [] if self.tokenizer.bos_token_id is None else [self.tokenizer.bos_token_id]
        if list(prompt) in ([], bos):  # no task prompt: the observation is the first user message
            return list(prompt) + self._encode(self.prompts.render(text))
        cue = self._encode(self.generation_prompt)
        if not cue or list(prompt[-len(cue):]) != cue:
            raise ValueError(f"a task prompt that does not end with the chat template's generation prompt "
                             f"{self.generation_prompt!r} cannot take an observation message after it")
        return list(prompt[:-len(cue)]) + self._encode(self.before_opening + text + self.after_opening)

    def after(self, turn: list[int], text: str) -> list[int]:
        closing = self.closing
        if turn and turn[-1] in self._eos:  # the turn generated the template's end of message itself
            eos = str(self.tokenizer.decode([turn[-1]], skip_special_tokens=False))
            if closing.startswith(eos):
                closing = closing[len(eos):]
        return self._encode(closing + self.before + text + self.after_text)
