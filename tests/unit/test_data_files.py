"""Data files: flat records and verl's layout, as jsonl and parquet; bad records counted, not fatal."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rlbatch.data.chat import ChatPrompts
from rlbatch.data.records import read_rows
from rlbatch.data.source import file_problems, fingerprint, make_stream
from rlbatch.errors import ConfigError
from tests.unit.chat_fixtures import chat_tokenizer

REPO = Path(__file__).parents[2]
GSM8K = REPO / "tests/data/gsm8k_sample.jsonl"


def data_cfg(path: Path, **kw: Any) -> SimpleNamespace:
    base = {"name": "file", "path": str(path), "layout": "auto", "prompt_key": None, "answer_key": None,
            "data_source_key": None, "template": "Q: {question}\nA:", "chat_template": False, "system_prompt": None}
    return SimpleNamespace(**(base | kw))


def write(path: Path, records: list[Any]) -> Path:
    """``records`` as jsonl (each one line, a str written as it is) or parquet (through HF datasets)."""
    if path.suffix == ".parquet":
        import datasets

        datasets.Dataset.from_list(records).to_parquet(str(path))
    else:
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def verl(question: str, answer: str, source: str = "openai/gsm8k", index: int = 0) -> dict[str, Any]:
    return {"data_source": source, "prompt": [{"role": "user", "content": question}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer}, "extra_info": {"split": "train", "index": index}}


GSM8K_ROWS = [json.loads(line) for line in GSM8K.read_text().splitlines()]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_flat_records_become_templated_prompts_and_answers(tmp_path: Path, suffix: str) -> None:
    path = write(tmp_path / f"train{suffix}", GSM8K_ROWS)
    problems = file_problems(data_cfg(path))
    assert [p.prompt for p in problems] == [f"Q: {r['question']}\nA:" for r in GSM8K_ROWS]
    assert [p.answer for p in problems] == [r["answer"] for r in GSM8K_ROWS]
    assert {p.data_source for p in problems} == {""}


def test_a_flat_file_keeps_the_fingerprint_of_earlier_runs() -> None:
    """Checkpoints store the dataset's fingerprint; the file reader must give the prompts and
    answers the earlier reader did (template(question), str(answer)), or a resume is refused."""
    h = hashlib.sha256()
    for r in GSM8K_ROWS:
        h.update(f"Q: {r['question']}\nA:".encode() + b"\0" + r["answer"].encode() + b"\1")
    assert fingerprint(file_problems(data_cfg(GSM8K))) == f"{len(GSM8K_ROWS)}:{h.hexdigest()[:16]}"


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_verl_layout_is_read_by_its_fields_and_keeps_the_data_source(tmp_path: Path, suffix: str) -> None:
    rows = [verl("What is 2+2?", "4"), verl("Half of 1?", "\\frac{1}{2}", source="lighteval/MATH", index=1)]
    path = write(tmp_path / f"train{suffix}", rows)
    problems = file_problems(data_cfg(path), ChatPrompts(chat_tokenizer()))
    assert [(p.answer, p.data_source) for p in problems] == [("4", "openai/gsm8k"), ("\\frac{1}{2}", "lighteval/MATH")]
    assert problems[0].prompt == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


def test_verl_chat_prompts_without_a_chat_template_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "train.jsonl", [verl("a", "1"), verl("b", "2")])
    with pytest.raises(ConfigError, match=r"the prompts \('prompt'\) of 2 records are chat messages \(rows 1, 2\); "
                                          r"set data.chat_template=true"):
        file_problems(data_cfg(path))


def test_field_names_are_configurable_dotted_paths(tmp_path: Path) -> None:
    rows = [{"problem": "1+1", "meta": {"solution": {"final": 2}, "origin": "mine"}}]
    path = write(tmp_path / "train.jsonl", rows)
    [p] = file_problems(data_cfg(path, prompt_key="problem", answer_key="meta.solution.final",
                                 data_source_key="meta.origin", template="{question}="))
    assert (p.prompt, p.answer, p.data_source) == ("1+1=", "2", "mine")
    # verl's text-prompt variant: the layout forced, the prompt key overridden
    path = write(tmp_path / "v.jsonl", [{"question": "3+3", "reward_model": {"ground_truth": "6"}}])
    [p] = file_problems(data_cfg(path, layout="verl", prompt_key="question", template="{question}"))
    assert (p.prompt, p.answer) == ("3+3", "6")


def test_jsonl_values_are_kept_exactly_as_written(tmp_path: Path) -> None:
    """A column of mixed types (a number in one line, text in another) is read as written: HF
    datasets' pandas fallback would turn the text "007" into the number 7."""
    path = write(tmp_path / "train.jsonl", [{"question": "a", "answer": "007"}, {"question": "b", "answer": 8},
                                            {"question": "c", "answer": "2020-01-01"}, {"question": "d", "answer": 0.5}])
    assert [p.answer for p in file_problems(data_cfg(path))] == ["007", "8", "2020-01-01", "0.5"]


