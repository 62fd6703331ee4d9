"""Chat templates (data.chat_template) and what the launcher refuses about the data section."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rlbatch.checks.validate import check
from rlbatch.data.chat import ChatPrompts
from rlbatch.data.source import make_stream
from rlbatch.errors import ConfigError
from tests.unit.chat_fixtures import BOS_CHAT, CHATML, chat_tokenizer, save_chat_tokenizer
from tests.unit.configs import problems, set_

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Natalia sold 48 clips in April."}]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Model directories with a ChatML tokenizer and with one without a template: what the launcher's
    checks and the prompt stream read (a tokenizer and config.json; a launch needs save_chat_model's weights)."""
    root = tmp_path_factory.mktemp("chat_models")
    return {"chat": save_chat_tokenizer(root / "chat"), "plain": save_chat_tokenizer(root / "plain", template=None)}


def rank_ids(tok: Any, text: str) -> list[int]:
    """How the ranks encode a prompt's text (rlbatch/loop/rank_runtime.py: tokenizer(texts))."""
    return list(tok([text])["input_ids"][0])


def template_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True, add_generation_prompt=True)["input_ids"])


@pytest.mark.parametrize(("template", "bos"), [(CHATML, False), (BOS_CHAT, True)], ids=["chatml", "bos-in-template"])
def test_rendered_prompts_encode_as_apply_chat_template(template: str, bos: bool) -> None:
    """The ids the ranks encode from the rendered text equal apply_chat_template's, also for a
    tokenizer that adds a BOS its template writes as well (one BOS, not two)."""
    tok = chat_tokenizer(template, bos=bos)
    chat = ChatPrompts(tok)
    for messages in (MESSAGES, [MESSAGES[1]]):
        assert rank_ids(tok, chat.render(messages)) == template_ids(tok, messages)
    assert chat.render("What is 2+2?") == tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True)[len(tok.bos_token or ""):]
    if bos:
        assert template_ids(tok, MESSAGES).count(tok.bos_token_id) == 1


def test_the_system_prompt_goes_first_unless_the_record_has_its_own() -> None:
    tok = chat_tokenizer()
    chat = ChatPrompts(tok, system_prompt="Put the answer in \\boxed{}.")
    assert chat.render("2+2?") == ("<|im_start|>system\nPut the answer in \\boxed{}.<|im_end|>\n"
                                   "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert chat.render(MESSAGES).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


def test_a_tokenizer_without_a_template_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"model.path: /m has no chat template .* but data.chat_template=true"):
        ChatPrompts(chat_tokenizer(template=None), where="/m")


