"""The commands of docs/recipes.md run as written: each ``<!-- recipe: NAME -->`` block is composed
and validated by the real launcher (``dry_run=true``) or planner, with stand-ins for the paths it
names on a cluster, and each ``<!-- recipe: NAME output -->`` block's lines ("..." elides) are
lines of what that command prints. A renamed field, a refused value or a changed prediction fails
here rather than in a user's job.

The stand-ins: Qwen2.5-0.5B-Instruct's config.json (its published shape, so the placement rules
and the planner judge the real model) with the ChatML tokenizer of ``tests/unit/chat_fixtures.py``,
and the GSM8K sample of tests/data written as verl's parquet layout.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from rlbatch.checks.validate import check
from rlbatch.config.compose import compose
from rlbatch.launch.__main__ import main as launch
from rlbatch.plan.__main__ import main as plan
from tests.unit.chat_fixtures import save_chat_tokenizer

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "docs" / "recipes.md"
QWEN25_05B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
              "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 151936, "hidden_act": "silu",
              "bos_token_id": 151643, "eos_token_id": 151645}
"""Qwen2.5-0.5B-Instruct's config.json, the fields rlbatch reads."""


def blocks(text: str) -> dict[str, str]:
    """NAME -> the fenced block right after each ``<!-- recipe: NAME -->``."""
    return {m[1].strip(): m[2] for m in re.finditer(r"<!-- recipe: ([^>]+?) -->\n```[a-z]*\n(.*?)```", text, re.S)}


def command(block: str, module: str, paths: dict[str, str]) -> list[str]:
    """The overrides of ``python -m <module> ...`` in ``block``, with the cluster paths replaced."""
    for cluster_path, local in paths.items():
        block = block.replace(cluster_path, local)
    words = shlex.split(block.replace("\\\n", " "))
    assert words[:3] == ["python", "-m", module], words[:3]
    return words[3:]


def printed(lines: str, out: str) -> None:
    got = out.splitlines()
    for line in lines.splitlines():
        if line.strip() not in ("", "..."):
            assert line in got, f"docs/recipes.md shows {line!r}, which the command does not print:\n{out}"


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("recipe")
    model = save_chat_tokenizer(root / "Qwen2.5-0.5B-Instruct")
    (model / "config.json").write_text(json.dumps(QWEN25_05B))
    data = root / "gsm8k"
    data.mkdir()
    rows = [json.loads(line) for line in (ROOT / "tests/data/gsm8k_sample.jsonl").read_text().splitlines()]
    for split in ("train", "test"):
        pq.write_table(pa.Table.from_pylist([
            {"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": r["question"] + ' Let\'s think step by step and output the final '
                                                                    'answer after "####".'}],
             "reward_model": {"style": "rule", "ground_truth": r["answer"].split("####")[-1].strip()},
             "extra_info": {"split": split, "index": i}} for i, r in enumerate(rows)]), data / f"{split}.parquet")
    return {"/models/Qwen2.5-0.5B-Instruct": str(model), "/data/gsm8k": str(data)}


def test_the_gsm8k_recipe_launches_as_written(paths: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    docs = blocks(RECIPES.read_text())
    args = command(docs["gsm8k-grpo-launch"], "rlbatch.launch", paths)
    cfg = compose(args)
    placement = check(cfg)
    assert placement.num_gpus == 8 and placement.roles["actor_infer"].engine == "vllm"
    assert (cfg.data.chat_template, dict(cfg.data.reward_fns)) == (True, {"openai/gsm8k": "rlbatch.rewards.math:gsm8k_match"})
    assert (cfg.eval.every, cfg.eval.at_start, cfg.eval.data.chat_template) == (10, True, True)
    assert list(cfg.logger) == ["tensorboard", "wandb", "mlflow"]
    assert (cfg.trackers.wandb.mode, list(cfg.trackers.wandb.tags)) == ("offline", ["qwen2.5-0.5b", "grpo"])
    assert cfg.trackers.mlflow.tracking_uri is None
    assert launch([*args, "dry_run=true"]) == 0, capsys.readouterr().err
    printed(docs["gsm8k-grpo-launch output"], capsys.readouterr().out)


def test_the_gsm8k_recipe_plan_predicts_what_the_docs_show(paths: dict[str, str],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    docs = blocks(RECIPES.read_text())
    assert plan(command(docs["gsm8k-grpo-plan"], "rlbatch.plan", paths)) == 0, capsys.readouterr().err
    printed(docs["gsm8k-grpo-plan output"], capsys.readouterr().out)
