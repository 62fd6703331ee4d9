"""Checkpoint state of a torch module trained by a torch optimizer (FSDP2 or plain), in the
engine-neutral form of ``rlbatch.engines.base.CheckpointState``.

Tensors: ``model.<name>`` for the weights and ``optim.<name>.<key>`` (AdamW: exp_avg, exp_avg_sq,
step) for the optimizer state, by the module's parameter names (Hugging Face names for a
transformers model). Sharded parameters stay DTensor shards; DCP reshards them. Metadata: the
optimizer's param groups and the LR scheduler's state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint.state_dict import (
    OptimizerStateType,
    StateDictOptions,
    ValueType,
    get_state_dict,
    set_state_dict,
)
from torch.optim.lr_scheduler import LRScheduler

from rlbatch.engines.base import CheckpointState
from rlbatch.models.lora import trained_names

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

OPTIONS = StateDictOptions(cpu_offload=True)
"""Staged through host memory: gathering a second copy on the device can OOM (ROLL)."""


def _tensor(name: str, value: ValueType) -> torch.Tensor:
    """A state dict's value, which for the modules and the optimizers trained here is a tensor."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"checkpoint state: {name} is a {type(value).__name__}, not a tensor")
    return value


def module_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: LRScheduler | None,
                 group: ProcessGroup | None,
                 engine: str, trained_only: bool = False) -> CheckpointState:
    """The state to save, or (on load) the tensors to read into: a fresh optimizer's state is
    initialised first (a zero-lr step, by ``get_state_dict``), so there are tensors to load into.
    ``trained_only``: only the parameters that require grad (adapters: the frozen base is rebuilt
    from its source, never saved)."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
    if trained_only:
        trained = trained_names(model)
        model_sd = {k: v for k, v in model_sd.items() if k in trained}
    tensors = {f"model.{k}": _tensor(k, v) for k, v in model_sd.items()}
    state = optim_sd["state"]
    assert isinstance(state, dict)
    for name, per_param in state.items():
        assert isinstance(per_param, dict)
        for key, v in per_param.items():
            tensors[f"optim.{name}.{key}"] = _tensor(f"{name}.{key}", v)
    meta = {"engine": engine, "param_groups": optim_sd["param_groups"],
            "scheduler": scheduler.state_dict() if scheduler is not None else None}
    return CheckpointState(tensors, meta, group)


def load_module_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: LRScheduler | None,
                      state: CheckpointState, trained_only: bool = False) -> None:
    model_sd: dict[str, ValueType] = {k[len("model."):]: v for k, v in state.tensors.items() if k.startswith("model.")}
    per_param: dict[str, dict[str, ValueType]] = {}
    for k, v in state.tensors.items():
        if k.startswith("optim."):
            name, _, key = k[len("optim."):].rpartition(".")
            per_param.setdefault(name, {})[key] = v
    optim_sd: OptimizerStateType = {"state": {name: d for name, d in per_param.items()},
                                    "param_groups": state.meta["param_groups"]}
    if trained_only:  # every trained parameter present; the frozen ones stay as built
        if missing := sorted(trained_names(model) - set(model_sd)):
            raise KeyError(f"the checkpoint lacks {len(missing)} trained parameters (e.g. {missing[0]})")
    options = StateDictOptions(cpu_offload=True, strict=False) if trained_only else OPTIONS
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    if scheduler is not None and state.meta.get("scheduler") is not None:
        scheduler.load_state_dict(state.meta["scheduler"])


def param_groups_meta(optimizer: torch.optim.Optimizer, names: list[str]) -> list[dict[str, object]]:
    """The optimizer's param groups as ``get_state_dict`` writes them (hyper-parameters, and the
    parameter names in place of the parameters), for an engine whose optimizer holds flattened or
    partitioned tensors instead of the module's parameters. One group, holding every parameter."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    if len(groups) != 1:
        raise NotImplementedError(f"checkpoint state of {len(groups)} param groups (1 is supported)")
    return [{**groups[0], "params": list(names)}]