def test_the_stream_renders_a_saved_models_template(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"q{i}"}],
                                        "reward_model": {"ground_truth": str(i)}}) + "\n" for i in range(3)))
    data = SimpleNamespace(name="file", path=str(path), layout="auto", prompt_key=None, answer_key=None,
                           data_source_key=None, template="{question}", chat_template=True, system_prompt="Be brief.")
    stream, _ = make_stream(data, 0, SimpleNamespace(path=str(model_dirs["chat"])))
    tok = AutoTokenizer.from_pretrained(model_dirs["chat"])
    for s in stream.next_batch(3):
        i = s.answer
        assert rank_ids(tok, s.prompt) == template_ids(tok, [{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": f"q{i}"}])
    synthetic = SimpleNamespace(name="synthetic", chat_template=True, system_prompt=None)
    [s] = make_stream(synthetic, 0, SimpleNamespace(path=str(model_dirs["chat"])))[0].next_batch(1)
    assert s.prompt.startswith("<|im_start|>user\n") and s.prompt.endswith("=<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ConfigError, match="has no chat template"):
        make_stream(data, 0, SimpleNamespace(path=str(model_dirs["plain"])))


def test_the_default_experiment_keeps_its_plain_prompts() -> None:
    data = SimpleNamespace(name="synthetic", chat_template=False, system_prompt=None)
    stream, fp = make_stream(data, 0, SimpleNamespace(path=None))
    assert fp == make_stream(data, 0)[1]
    assert all(len(s.prompt) == 4 and s.prompt.endswith("=") for s in stream.next_batch(100))


# ------------------------------------------------------------------------------ refused before start




def test_a_chat_template_needs_a_model_whose_tokenizer_has_one(cfg: dict[str, Any], model_dirs: dict[str, Path]) -> None:
    plain = model_dirs["plain"]
    assert problems(set_(cfg, data__chat_template=True, model__path=str(plain))) == [
        f"model.path: {plain} has no chat template (no chat_template.jinja, chat_template.json or 'chat_template' in "
        f"tokenizer_config.json), but data.chat_template=true; give a model directory whose tokenizer has one, or set "
        f"data.chat_template=false"]
    check(set_(cfg, data__chat_template=True, model__path=str(model_dirs["chat"])))
    check(set_(cfg, data__chat_template=True, model__path=str(plain), model__check_path=False))
    assert problems(set_(cfg, data__chat_template=True)) == [
        "data.chat_template: true needs model.path (a model directory whose tokenizer has a chat template): the "
        "built-in character tokenizer has none"]
    assert problems(set_(cfg, data__system_prompt="Be brief.")) == [
        "data.system_prompt: set, but data.chat_template=false: only a chat template puts a system message in the "
        "prompt; set data.chat_template=true or unset data.system_prompt"]


def test_a_template_from_an_older_transformers_is_found(tmp_path: Path) -> None:
    from rlbatch.data.chat import template_file

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    assert template_file(tmp_path) == "tokenizer_config.json"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "x"}))
    assert template_file(tmp_path) is None


def test_the_data_files_records_are_checked_before_start(cfg: dict[str, Any], model_dirs: dict[str, Path],
                                                         tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "q"}], "reward_model": {"ground_truth": "1"}}) + "\n")
    c = set_(cfg, data__name="file", data__path=str(path), model__path=str(model_dirs["chat"]))
    assert problems(c) == [f"data.path: {path}: the prompts ('prompt') of 1 of its 1 usable records are chat messages; "
                           f"set data.chat_template=true to render them with the model's chat template"]
    check(set_(c, data__chat_template=True))
    path.write_text('{"q": "1+1"}\n')
    assert problems(c) == [f"data.path: {path}: none of its 1 records is usable (1 of 1 records skipped: 1 has no field "
                           f"'question' (row 1)); fields read: prompt 'question', answer 'answer' (data.prompt_key, "
                           f"data.answer_key, data.layout)"]
    check(set_(c, data__prompt_key="q", data__answer_key="q"))


def test_layout_template_and_reward_routes_are_checked_before_start(cfg: dict[str, Any]) -> None:
    assert problems(set_(cfg, data__layout="csv")) == ["data.layout: 'csv' is not one of ['auto', 'flat', 'verl']"]
    [line] = problems(set_(cfg, data__template="{q}"))
    assert line.startswith("data.template: '{q}' cannot be filled with the question only (KeyError: 'q')")
    routes = {"openai/gsm8k": "rlbatch.rewards.math:gsm8k_match", "lighteval/MATH": "rlbatch.rewards.math:nope"}
    assert problems(set_(cfg, data__reward_fns=routes)) == [
        "data.reward_fns['lighteval/MATH']: reward function 'rlbatch.rewards.math:nope': module "
        "'rlbatch.rewards.math' has no attribute 'nope'"]
    check(set_(cfg, data__reward_fns={"openai/gsm8k": "rlbatch.rewards:gsm8k_match"}))
    check(set_(cfg, data__reward_fns=routes), runnable=False)  # the planner imports nothing


def test_a_template_that_disagrees_with_its_tokenizer_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """A Llama-style tokenizer adds a BOS to every text, but its template does not write one: the ranks
    would encode one more token than apply_chat_template. The launcher refuses it (exit 2, the prompt and
    the counts) before starting a rank or creating the run directory."""
    import subprocess
    import sys

    model = tmp_path / "model"
    chat_tokenizer(CHATML, bos=True).save_pretrained(model)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    run_dir = tmp_path / "run"
    args = ["experiment=smoke", "data.chat_template=true", f"model.path={model}", f"run_dir={run_dir}"]
    proc = subprocess.run([sys.executable, "-m", "rlbatch.launch", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "data.chat_template: prompt 0 of" in proc.stderr and "do not round-trip" in proc.stderr, proc.stderr
    assert not run_dir.exists()
    dry = subprocess.run([sys.executable, "-m", "rlbatch.launch", *args, "dry_run=true"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=180)
    assert dry.returncode == 0, dry.stderr[-2000:]  # a dry run stays instant: it leaves the heavy checks out
