"""data.max_prompt_tokens with data.prompt_too_long: refuse, drop or truncate, counted, checked
before start (and against the inference role's context)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from rlbatch.checks.validate import check
from rlbatch.config.schema import DataConfig
from rlbatch.data import prompt_length
from rlbatch.data.prompt_length import PromptCounts, guard, truncate
from rlbatch.data.source import guarded_problems, make_stream
from rlbatch.data.synthetic import Sample
from rlbatch.data.tokenizer import build_char_tokenizer
from rlbatch.errors import ConfigError
from tests.unit.chat_fixtures import chat_tokenizer, save_chat_tokenizer
from tests.unit.configs import problems, set_

QUESTIONS = ["1+2=", "12345+6789=", "9*9=", "111111111+222222222=", "3-1="]
"""With the character tokenizer (one token a character, and a BOS): 5, 12, 5, 21 and 5 tokens."""


def write(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": "0"}) + "\n" for q in QUESTIONS))
    return path


def data(tmp_path: Path, **fields: Any) -> DataConfig:
    return DataConfig(name="file", path=str(write(tmp_path)), **fields)


def test_refuse_names_the_first_prompt_over_the_limit_its_length_and_the_limit(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        guarded_problems(data(tmp_path, max_prompt_tokens=10))
    [line] = e.value.problems
    assert "data.max_prompt_tokens: prompt 1 of the data set '12345+6789='" in line
    assert "is 12 tokens, over the limit of 10 (2 of 5 prompts are, the longest 21 tokens)" in line
    assert "prompt_too_long=drop or truncate" in line
    # at the limit is within it
    kept, counts = guarded_problems(data(tmp_path, max_prompt_tokens=21))
    assert [s.prompt for s in kept] == QUESTIONS and counts.dropped == counts.truncated == 0 and counts.longest == 21


def test_drop_leaves_the_long_prompts_out_counts_them_and_says_so_once(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prompt_length, "_said", set())  # what earlier tests in this process logged
    with caplog.at_level(logging.WARNING, logger="rlbatch.data.prompt_length"):
        kept, counts = guarded_problems(data(tmp_path, max_prompt_tokens=10, prompt_too_long="drop"))
        guarded_problems(data(tmp_path, max_prompt_tokens=10, prompt_too_long="drop"))  # read again: not logged again
    assert [s.prompt for s in kept] == ["1+2=", "9*9=", "3-1="]
    assert (counts.prompts, counts.dropped, counts.truncated, counts.longest) == (5, 2, 0, 21)
    assert counts.metrics() == {"data/prompts_dropped": 2.0, "data/prompts_truncated": 0.0,
                                "data/prompt_tokens_max": 21.0}
    [line] = [r.getMessage() for r in caplog.records]
    assert line == ("data.max_prompt_tokens=10: 2 of 5 prompts are longer, dropped (the first: prompt 1, 12 tokens; "
                    "the longest 21 tokens)")
    # the training stream holds what is left, and the run's rows get the counts
    got = PromptCounts()
    stream, fingerprint = make_stream(data(tmp_path, max_prompt_tokens=10, prompt_too_long="drop"), seed=1, counts=got)
    assert fingerprint.startswith("3:") and got.dropped == 2
    with pytest.raises(ConfigError, match="every one of the 5 prompts is over the limit of 4 tokens .the shortest is 5."):
        guarded_problems(data(tmp_path, max_prompt_tokens=4, prompt_too_long="drop"))


def test_truncate_keeps_the_end_of_a_prompt_by_default_and_its_start_on_the_right(tmp_path: Path) -> None:
    tok = build_char_tokenizer()
    kept, counts = guarded_problems(data(tmp_path, max_prompt_tokens=8, prompt_too_long="truncate"))
    assert [s.prompt for s in kept] == ["1+2=", "5+6789=", "9*9=", "222222=", "3-1="]  # 7 characters + the BOS
    assert [s.answer for s in kept] == ["0"] * 5 and (counts.truncated, counts.dropped) == (2, 0)
    assert all(len(tok(s.prompt)["input_ids"]) <= 8 for s in kept)
    right, _ = guarded_problems(data(tmp_path, max_prompt_tokens=8, prompt_too_long="truncate", truncation_side="right"))
    assert [s.prompt for s in right] == ["1+2=", "12345+6", "9*9=", "1111111", "3-1="]
    assert counts.metrics("eval/data")["eval/data/prompts_truncated"] == 2.0


def test_truncation_cuts_a_bpe_prompt_at_a_token_boundary_within_the_limit() -> None:
    tok = chat_tokenizer(bos=True)  # adds a BOS to every text: it counts against the limit
    text = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."
    full = len(tok(text)["input_ids"])
    for limit in range(2, full):
        left, right = truncate(text, limit, "left", tok), truncate(text, limit, "right", tok)
        assert text.endswith(left) and text.startswith(right) and left and right
        assert len(tok(left)["input_ids"]) <= limit and len(tok(right)["input_ids"]) <= limit
    assert truncate(text, full - 3, "left", tok).endswith("clips in May.")
    with pytest.raises(ConfigError, match="leaves no room for a prompt's text: the tokenizer adds 1 special tokens"):
        guard([Sample(text, "")], DataConfig(max_prompt_tokens=1, prompt_too_long="truncate"), tok)


def test_the_guard_is_checked_before_start_and_against_the_context(cfg: dict[str, Any], tmp_path: Path) -> None:
    model = save_chat_tokenizer(tmp_path / "model")
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 64}))
    from transformers import AutoTokenizer

    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(str(model))(QUESTIONS)["input_ids"]]
    limit = sorted(lengths)[-2]  # one prompt over it
    first = max(range(len(QUESTIONS)), key=lengths.__getitem__)
    on_file = set_(cfg, model__path=str(model), data__name="file", data__path=str(write(tmp_path)),
                   data__max_prompt_tokens=limit)
    [line] = [p for p in problems(on_file) if "max_prompt_tokens" in p]
    assert (f"data.max_prompt_tokens: prompt {first} of the data set {QUESTIONS[first]!r} is {lengths[first]} tokens, "
            f"over the limit of {limit} (1 of 5 prompts are") in line
    check(set_(on_file, data__prompt_too_long="drop"))  # passes
    assert any("data.prompt_too_long: 'cut' is not one of ['refuse', 'drop', 'truncate']" in p
               for p in problems(set_(on_file, data__prompt_too_long="cut")))
    # the longest prompt and response against the model's positions and vLLM's max_model_len
    long = set_(on_file, data__max_prompt_tokens=60, algo__max_new_tokens=8)
    assert any(p.startswith("data.max_prompt_tokens: 60 prompt tokens + algo.max_new_tokens=8 = 68 > the model's "
                            "max_position_embeddings=64") and "lower data.max_prompt_tokens to 56" in p
               for p in problems(long))
    random_init = set_(cfg, data__max_prompt_tokens=125, algo__max_new_tokens=8)  # model.max_position_embeddings=128
    assert ("data.max_prompt_tokens: 125 prompt tokens + algo.max_new_tokens=8 = 133 > model.max_position_embeddings"
            "=128: the longest prompt and response do not fit; lower data.max_prompt_tokens to 120 or "
            "algo.max_new_tokens") in problems(random_init, runnable=False)
    check(set_(cfg, data__max_prompt_tokens=120, algo__max_new_tokens=8))
    engine = set_(cfg, data__max_prompt_tokens=40, algo__max_new_tokens=8,
                  roles__actor_infer__engine_args={"max_model_len": 32})
    assert any("48 > roles.actor_infer.engine_args.max_model_len=32" in p for p in problems(engine, runnable=False))
    evaluated = set_(cfg, eval__every=5, eval__data__max_prompt_tokens=125)
    assert any(p.startswith("eval.data.max_prompt_tokens: 125 prompt tokens") for p in problems(evaluated, runnable=False))
