"""The deepspeed engine with a vision-language policy, on real DeepSpeed in a one-rank gloo world:
it scores image prompts as the fsdp and hf engines do, trains with images leaving a frozen vision
tower alone (no gradient, no optimizer state), syncs the tower to hf, keeps it through offload, and
resumes from its checkpoint bit for bit."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from rlbatch.algos.objective import PolicyObjective
from rlbatch.config.schema import AlgoConfig
from rlbatch.engines.base import EngineContext
from rlbatch.engines.model import load_tokenizer
from tests.unit.test_vlm_engines import _cfg, _fsdp, _generated, _hf, _prompts, one_thread  # noqa: F401  (autouse)

TOWER = "model.visual."


@pytest.fixture
def ds_mesh(one_rank_mesh: Any) -> Any:
    """The one-rank world's mesh with the axes the deepspeed engine reads (dp, and tp for its mpu)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(1).reshape(1, 1), mesh_dim_names=("dp", "tp"))


def _ds(mesh: Any, stage: int, train_vision: bool = False, max_tokens: int = 4096, **kw: Any) -> Any:
    from rlbatch.engines.deepspeed import DeepSpeedArgs
    from rlbatch.engines.deepspeed.engine import DeepSpeedEngine

    cfg = _cfg(train_vision)
    algo = AlgoConfig(lr=1e-2, kl_coef=0.0, mini_batches=1, epochs=1, grad_accum=1)
    args = DeepSpeedArgs(zero_stage=stage, max_tokens_per_micro_batch=max_tokens, **kw)
    return DeepSpeedEngine(EngineContext("actor_train", args, cfg, algo, load_tokenizer(cfg), torch.device("cpu"), 7,
                                         mesh, True))


def _weights(engine: Any) -> dict[str, torch.Tensor]:
    with engine.export_weights() as stream:
        return {n: t.clone() for unit in stream.units(None) for n, t in unit}


