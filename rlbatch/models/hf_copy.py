"""A local Hugging Face model directory to the layout every engine loads: safetensors weights
(``pytorch_model*.bin`` converted, shard by shard), config.json and the tokenizer files.

The directory's top-level files are copied (not linked: a file rewritten in place at the source
must not change an imported model); weights in other formats and subdirectories are left behind.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from rlbatch.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""One of these makes a tokenizer (tokenizer_config.json alone does not)."""
LEFT_BEHIND = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".ot")
"""Weights in formats other than safetensors: not copied."""
BIN_INDEX = "pytorch_model.bin.index.json"


def model_type(src: Path) -> str:
    """The ``model_type`` of ``src``/config.json; a ConfigError when there is none."""
    file = src / "config.json"
    try:
        return str(json.loads(file.read_text()).get("model_type", ""))
    except FileNotFoundError:
        ggufs = sorted(p.name for p in src.glob("*.gguf"))
        hint = f"; to import a GGUF file, name the file: {src / ggufs[0]}" if ggufs else ""
        raise ConfigError(f"source: {src} has no config.json; it is not a Hugging Face model directory{hint}") from None
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"source: {file} cannot be read as a JSON object: {e}") from None


def _bin_to_safetensors(src: Path, dst: Path) -> None:
    import torch
    from safetensors.torch import save_file

    state = torch.load(src, map_location="cpu", weights_only=True, mmap=True)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, tensor in state.items():  # safetensors refuses tensors that share memory (tied weights)
        ptr = tensor.untyped_storage().data_ptr()
        tensors[key] = tensor.clone() if ptr in seen or not tensor.is_contiguous() else tensor
        seen.add(ptr)
    save_file(tensors, str(dst), metadata={"format": "pt"})


def _safetensors_name(name: str) -> str:
    return name.replace("pytorch_model", "model").replace(".bin", ".safetensors")


def copy_hf_dir(src: Path, out: Path) -> dict[str, Any]:
    """Write ``src``'s model to the directory ``out`` (created). Returns what
    ``rlbatch-import.json`` records: model_type and which weights files were converted."""
    files = sorted(p for p in src.iterdir() if p.is_file() and not p.name.startswith("."))
    names = {p.name for p in files}
    if not names & set(TOKENIZER_FILES):
        raise ConfigError(f"source: {src} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); every engine "
                          f"loads the tokenizer from the model directory")
    safetensors = [p for p in files if p.suffix == ".safetensors"]
    bins = [p for p in files if p.suffix == ".bin" and p.name.startswith("pytorch_model")]
    if not safetensors and not bins:
        raise ConfigError(f"source: {src} has no weights (no *.safetensors, no pytorch_model*.bin)")
    out.mkdir(parents=True)
    for p in files:
        if not p.name.endswith(LEFT_BEHIND) and p.name != BIN_INDEX:
            shutil.copy2(p, out / p.name)
    converted = []
    if not safetensors:
        for p in bins:
            _bin_to_safetensors(p, out / _safetensors_name(p.name))
            converted.append(p.name)
        if BIN_INDEX in names:
            index = json.loads((src / BIN_INDEX).read_text())
            index["weight_map"] = {k: _safetensors_name(v) for k, v in index.get("weight_map", {}).items()}
            (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return {"model_type": model_type(src), "converted": converted}
