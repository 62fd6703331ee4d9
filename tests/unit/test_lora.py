"""``model.lora``: the trained role learns adapters only (PEFT), what leaves it is merged under the
base model's names, and the adapted model starts as the base model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from rlbatch.algos.objective import PolicyObjective
from rlbatch.config.schema import AlgoConfig, LoraConfig, ModelConfig
from rlbatch.engines.base import EngineContext
from rlbatch.engines.fsdp import FSDPArgs
from rlbatch.engines.model import load_model
from rlbatch.models import lora
from rlbatch.models.spec import spec_from_config
from rlbatch.models.tiny import build_tiny_model
from tests.unit.test_sharded_load import TOK

RANK = 4


def test_every_setting_reaches_peft() -> None:
    got = lora.peft_config(LoraConfig(rank=RANK, alpha=8.0, dropout=0.1, target_modules=["q_proj", "v_proj"]))
    assert (got.r, got.lora_alpha, got.lora_dropout, sorted(got.target_modules)) == (RANK, 8.0, 0.1, ["q_proj", "v_proj"])
    assert lora.peft_config(LoraConfig(rank=RANK)).target_modules == "all-linear"


def test_merged_weights_are_pefts_merge_under_the_base_names() -> None:
    base = build_tiny_model(spec_from_config({"arch": "qwen2", "initializer_range": 0.1}), seed=3)
    names = [n for n, _ in base.named_parameters()]
    adapted = lora.adapt(copy.deepcopy(base), LoraConfig(rank=RANK, alpha=8.0))
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all(lora.base_name(n) is None for n in trainable)  # adapters only
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if ".lora_B." in n:  # PEFT starts B at zero: give the update a value to merge
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    got = dict(lora.merged(list(adapted.named_parameters()), lora.scaling(LoraConfig(rank=RANK, alpha=8.0))))
    want = dict(copy.deepcopy(adapted).merge_and_unload().named_parameters())
    assert list(got) == names == list(want)
    for n in names:
        assert torch.equal(got[n].detach(), want[n].detach()), n
    assert lora.base_shapes([(n, p.shape) for n, p in adapted.named_parameters()]) == [
        (n, p.shape) for n, p in base.named_parameters()]


def _engine(mesh: Any, rank: int, trainable: bool = True) -> Any:
    from rlbatch.engines.fsdp.engine import FSDPEngine

    cfg = ModelConfig(lora=LoraConfig(rank=rank, alpha=2.0 * rank or 16.0))
    algo = AlgoConfig(lr=1e-2, kl_coef=0.0, mini_batches=1, epochs=1, grad_accum=1)
    return FSDPEngine(EngineContext("actor_train", FSDPArgs(), cfg, algo, TOK, torch.device("cpu"), 7, mesh, trainable))


def _export(engine: Any) -> dict[str, torch.Tensor]:
    with engine.export_weights() as stream:
        out = {n: t.clone() for unit in stream.units(None) for n, t in unit}
        assert [n for n, _ in stream.manifest] == list(out)
    return out


def test_an_fsdp_step_trains_the_adapters_only_and_syncs_merged_weights(one_rank_mesh: Any) -> None:
    """The adapted engine starts as the base model (same log-probs, same exported weights); a step
    changes the adapters and leaves every base weight bitwise; the export is the merge."""
    engine, plain = _engine(one_rank_mesh, RANK), _engine(one_rank_mesh, 0)
    sample = {"prompt": torch.tensor([1, 5, 15, 6, 17]), "response": torch.tensor([9, 2, 11]),
              "advantage": torch.tensor(1.0)}
    assert torch.equal(engine.logprobs([sample])[0], plain.logprobs([sample])[0])
    start = _export(engine)
    whole = load_model(ModelConfig(), TOK, 7)
    assert list(start) == [n for n, _ in whole.named_parameters()]
    for n, p in whole.named_parameters():
        assert torch.equal(start[n], p.detach()), n
    before = {n: p.full_tensor().clone() for n, p in engine.model.named_parameters()}
    engine.train([sample, sample | {"advantage": torch.tensor(-0.5)}], PolicyObjective(engine.algo))
    after = {n: p.full_tensor() for n, p in engine.model.named_parameters()}
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(".lora_" in n for n in changed), changed
    assert any(".lora_B." in n for n in changed)
    assert len(engine.optimizer.state) == sum(p.requires_grad for p in engine.model.parameters())
    synced = _export(engine)
    assert any(not torch.equal(synced[n], start[n]) for n in synced)
    want = dict(lora.merged(after.items(), lora.scaling(engine.lora)))
    for n, t in synced.items():
        assert torch.equal(t, want[n]), n
    assert not torch.equal(engine.logprobs([sample])[0], plain.logprobs([sample])[0])


@pytest.mark.parametrize("trainable", [False])
def test_a_forward_only_role_never_gets_adapters(one_rank_mesh: Any, trainable: bool) -> None:
    """The reference (and any forward-only role) is the base model: model.lora is the trained role's."""
    ref = _engine(one_rank_mesh, RANK, trainable=trainable)
    assert ref.lora is None and not any(".lora_" in n for n, _ in ref.model.named_parameters())


