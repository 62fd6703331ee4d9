"""A checkpoint's trained policy as a Hugging Face model directory (``python -m rlbatch.export``).

Reads only the model tensors of the role's DCP shards, in one process without a process group
(DCP stores global shapes and offsets, so the shards of any number of ranks reassemble), into
the architecture the run's config.yaml describes, and writes it with ``save_pretrained``:
safetensors weights, config.json, generation_config.json and the tokenizer.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from rlbatch.checkpoint.files import CONFIG, role_dir
from rlbatch.checkpoint.store import Checkpoint, CheckpointError, open_checkpoint

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
"""Module-wrapper prefixes (torch.compile, activation checkpointing, FSDP1) that are not HF names."""


@dataclass(frozen=True)
class Exported:
    checkpoint: Checkpoint
    out: Path
    files: list[Path]


def _hf_name(fqn: str) -> str:
    for w in _WRAPPERS:
        fqn = fqn.replace(w, "")
    return fqn


def find_config(ckpt: Checkpoint) -> Path:
    """The run's config: the copy in the checkpoint, else the run dir in the meta, else ../../."""
    candidates = [ckpt.path / CONFIG]
    if ckpt.meta.get("run_dir"):
        candidates.append(Path(ckpt.meta["run_dir"]) / CONFIG)
    candidates.append(ckpt.path.parent.parent / CONFIG)
    for c in candidates:
        if c.is_file():
            return c
    raise CheckpointError(f"{ckpt.path}: no {CONFIG} found (looked at {', '.join(map(str, candidates))})")


def load_weights(dcp_dir: Path, model: torch.nn.Module, only_trained: bool = False) -> int:
    """Load the ``model.*`` tensors of a DCP checkpoint into a plain (unsharded) model, strictly
    (``only_trained``: the tensors of the parameters that require grad, a LoRA checkpoint's adapters;
    the frozen base keeps what it was built with).

    Tied parameters (one tensor under two names, e.g. embed_tokens and lm_head) are loaded once.
    Raises CheckpointError listing missing, unexpected and mis-shaped tensors. Returns the count.
    """
    saved: dict[str, tuple[str, Any]] = {}
    for key, md in FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata.items():
        if key.startswith("model."):
            saved[_hf_name(key[len("model."):])] = (key[len("model."):], md)
    target = model.state_dict()
    if only_trained:
        from rlbatch.models.lora import trained_names

        trained = trained_names(model)
        target = {n: t for n, t in target.items() if n in trained}
    tied: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for name, t in target.items():
        tied.setdefault((t.data_ptr(), tuple(t.shape)), []).append(name)
    problems = [f"unexpected tensor {k} (not in the model)" for k in saved if k not in target]
    load: dict[str, torch.Tensor] = {}
    for names in tied.values():
        present = [n for n in names if n in saved]
        if not present:
            problems.append(f"missing tensor {' = '.join(names)}")
            continue
        orig, md = saved[present[0]]
        t = target[present[0]]
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(t.shape):
            problems.append(f"{present[0]}: saved shape {getattr(md, 'size', '?')}, model shape {tuple(t.shape)}")
            continue
        load[orig] = t
    if problems:
        raise CheckpointError([f"{dcp_dir}: the weights do not fit the model of the run's config:", *problems])
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        dcp.load({"model": load}, checkpoint_id=str(dcp_dir), no_dist=True)
    return len(load)


def adapter_base(path: str | None, base: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path,
                 dtype: str) -> str:
    """What an adapter export names as its base model (``base_model_name_or_path``): the model
    directory the run started from, absolute; a random-initialised base has no directory, so it
    is written beside the adapters (``out/base``, before they are applied) and named."""
    if path is not None:
        return str(Path(path).resolve())
    from rlbatch.engines.model import DTYPES

    where = out / "base"
    base.save_pretrained(str(where), state_dict={k: v.to(DTYPES[dtype]) for k, v in base.state_dict().items()})
    tokenizer.save_pretrained(where)
    return str(where.resolve())


def export_hf(src: Path, out: Path, role: str = "actor_train", dtype: str = "fp32", verify: bool = True,
              lora_as: str = "merged") -> Exported:
    """Write ``role``'s weights of the checkpoint ``src`` (or a run dir's newest) to ``out``. A
    policy trained with ``model.lora``: ``lora_as`` 'merged' (a plain model, the adapters merged
    into its weights) or 'adapter' (a PEFT adapter directory, for the base model)."""
    from omegaconf import DictConfig, OmegaConf

    from rlbatch.config.parse import parse
    from rlbatch.config.schema import HEADS
    from rlbatch.engines.model import DTYPES, load_model, load_tokenizer, value_model
    from rlbatch.models import lora

    ckpt = open_checkpoint(Path(src), verify)
    d = role_dir(ckpt.path, role)
    if not (d / ".metadata").is_file():
        raise CheckpointError(f"{ckpt.path}: no {role} state in this checkpoint")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"{out}: output directory is not empty")
    path = find_config(ckpt)
    raw = OmegaConf.load(path)
    if not isinstance(raw, DictConfig) or "model" not in raw:
        raise CheckpointError(f"{path}: not an rlbatch config (no 'model' section)")
    cfg = parse(OmegaConf.to_container(raw, resolve=True)).config  # its model and seed: the run checked the rest
    tokenizer = load_tokenizer(cfg.model)
    base = load_model(cfg.model, tokenizer, cfg.seed, torch.float32)
    if HEADS.get(role) == "value":  # the critic: a token-classification model with one label
        base = value_model(base)
    adapters = role == "actor_train" and lora.enabled(cfg.model.lora)
    out.mkdir(parents=True, exist_ok=True)
    if adapters:
        # the checkpoint holds the adapters; the base is rebuilt from the model's source
        named_base = adapter_base(cfg.model.path, base, tokenizer, out, dtype) if lora_as == "adapter" else None
        peft = lora.adapt(base, cfg.model.lora)
        load_weights(d, peft, only_trained=True)
        if named_base is not None:  # PeftModel / AutoPeftModelForCausalLM.from_pretrained find their base by it
            peft.peft_config["default"].base_model_name_or_path = named_base
        model: PreTrainedModel | PeftModel = peft.merge_and_unload() if lora_as == "merged" else peft
    else:
        load_weights(d, base)
        model = base
    torch.nn.Module.to(model, DTYPES[dtype])  # the module cast as it is (no quantized weights here)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(out)
    (out / "rlbatch_export.json").write_text(json.dumps(
        {"checkpoint": str(ckpt.path.resolve()), "step": ckpt.step, "role": role, "dtype": dtype}
        | ({"lora": lora_as} if adapters else {}), indent=1))
    return Exported(ckpt, out, sorted(p for p in out.rglob("*") if p.is_file()))