def _advantaged(samples: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    return [s | {"advantage": torch.tensor((1.0, -1.0, 0.5, -0.5)[i % 4])} for i, s in enumerate(samples)]


@pytest.mark.parametrize("stage", [2, pytest.param(1, marks=pytest.mark.full), pytest.param(3, marks=pytest.mark.full)])
def test_deepspeed_scores_images_as_fsdp_trains_without_the_frozen_tower_and_syncs_it_to_hf(
        ds_mesh: Any, one_rank_mesh: Any, stage: int) -> None:
    from deepspeed.utils import safe_get_full_optimizer_state

    hf = _hf()
    samples = _generated(hf, _prompts(), 2)
    engine, fsdp = _ds(ds_mesh, stage), _fsdp(one_rank_mesh, 4096)
    got, want = engine.logprobs(samples), fsdp.logprobs(samples)
    for s, a, b in zip(samples, got, want, strict=True):
        assert (a - b).abs().max() <= 1e-6, (a, b)
        assert (a - s["behaviour"]).abs().max() <= 1e-5, (a, s["behaviour"])
    # a sampled image token in a response is text there, packed or padded
    image_token = engine.vision.image_token_id
    texty = [p | {"response": torch.tensor([5, image_token, 7])} for p in _prompts()]
    padded = _ds(ds_mesh, stage, max_tokens=0)
    for a, b in zip(engine.logprobs(texty), padded.logprobs(texty), strict=True):
        assert a.shape == (3,) and (a - b).abs().max() <= 1e-6, (a, b)
    swapped = samples[0] | {k: samples[2][k] for k in ("pixel_values", "image_grid_thw")}
    assert not torch.allclose(engine.logprobs([swapped])[0], got[0], atol=1e-4)  # the image reaches the forward

    before = _weights(engine)
    tower = {n for n in before if n.startswith(TOWER)}
    assert tower and set(before) == {n for n, _ in hf.model.named_parameters()}
    engine.train(_advantaged(samples), PolicyObjective(engine.algo))
    after = _weights(engine)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and not changed & tower, sorted(changed & tower)[:3]
    params = dict(zip(engine.names, engine.params, strict=True))
    for n, p in params.items():  # no optimizer state (nor fp32 master) for the frozen tower, the rest has it
        has_state = safe_get_full_optimizer_state(p, "exp_avg") is not None
        assert has_state != n.startswith(TOWER), n
    # the sync carries every weight, the tower included; hf then scores as the trainer does
    hf.load_weights(after.items())
    for n, p in hf.model.named_parameters():
        assert torch.equal(p, after[n]), n
    regenerated = _generated(hf, _prompts(), 1)
    for s, a in zip(regenerated, engine.logprobs(regenerated), strict=True):
        assert (a - s["behaviour"]).abs().max() <= 1e-5, (a, s["behaviour"])


@pytest.mark.full
def test_a_trained_tower_under_deepspeed_changes_and_has_optimizer_state(ds_mesh: Any) -> None:
    engine = _ds(ds_mesh, 2, train_vision=True)
    samples = _advantaged(_generated(_hf(), _prompts(), 1))
    before = _weights(engine)
    engine.train(samples, PolicyObjective(engine.algo))
    after = _weights(engine)
    assert any(not torch.equal(before[n], after[n]) for n in before if n.startswith(TOWER))
    assert not engine.frozen_keys


@pytest.mark.parametrize("stage", [3, pytest.param(2, marks=pytest.mark.full)])
def test_deepspeed_with_a_frozen_tower_offloads_keeps_it_and_resumes_bitwise(ds_mesh: Any, stage: int) -> None:
    samples = _advantaged(_generated(_hf(), _prompts(), 1))
    saved, resumed = _ds(ds_mesh, stage), _ds(ds_mesh, stage)
    saved.train(samples, PolicyObjective(saved.algo))
    weights, scores = _weights(saved), saved.logprobs(samples)
    tower = [n for n in weights if n.startswith(TOWER)]
    tower_bytes = sum(weights[n].numel() * 4 for n in tower)
    assert saved.offload(["params", "optimizer"]).bytes > tower_bytes
    saved.reload(["params", "optimizer"])
    after = _weights(saved)
    assert all(torch.equal(after[n], weights[n]) for n in weights)
    assert all(torch.equal(a, b) for a, b in zip(saved.logprobs(samples), scores, strict=True))

    state = saved.checkpoint_state()
    assert {f"model.{n}" for n in tower} <= set(state.tensors)  # the frozen tower's weights, as fsdp's checkpoint
    assert not any(k.startswith(f"optim.{TOWER}") for k in state.tensors)  # and no optimizer state for it
    # a copy, as a checkpoint read from disk is
    resumed.load_checkpoint_state(dataclasses.replace(state, tensors={k: v.clone() for k, v in state.tensors.items()}))
    for e in (saved, resumed):
        e.train(samples, PolicyObjective(e.algo))
    a, b = _weights(saved), _weights(resumed)
    for n in a:
        assert torch.equal(a[n], b[n]), n


@pytest.mark.full
def test_deepspeed_and_fsdp_share_checkpoints_with_a_frozen_tower(ds_mesh: Any, one_rank_mesh: Any,
                                                                   tmp_path: Any) -> None:
    """Through DCP, as a run writes and reads them: each engine loads the other's checkpoint (the
    frozen tower's weights included) into the weights the other holds."""
    from rlbatch.checkpoint.dcp import load_state, save_state

    samples = _advantaged(_generated(_hf(), _prompts(), 1))
    ds, fsdp = _ds(ds_mesh, 3), _fsdp(one_rank_mesh, 4096)
    for e in (ds, fsdp):
        e.train(samples, PolicyObjective(e.algo))
    save_state(tmp_path / "ds", ds.checkpoint_state())
    save_state(tmp_path / "fsdp", fsdp.checkpoint_state())
    for saved, path, fresh in ((ds, "ds", _fsdp(one_rank_mesh, 4096)), (fsdp, "fsdp", _ds(ds_mesh, 3))):
        fresh.load_checkpoint_state(load_state(tmp_path / path, fresh.checkpoint_state()))
        want, got = _weights(saved), _weights(fresh)
        assert any(n.startswith(TOWER) for n in want) and set(want) == set(got)
        for n in want:
            assert torch.equal(want[n], got[n]), (path, n)
