"""A GGUF file to a Hugging Face model directory (safetensors, config.json, tokenizer files with
the chat template), through transformers' own GGUF loader.

transformers reads a GGUF file (``from_pretrained(dir, gguf_file=...)``), dequantising every
tensor, but will not ``save_pretrained`` the model it loaded (a GGUF-quantised model is "not
serializable"). So the dequantised weights are moved, without a copy, into a model built from the
same config with no quantisation attached (on the meta device: nothing is initialised), and that
one is saved. The tokenizer is rebuilt from the file's metadata and saved beside it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlbatch.config.parse import CHOICES
from rlbatch.errors import ConfigError
from rlbatch.models.gguf_header import read_gguf_header

DTYPES = ("fp32", "bf16", "fp16")
"""The dtypes the weights are written in. fp32 holds every dequantised value exactly."""
CONFIG_FILLS: dict[str, dict[str, str]] = {
    "qwen2moe": {"expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
}
"""GGUF metadata (``<arch>.<key>``) -> config field, for what transformers' GGUF loader leaves at
its config class's default: without these a Qwen2-MoE whose expert sizes are not Qwen1.5-MoE's
builds experts of the wrong size."""


def _torch_dtype(dtype: str) -> Any:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def transformers_reads(gguf_arch: str, model_type: str) -> bool:
    """Whether transformers' GGUF loader reads a file of this ``general.architecture``; its list
    names some by their GGUF name, others by their transformers model_type (qwen2_moe)."""
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:  # a transformers without the GGUF loader
        return False
    return gguf_arch in GGUF_SUPPORTED_ARCHITECTURES or model_type in GGUF_SUPPORTED_ARCHITECTURES


def convert_gguf(path: Path, out: Path, dtype: str = "fp32",
                 metadata: Mapping[str, object] | None = None) -> dict[str, Any]:
    """Write the model of the GGUF file ``path`` to the directory ``out`` (created) in ``dtype``;
    ``metadata``: the file's header (``rlbatch.models.gguf_header``), read again when None.
    Returns what ``rlbatch-import.json`` records: model_type, parameters, dtype."""
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"source: reading {path} needs the gguf package (transformers' GGUF loader uses it): "
                          f"pip install 'rlbatch[gguf]'")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch_dtype = _torch_dtype(dtype)
    where, name = str(path.parent), path.name
    config = AutoConfig.from_pretrained(where, gguf_file=name)
    meta = read_gguf_header(path).metadata if metadata is None else metadata
    arch = str(meta.get("general.architecture", ""))
    for key, field in CONFIG_FILLS.get(arch, {}).items():
        if (value := meta.get(f"{arch}.{key}")) is not None:
            setattr(config, field, int(str(value)))
    if config.model_type not in CHOICES["model.arch"]:  # e.g. a 'llama' file transformers reads as a Mistral
        raise ConfigError(f"source: transformers reads {path} as a {config.model_type!r} model; rlbatch imports "
                          f"{', '.join(CHOICES['model.arch'])} (the architectures its engines run, model.arch)")
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, config=copy.deepcopy(config),
                                                  dtype=torch_dtype)
    state = loaded.state_dict()
    packed = sorted(k for k, v in state.items() if not v.is_floating_point())
    if packed:
        raise ConfigError(f"source: transformers kept {len(packed)} tensors of {path} quantised (e.g. {packed[0]}); "
                          f"only fully dequantised models are written")
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):  # the weights come from `state`: nothing to initialise
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(where, gguf_file=name).save_pretrained(out)
    return {"model_type": str(config.model_type), "dtype": dtype,
            "parameters": sum(p.numel() for p in model.parameters())}
