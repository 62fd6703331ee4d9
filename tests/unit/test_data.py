"""Character tokenizer, synthetic arithmetic task, resumable prompt stream."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from rlbatch.data import PromptStream, Sample, arithmetic_problems
from rlbatch.data.tokenizer import build_char_tokenizer, char_vocab

# ---------------------------------------------------------------- tokenizer


def test_tokenizer_ids_and_round_trip() -> None:
    tok = build_char_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == 4 + len("0123456789+-*=")
    ids = tok("3+4=")["input_ids"]
    assert ids == [1, 7, 14, 8, 17]  # <bos> 3 + 4 =
    assert tok.decode(ids) == "<bos>3+4="
    assert tok.decode(ids, skip_special_tokens=True) == "3+4="


def test_tokenizer_keeps_eos_text_as_one_token_and_maps_unknown_chars() -> None:
    tok = build_char_tokenizer()
    assert tok("7<eos>", add_special_tokens=False)["input_ids"] == [11, 2]
    assert tok("7x", add_special_tokens=False)["input_ids"] == [11, tok.unk_token_id]
    assert tok.decode([11, 2, 0, 0]) == "7<eos><pad><pad>"


def test_tokenizer_pads_on_the_left_for_generation() -> None:
    tok = build_char_tokenizer()
    batch = tok(["3+4=", "12*3="], padding=True)
    assert batch["input_ids"][0] == [0, 1, 7, 14, 8, 17]
    assert batch["attention_mask"][0] == [0, 1, 1, 1, 1, 1]
    assert batch["attention_mask"][1] == [1] * 6


def test_tokenizer_save_and_load_with_auto_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    texts = ["3+4=", "99*9=", "0-0="]
    assert loaded(texts, padding=True)["input_ids"] == tok(texts, padding=True)["input_ids"]
    assert loaded.padding_side == "left"
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    assert loaded.decode(loaded("5*5=")["input_ids"], skip_special_tokens=True) == "5*5="


def test_char_vocab_rejects_repeats_and_whitespace() -> None:
    with pytest.raises(ValueError, match="repeated"):
        char_vocab("0120")
    with pytest.raises(ValueError, match="whitespace"):
        char_vocab("01 ")


# ---------------------------------------------------------------- arithmetic problems


def test_addition_mod_10_table() -> None:
    problems = arithmetic_problems("+", 9, 10)
    assert len(problems) == 100
    table = {p.prompt: p.answer for p in problems}
    assert table["3+8="] == "1"
    assert table["0+0="] == "0"
    assert table["9+9="] == "8"
    # every answer equally frequent: a policy that ignores the prompt scores at most 0.1
    assert set(Counter(table.values()).values()) == {10}


def test_other_ops_and_no_modulo() -> None:
    assert {p.prompt: p.answer for p in arithmetic_problems("+", 9, None)}["8+9="] == "17"
    subs = arithmetic_problems("-", 9, None)
    assert len(subs) == 55 and all(not p.answer.startswith("-") for p in subs)
    assert {p.prompt: p.answer for p in arithmetic_problems("*", 3, None)}["3*3="] == "9"
    with pytest.raises(ValueError, match="op"):
        arithmetic_problems("/", 9, 10)  # type: ignore[arg-type]


# ---------------------------------------------------------------- prompt stream


def _problems() -> tuple[Sample, ...]:
    return arithmetic_problems("+", 9, 10)


def test_stream_is_deterministic_by_seed() -> None:
    a = PromptStream(_problems(), seed=7).next_batch(250)
    b = PromptStream(_problems(), seed=7).next_batch(250)
    c = PromptStream(_problems(), seed=8).next_batch(250)
    assert a == b
    assert a != c


def test_stream_batches_concatenate_to_the_same_sequence() -> None:
    whole = PromptStream(_problems(), seed=1).next_batch(230)
    s = PromptStream(_problems(), seed=1)
    pieces = s.next_batch(33) + s.next_batch(0) + s.next_batch(97) + s.next_batch(100)
    assert pieces == whole
    assert s.position == 230


def test_stream_visits_every_problem_once_per_epoch_in_new_order() -> None:
    s = PromptStream(_problems(), seed=3)
    epoch0, epoch1 = s.next_batch(100), s.next_batch(100)
    assert sorted(x.prompt for x in epoch0) == sorted(p.prompt for p in _problems())
    assert sorted(x.prompt for x in epoch1) == sorted(p.prompt for p in _problems())
    assert epoch0 != epoch1


def test_stream_resumes_from_state_dict() -> None:
    original = PromptStream(_problems(), seed=5)
    original.next_batch(137)
    state = original.state_dict()
    expected = original.next_batch(150)

    resumed = PromptStream(_problems(), seed=0)  # the state carries the seed
    resumed.load_state_dict(state)
    assert resumed.next_batch(150) == expected
    assert state == {"seed": 5, "position": 137, "num_problems": 100}


def test_stream_refuses_state_of_another_problem_set() -> None:
    state = PromptStream(_problems(), seed=0).state_dict()
    with pytest.raises(ValueError, match="100 problems"):
        PromptStream(arithmetic_problems("-", 9, None), seed=0).load_state_dict(state)


def test_stream_rejects_empty_problem_set_and_negative_batch() -> None:
    with pytest.raises(ValueError):
        PromptStream((), seed=0)
    with pytest.raises(ValueError):
        PromptStream(_problems(), seed=0).next_batch(-1)
