"""data.name=word_arithmetic: seeded arithmetic word problems, held out without overlap, rendered
with the model's chat template, and the smollm2_arithmetic experiment built on them."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rlbatch.checks.validate import check
from rlbatch.data.source import make_stream, problems_of, split_holdout
from rlbatch.data.word_problems import TEMPLATES, Problem, pool, word_problems
from rlbatch.rewards.math import gsm8k_match
from tests.unit.chat_fixtures import save_chat_tokenizer
from tests.unit.configs import problems, set_


def triple(question: str) -> Problem:
    """The operation and operands a question tells, read back from its words."""
    for op, wordings in TEMPLATES.items():
        for w in wordings:
            pattern = re.escape(w).replace(r"\{a\}", r"(?P<a>\d+)").replace(r"\{b\}", r"(?P<b>\d+)")
            pattern = re.sub(r"\\\{\w+\\\}", r"[A-Za-z]+", pattern)
            if m := re.fullmatch(pattern, question):
                return Problem(op, int(m["a"]), int(m["b"]))
    raise AssertionError(f"no template tells {question!r}")


def data(**fields: Any) -> SimpleNamespace:
    return SimpleNamespace(**({"name": "word_arithmetic", "chat_template": False, "system_prompt": None,
                               "template": "{question}"} | fields))


def test_every_problem_is_told_once_in_words_with_its_answer() -> None:
    every = word_problems()
    told = [triple(s.prompt) for s in every]
    assert sorted(told, key=repr) == sorted(pool(), key=repr) and len(set(told)) == len(told) == len(every)
    assert all(s.answer == str(p.value) and int(s.answer) >= 0 for s, p in zip(every, told, strict=True))
    assert {p.op for p in told} == {"+", "-", "*"} and len({s.prompt for s in every}) == len(every)
    assert word_problems() == every and word_problems(seed=1) != every  # seeded: order and wording
    assert set(word_problems(seed=1)) != set(every)
    assert gsm8k_match(f"{every[0].answer}", every[0].answer) == 1.0  # math-verify scores the plain number


def test_held_out_problems_share_no_numbers_with_the_training_stream() -> None:
    d = data(template="{question} Answer with just the number.")
    every = problems_of(d)
    assert all(s.prompt.endswith("? Answer with just the number.") for s in every)
    train, held = split_holdout(every, 64, seed=0)
    stream, _ = make_stream(d, seed=5, holdout=64, holdout_seed=0)
    seen = {s for _ in range(2 * len(every) // 50 + 1) for s in stream.next_batch(50)}
    assert seen == set(train) and len(held) == 64
    held_triples = {triple(s.prompt.removesuffix(" Answer with just the number.")) for s in held}
    seen_triples = {triple(s.prompt.removesuffix(" Answer with just the number.")) for s in seen}
    assert held_triples.isdisjoint(seen_triples) and len(held_triples) == 64


def test_the_problems_go_through_the_models_chat_template(tmp_path: Path) -> None:
    model = save_chat_tokenizer(tmp_path / "chat")
    stream, _ = make_stream(data(chat_template=True, system_prompt="Be brief.", template="{question} Just the number."),
                            0, SimpleNamespace(path=str(model)))
    [s] = stream.next_batch(1)
    question = s.prompt.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
    assert s.prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert s.prompt.endswith(" Just the number.<|im_end|>\n<|im_start|>assistant\n")
    assert str(triple(question.removesuffix(" Just the number.")).value) == s.answer


def test_the_experiment_validates_and_refuses_to_start_without_the_model(cfg: dict[str, Any], tmp_path: Path) -> None:
    from rlbatch.config.compose import compose

    model = save_chat_tokenizer(tmp_path / "model")
    composed = compose(["experiment=smollm2_arithmetic", f"run_dir={tmp_path / 'run'}", f"model.path={model}"])
    assert (composed.data.name, composed.eval.holdout, composed.data.chat_template) == ("word_arithmetic", 32, True)
    assert composed.eval.at_start and composed.eval.every > 0
    assert composed.data.reward_fn == "rlbatch.rewards.math:gsm8k_match"
    check(composed, runnable=False)
    without = compose(["experiment=smollm2_arithmetic", f"run_dir={tmp_path / 'run'}"])
    assert without.model.path is None
    assert any(p.startswith("data.chat_template: true needs model.path") for p in problems(without))
    assert any("data.name: 'words' is not one of" in p and "word_arithmetic" in p
               for p in problems(set_(cfg, data__name="words")))
