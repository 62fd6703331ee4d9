"""What the inference engines that run inside a rank's process share (vLLM, SGLang): the caller's
random streams kept across an engine's start, the names a trainer exports, a worker's
tensor-parallel peers; the weight and state side of an engine with no model (``NoModelInference``)."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from rlbatch.engines.offload import Transfer

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PreTrainedModel

    from rlbatch.config.schema import ModelConfig


@contextmanager
def rng_kept() -> Iterator[None]:
    """vLLM reseeds Python's, NumPy's and torch's RNGs when it starts: keep the caller's streams."""
    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(py)
    np.random.set_state(npy)


def hf_parameter_names(model_cfg: ModelConfig) -> set[str]:
    """The names a trainer exports (its transformers model's ``named_parameters``), for a model
    directory, without allocating it."""
    return {n for n, _ in meta_model(model_cfg).named_parameters()}


def meta_model(model_cfg: ModelConfig) -> PreTrainedModel:
    """A model directory's transformers model on the meta device (no memory): a causal LM, or for a
    vision-language model (Qwen2-VL's model_type, which ``AutoModelForCausalLM`` refuses) the
    image-text-to-text one, as the engines load it."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from rlbatch.models.spec import vlm_arch

    assert model_cfg.path, "a model directory (model.path)"
    auto = AutoModelForImageTextToText if vlm_arch(model_cfg) is not None else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(AutoConfig.from_pretrained(model_cfg.path))


def tp_peers(mesh: DeviceMesh | None) -> tuple[tuple[int, ...], int]:
    """World ranks of this worker's tensor-parallel peers (the role mesh's ``tp`` axis through this
    rank) and this rank's index among them; ``((rank,), 0)`` without a tp axis."""
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return (mesh.get_rank() if mesh is not None else 0,), 0
    sub = mesh["tp"]
    return tuple(int(r) for r in sub.mesh.flatten().tolist()), int(sub.get_local_rank())


class NoModelInference:
    """The inference contract's weight and state side with no model behind it: a sync's tensors are
    counted (``loaded_bytes``) and dropped, nothing is held on a device. Engines that only make up
    responses (``SleepInferenceEngine``, the tests' echo engine) add ``generate``."""

    state_kinds: tuple[str, ...] = ()
    loaded_bytes: int = 0

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        self.loaded_bytes += nbytes
        return nbytes

    def weight_views(self, names: list[str], dtype: torch.dtype) -> torch.Tensor | None:
        return None

    def offload(self, kinds: Iterable[str]) -> Transfer:
        return Transfer()

    def reload(self, kinds: Iterable[str]) -> Transfer:
        return Transfer()