def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state_only(one_rank_mesh: Any) -> None:
    """No base weight is saved; a fresh engine given the state trains on exactly as the saved one."""
    from rlbatch.engines.base import CheckpointState

    a, b = _engine(one_rank_mesh, RANK), _engine(one_rank_mesh, RANK)
    sample = {"prompt": torch.tensor([1, 5, 15, 6, 17]), "response": torch.tensor([9, 2, 11]),
              "advantage": torch.tensor(1.0)}
    batch = [sample, sample | {"advantage": torch.tensor(-0.5)}]
    a.train(batch, PolicyObjective(a.algo))
    state = a.checkpoint_state()
    model_keys = [k for k in state.tensors if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys
    assert len(model_keys) == sum(p.requires_grad for p in a.model.parameters())
    copied = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() if isinstance(v, torch.Tensor) else v
              for k, v in state.tensors.items()}
    template = b.checkpoint_state()
    assert sorted(template.tensors) == sorted(copied)
    b.load_checkpoint_state(CheckpointState({k: _like(template.tensors[k], v) for k, v in copied.items()},
                                            copy.deepcopy(state.meta), state.group))
    for ea in (a, b):
        ea.train(batch, PolicyObjective(ea.algo))
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(p.full_tensor(), q.full_tensor()), n


