"""Placement search: candidates respect node boundaries, misfits are dropped, winners paste back."""

from __future__ import annotations

import re
import shlex

import pytest
from conftest import MODELS, make_config, roles, workload_of

from rlbatch.checks.validate import check
from rlbatch.config.compose import compose
from rlbatch.config.hardware import load_hardware
from rlbatch.models.shape import shape_from_config
from rlbatch.plan.coefficients import Coefficients
from rlbatch.plan.search import candidates, search, splits

ALGO = {"max_new_tokens": 1024, "prompts_per_step": 64, "grad_accum": 8}


def _cfg(**over):  # type: ignore[no-untyped-def]
    return make_config(model={"path": str(MODELS / "qwen2_5_7b")}, algo=ALGO,
                       roles=roles("fsdp:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))", micro_batch=4), **over)


def test_splits_stay_on_node_boundaries_beyond_two_nodes() -> None:
    assert splits(8, 8) == list(range(1, 8))
    assert all(s % 8 == 0 for s in splits(64, 8))
    assert len(splits(1024, 8)) < 40  # a ladder, not 127 splits


def test_candidates_keep_tp_groups_inside_a_node() -> None:
    cfg = _cfg()
    shape = shape_from_config(cfg["model"])
    cands = list(candidates(cfg, 16, 8, shape, workload_of(cfg, 512)))
    assert {c.mode for c in cands} == {"colocated", "disaggregated"}
    for c in cands:
        for r in c.layout.gpu_roles():
            assert r.backend is not None and 8 % r.backend.t == 0
            assert r.ranks[0] % r.backend.t == 0  # every TP group starts on a multiple of t


def test_search_ranks_fitting_placements_and_prints_pasteable_overrides() -> None:
    cfg = _cfg()
    hw = load_hardware("h100_sxm")
    shape = shape_from_config(cfg["model"])
    best, stats = search(cfg, 8, 8, shape, workload_of(cfg, 512), hw, Coefficients(), "auto", top=3)
    assert stats["candidates"] == stats["fit"] + stats["oom"] and stats["oom"] > 0
    assert len(best) == 3
    steps = [c.prediction.step_s for c in best if c.prediction]
    assert steps == sorted(steps)
    for c in best:
        assert c.prediction is not None and c.prediction.fits
        args = shlex.split(" ".join(c.overrides))  # what a shell hands to python -m rlbatch.launch
        # vllm is not built here: the launcher would refuse these; the placement is what is checked
        placement = check(compose([f"model.path={MODELS / 'qwen2_5_7b'}", *args]), runnable=False)
        for name, r in c.layout.roles.items():
            if r.is_gpu:
                assert placement.roles[name].gpu_ranks == tuple(r.ranks)
                assert str(placement.roles[name].backend) == str(r.backend)
                assert placement.roles[name].offload == r.offload


def test_nothing_fits_on_a_tiny_gpu() -> None:
    cfg = _cfg()
    hw = load_hardware("h100_sxm", {"hbm_bytes": 8e9})
    best, stats = search(cfg, 8, 8, shape_from_config(cfg["model"]), workload_of(cfg, 512), hw,
                         Coefficients(), "auto")
    assert best == [] and stats["fit"] == 0


@pytest.mark.parametrize("engine", ["megatron", "deepspeed"])
def test_other_training_engines_get_their_own_dims(engine: str) -> None:
    spec = "megatron:d8" if engine == "megatron" else "deepspeed:d8"
    cfg = make_config(model={"path": str(MODELS / "qwen2_5_7b")}, algo=ALGO,
                      roles=roles(spec, "vllm:d8", "list(range(0,8))", "list(range(0,8))"))
    specs = {str(c.layout.roles["actor_train"].backend)
             for c in candidates(cfg, 8, 8, shape_from_config(cfg["model"]), workload_of(cfg, 512))}
    assert all(s.startswith(engine) for s in specs)
    if engine == "megatron":
        assert any("p" in s.split(":")[1] for s in specs)
    else:
        assert all(re.fullmatch(r"deepspeed:d\d+", s) for s in specs)  # ZeRO has only data parallelism


def test_megatron_expert_parallelism_is_proposed_only_as_the_engine_splits_experts_over_dp() -> None:
    cfg = make_config(model={"path": str(MODELS / "qwen1_5_moe_a2_7b")}, algo=ALGO,
                      roles=roles("megatron:d8", "vllm:d8", "list(range(0,8))", "list(range(0,8))"))
    specs = {str(c.layout.roles["actor_train"].backend)
             for c in candidates(cfg, 8, 8, shape_from_config(cfg["model"]), workload_of(cfg, 512))}
    with_e = [s for s in specs if "e" in s.split(":")[1]]
    assert with_e, specs
    for s in with_e:
        dims = dict((k, int(v)) for k, v in re.findall(r"([dpte])(\d+)", s.split(":")[1]))
        assert dims.get("d", 1) % dims["e"] == 0 and 60 % dims["e"] == 0, s  # e divides d and the 60 experts
        assert dims.get("t", 1) == 1, s  # and comes without tensor parallelism