BAD = [
    {"question": "ok 1", "answer": "1"},
    {"question": "no answer"},
    '{"question": "broken", "answer": ',
    {"answer": "no question"},
    {"question": ["not", "messages"], "answer": "2"},
    {"question": "a list answer", "answer": [1, 2]},
    {"question": "   ", "answer": "3"},
    [1, 2, 3],
    {"question": "ok 2", "answer": 5, "data_source": "src"},
    {"question": "null answer", "answer": None},
    {"question": "bool answer", "answer": True},
    {"question": "bad source", "answer": "4", "data_source": 7},
]


def test_bad_records_are_skipped_and_reported_with_their_rows(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path / "train.jsonl", BAD)
    with caplog.at_level(logging.WARNING, logger="rlbatch.data.source"):
        problems = file_problems(data_cfg(path, template="{question}"))
    assert [(p.prompt, p.answer, p.data_source) for p in problems] == [("ok 1", "1", ""), ("ok 2", "5", "src")]
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"data.path: {path}: 10 of 12 records skipped: 2 have no field 'answer' (rows 2, 10); ")
    for part in ("2 have no field 'answer' (rows 2, 10)", "1 is not valid JSON (row 3)", "1 has no field 'question' (row 4)",
                 "1 has a 'question' list that is not chat messages", "(row 5)",
                 "1 has an 'answer' of type list (expected text or a number) (row 6)", "1 has an empty 'question' (row 7)",
                 "1 is not an object (list) (row 8)", "1 has an 'answer' of type bool (expected text or a number) (row 11)",
                 "1 has a 'data_source' of type int (expected text) (row 12)", "the other 2 are used"):
        assert part in warning, (part, warning)


def test_rows_are_line_numbers_and_a_line_that_is_not_utf8_is_one_bad_record(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"question": "a\xe2\x80\xa8b", "answer": "1"}\n\n{"question": "\xff", "answer": "2"}\n'
                     b'{"question": "c", "answer": "3"}\r\n')
    assert [(n, r) for n, r in read_rows(str(path)) if isinstance(r, dict)] == [
        (1, {"question": "a\u2028b", "answer": "1"}), (4, {"question": "c", "answer": "3"})]
    problems = file_problems(data_cfg(path, template="{question}"))
    assert [p.prompt for p in problems] == ["a\u2028b", "c"]


def test_a_file_without_a_usable_record_is_an_error_naming_the_file_and_the_counts(tmp_path: Path) -> None:
    path = write(tmp_path / "train.jsonl", [{"q": "x", "a": "1"}] * 3 + ["not json"])
    with pytest.raises(ConfigError) as e:
        file_problems(data_cfg(path))
    assert str(e.value) == (f"data.path: {path}: none of its 4 records is usable (4 of 4 records skipped: 3 have no "
                            f"field 'question' (rows 1, 2, 3); 1 is not valid JSON (row 4)); fields read: prompt "
                            f"'question', answer 'answer' (data.prompt_key, data.answer_key, data.layout)")


def test_a_bad_parquet_row_is_skipped_too(tmp_path: Path) -> None:
    rows = [verl("a", "1"), verl("b", "2")]
    rows[1]["reward_model"]["ground_truth"] = None
    path = write(tmp_path / "train.parquet", rows)
    [p] = file_problems(data_cfg(path), ChatPrompts(chat_tokenizer()))
    assert p.answer == "1"


def test_a_json_array_file_and_the_row_reader(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(GSM8K_ROWS[:2]))
    assert [r for _, r in read_rows(str(tmp_path / "a.json"))] == GSM8K_ROWS[:2]
    with pytest.raises(ConfigError, match="is not a .jsonl, .json or .parquet file"):
        read_rows(str(tmp_path / "a.csv"))


def test_the_stream_over_a_file_is_seeded_and_resumes(tmp_path: Path) -> None:
    flat = write(tmp_path / "flat.jsonl", [{"question": f"q{i}", "answer": str(i), "data_source": f"s{i % 2}"}
                                           for i in range(7)])
    a, fa = make_stream(data_cfg(flat), 3)
    b, fb = make_stream(data_cfg(flat), 3)
    first = a.next_batch(10)
    b.load_state_dict(a.state_dict())
    assert fa == fb and b.next_batch(9) == a.next_batch(9)
    assert sorted(s.answer for s in first[:7]) == [str(i) for i in range(7)]
    assert {s.data_source for s in first} == {"s0", "s1"}
    with pytest.raises(ConfigError, match="data.chat_template: true needs model.path"):
        make_stream(data_cfg(flat, chat_template=True), 3, SimpleNamespace(path=None))