def _like(template: Any, value: torch.Tensor) -> Any:
    """``value`` in the form the engine's state holds (a DTensor shard like ``template``'s)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(template, DTensor):
        return distribute_tensor(value, template.device_mesh, template.placements)
    return value


def test_lora_settings_are_checked_before_start(cfg: dict[str, Any]) -> None:
    from rlbatch.checks.validate import check
    from tests.unit.configs import problems, set_

    check(set_(cfg, model__lora__rank=8))
    check(set_(cfg, model__lora__rank=8, model__lora__target_modules=["q_proj", "v_proj"]))
    check(set_(cfg, model__lora__target_modules=["nothing"]))  # rank 0: adapters off, nothing to check
    assert any("model.lora.rank: must be >= 0" in p for p in problems(set_(cfg, model__lora__rank=-1)))
    assert any("model.lora.alpha: must be > 0" in p for p in problems(set_(cfg, model__lora__rank=8, model__lora__alpha=0.0)))
    found = problems(set_(cfg, model__lora__rank=8, model__lora__target_modules=["q_proj", "qkv"]))
    assert any("model.lora.target_modules: ['qkv'] name no linear layer of the model" in p and "'q_proj'" in p
               for p in found), found
    check(set_(cfg, model__lora__rank=8, roles__actor_train__backend="deepspeed:d2"))
    found = problems(set_(cfg, model__lora__rank=8, roles__actor_train__backend="megatron:d2"))
    assert any("model.lora.rank: 8: the megatron engine of roles.actor_train does not train adapters in this build "
               "(fsdp, deepspeed do)" in p for p in found), found
    assert any("unknown field(s) ['r']" in p for p in problems(set_(cfg, model__lora__r=8)))


def test_a_target_whose_weight_is_shared_is_refused(cfg: dict[str, Any]) -> None:
    """An LM head tied to the input embedding: its merged adapter would reach the inference engine as
    another model than the trainer's (the engine reads the tied weight from the embedding). Refused
    before start; untied, the head is an ordinary target."""
    from rlbatch.checks.validate import check
    from tests.unit.configs import problems, set_

    assert problems(set_(cfg, model__lora__rank=8, model__lora__target_modules=["q_proj", "lm_head"])) == [
        "model.lora.target_modules: ['lm_head'] share their weight with another module (lm_head: lm_head.weight is "
        "model.embed_tokens.weight): an adapter merged into a shared weight reaches the inference engine as a "
        "different model than the trainer's; target other modules, set model.tie_word_embeddings=false"]
    check(set_(cfg, model__lora__rank=8, model__lora__target_modules=["q_proj", "lm_head"],
               model__tie_word_embeddings=False))
    check(set_(cfg, model__lora__rank=8))  # all-linear leaves the output layer out (PEFT)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen2_moe"])
@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj"], ["down_proj"]])
def test_the_planners_adapter_count_is_pefts(arch: str, targets: list[str]) -> None:
    from rlbatch.models.shape import ModelShape

    spec = spec_from_config({"arch": arch})
    adapted = lora.adapt(build_tiny_model(spec, seed=0), LoraConfig(rank=RANK, target_modules=targets))
    assert ModelShape.of(spec).adapter_params(RANK, tuple(targets)) == sum(
        p.numel() for p in adapted.parameters() if p.requires_grad)


def test_the_base_models_log_probs_come_from_the_adapted_engine_with_adapters_off(one_rank_mesh: Any) -> None:
    """After training moved the adapters, ``base_logprobs`` is the base model's (a reference's), and
    the adapters are back on afterwards. It runs first, as a step's reference phase does: FSDP2's
    first gather of the weights happens with the adapters off, and they still train after it."""
    engine, plain = _engine(one_rank_mesh, RANK), _engine(one_rank_mesh, 0)
    sample = {"prompt": torch.tensor([1, 5, 15, 6, 17]), "response": torch.tensor([9, 2, 11]),
              "advantage": torch.tensor(1.0)}
    assert torch.equal(engine.base_logprobs([sample])[0], plain.logprobs([sample])[0])
    for _ in range(2):  # two steps: B moves in the first, then B A is non-zero
        engine.train([sample, sample | {"advantage": torch.tensor(-0.5)}], PolicyObjective(engine.algo))
    adapted = engine.logprobs([sample])[0]
    assert not torch.equal(adapted, plain.logprobs([sample])[0])
    assert torch.equal(engine.base_logprobs([sample])[0], plain.logprobs([sample])[0])
    assert torch.equal(engine.logprobs([sample])[0], adapted)


def test_with_adapters_the_reference_is_the_policys_base_and_no_role_of_its_own(cfg: dict[str, Any]) -> None:
    """``model.lora``: a reference role on actor_train's GPUs (the default's) is not placed; a
    reference with GPUs of its own is refused (they would idle); a KL without any reference role is
    valid; the step takes the reference's log-probs on actor_train, from its base."""
    from rlbatch.checks.validate import check
    from rlbatch.phases import PHASES, step_phases
    from tests.unit.configs import problems, set_

    assert "reference" in check(cfg).roles
    assert sorted(check(set_(cfg, model__lora__rank=8)).roles) == ["actor_infer", "actor_train", "reward"]
    check(set_(cfg, model__lora__rank=8, roles__reference__enabled=False))
    assert any("roles.reference: algo.kl_coef=0.01 needs the reference role" in p
               for p in problems(set_(cfg, roles__reference__enabled=False)))
    own = set_(cfg, model__lora__rank=8, roles__reference__device_mapping=[2, 3])
    assert any(p.startswith("roles.reference.device_mapping: GPU ranks 2..3 are the reference's alone")
               and "roles.reference.enabled=false" in p for p in problems(own))

    kw = {"kl_to_reference": True, "has_reference": False, "critic": False, "reuse_batch": False, "kl_in_reward": False}
    names = step_phases(**kw, base_reference=True)
    assert "base_logprobs" in names and "ref_logprobs" not in names
    assert "base_logprobs" not in step_phases(**kw | {"has_reference": True})
    spec = PHASES["base_logprobs"]
    assert (spec.role, spec.op, spec.writes) == ("actor_train", "base_logprobs", ("ref_logprobs",))
