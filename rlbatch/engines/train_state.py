"""Checkpoint state of a torch module trained by a torch optimizer (FSDP2 or plain), in the
engine-neutral form of ``rlbatch.engines.base.CheckpointState``.

Tensors: ``model.<name>`` for the weights and ``optim.<name>.<key>`` (AdamW: exp_avg, exp_avg_sq,
step) for the optimizer state, by the module's parameter names (Hugging Face names for a
transformers model). Sharded parameters stay DTensor shards; DCP reshards them. Metadata: the
optimizer's param groups and the LR scheduler's state.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from rlbatch.engines.base import CheckpointState
from rlbatch.models.lora import trained_names

OPTIONS = StateDictOptions(cpu_offload=True)
"""Staged through host memory: gathering a second copy on the device can OOM (ROLL)."""


def module_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, group: Any,
                 engine: str, trained_only: bool = False) -> CheckpointState:
    """The state to save, or (on load) the tensors to read into: a fresh optimizer's state is
    initialised first (a zero-lr step, by ``get_state_dict``), so there are tensors to load into.
    ``trained_only``: only the parameters that require grad (adapters: the frozen base is rebuilt
    from its source, never saved)."""
    model_sd, optim = get_state_dict(model, optimizer, options=OPTIONS)
    optim_sd: dict[str, Any] = optim
    if trained_only:
        trained = trained_names(model)
        model_sd = {k: v for k, v in model_sd.items() if k in trained}
    tensors: dict[str, Any] = {f"model.{k}": v for k, v in model_sd.items()}
    for name, per_param in optim_sd["state"].items():
        for key, v in per_param.items():
            tensors[f"optim.{name}.{key}"] = v
    meta = {"engine": engine, "param_groups": optim_sd["param_groups"],
            "scheduler": scheduler.state_dict() if scheduler is not None else None}
    return CheckpointState(tensors, meta, group)


def load_module_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                      state: CheckpointState, trained_only: bool = False) -> None:
    model_sd = {k[len("model."):]: v for k, v in state.tensors.items() if k.startswith("model.")}
    per_param: dict[str, dict[str, Any]] = {}
    for k, v in state.tensors.items():
        if k.startswith("optim."):
            name, _, key = k[len("optim."):].rpartition(".")
            per_param.setdefault(name, {})[key] = v
    optim_sd: Any = {"state": per_param, "param_groups": state.meta["param_groups"]}
    if trained_only:  # every trained parameter present; the frozen ones stay as built
        if missing := sorted(trained_names(model) - set(model_sd)):
            raise KeyError(f"the checkpoint lacks {len(missing)} trained parameters (e.g. {missing[0]})")
    options = StateDictOptions(cpu_offload=True, strict=False) if trained_only else OPTIONS
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    if scheduler is not None and state.meta.get("scheduler") is not None:
        scheduler.load_state_dict(state.meta["scheduler"])


def param_groups_meta(optimizer: torch.optim.Optimizer, names: list[str]) -> list[dict[str, Any]]:
    """The optimizer's param groups as ``get_state_dict`` writes them (hyper-parameters, and the
    parameter names in place of the parameters), for an engine whose optimizer holds flattened or
    partitioned tensors instead of the module's parameters. One group, holding every parameter."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    if len(groups) != 1:
        raise NotImplementedError(f"checkpoint state of {len(groups)} param groups (1 is supported)")
    return [{**groups[0], "params": list(names)}]
