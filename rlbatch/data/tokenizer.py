"""A character-level tokenizer built in code, so experiments need nothing from a model hub.

Every character of the alphabet is one token; the vocabulary is the special tokens followed
by the alphabet in order. It is wrapped as a ``transformers`` fast tokenizer, so
``save_pretrained`` writes an ordinary ``tokenizer.json`` that ``AutoTokenizer`` loads back.

The vocabulary itself (``char_vocab``) needs neither ``tokenizers`` nor ``transformers``: the
planner and the model description read the vocabulary's size and special ids from it without
importing either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
# Enough for arithmetic prompts; a short alphabet keeps the random policy's chance of
# emitting the right answer token small (about 1/len(vocab)).
DEFAULT_ALPHABET = "0123456789+-*="


def char_vocab(alphabet: str = DEFAULT_ALPHABET) -> dict[str, int]:
    """Token-to-id map: the special tokens get ids 0..3, then each character in order."""
    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
    if any(c.isspace() for c in alphabet):
        # The pre-tokenizer splits on every character; whitespace would decode ambiguously.
        raise ValueError("alphabet must not contain whitespace")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in alphabet:
        vocab[c] = len(vocab)
    return vocab


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET, add_bos: bool = True) -> PreTrainedTokenizerFast:
    """Build the character tokenizer as a ``PreTrainedTokenizerFast``.

    Encoding prepends ``<bos>`` when ``add_bos`` (a random-init model has no other anchor for
    position 0); decoding concatenates characters without spaces. Padding side is left, the
    side generation needs. Characters outside the alphabet become ``<unk>``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = char_vocab(alphabet)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Special tokens are matched before pre-tokenisation, so "<eos>" in text stays one token.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\S"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A",
            pair=f"{BOS} $A $B",
            special_tokens=[(BOS, vocab[BOS])],
        )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
    )
