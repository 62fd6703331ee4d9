"""The HF <-> megatron-core weight mapping (pure tensors, no megatron-core needed)."""

from __future__ import annotations

import pytest
import torch

from rlbatch.engines.megatron import convert
from rlbatch.engines.megatron.convert import Layout


def hf_weights(lay: Layout, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    H, d = lay.hidden, lay.head_dim

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    w = {"model.embed_tokens.weight": r(lay.vocab, H), "model.norm.weight": r(H)}
    if lay.head != "lm":
        w["score.weight"] = r(1, H)
        if lay.head_bias:
            w["score.bias"] = r(1)
    elif not lay.tied:
        w["lm_head.weight"] = r(lay.vocab, H)
    for i in range(lay.layers):
        a = f"model.layers.{i}.self_attn."
        w |= {a + "q_proj.weight": r(lay.heads * d, H), a + "k_proj.weight": r(lay.groups * d, H),
              a + "v_proj.weight": r(lay.groups * d, H), a + "o_proj.weight": r(H, lay.heads * d)}
        if lay.qkv_bias:
            w |= {a + "q_proj.bias": r(lay.heads * d), a + "k_proj.bias": r(lay.groups * d),
                  a + "v_proj.bias": r(lay.groups * d)}
        m = f"model.layers.{i}."
        w |= {m + "input_layernorm.weight": r(H), m + "post_attention_layernorm.weight": r(H)}
        if lay.experts:  # transformers' Qwen2-MoE: stacked experts, a gated shared expert
            f, sh = lay.moe_ffn, lay.shared_ffn
            w |= {m + "mlp.gate.weight": r(lay.experts, H), m + "mlp.experts.gate_up_proj": r(lay.experts, 2 * f, H),
                  m + "mlp.experts.down_proj": r(lay.experts, H, f), m + "mlp.shared_expert.gate_proj.weight": r(sh, H),
                  m + "mlp.shared_expert.up_proj.weight": r(sh, H), m + "mlp.shared_expert.down_proj.weight": r(H, sh),
                  m + "mlp.shared_expert_gate.weight": r(1, H)}
        else:
            w |= {m + "mlp.gate_proj.weight": r(lay.ffn, H), m + "mlp.up_proj.weight": r(lay.ffn, H),
                  m + "mlp.down_proj.weight": r(H, lay.ffn)}
    return w


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(("tied", "bias"), [(True, True), (False, False)])  # Qwen2-like, Llama-like
def test_hf_to_megatron_to_hf_is_exact_for_every_tp(tp: int, tied: bool, bias: bool) -> None:
    lay = Layout(layers=2, hidden=8, heads=8, groups=4, head_dim=2, ffn=12, vocab=18, tied=tied, qkv_bias=bias, tp=tp)
    hf = hf_weights(lay)
    per_rank = [convert.to_megatron(hf, lay, r) for r in range(tp)]
    shards = {name: [p[name] for p in per_rank] for name in per_rank[0]}
    back = convert.to_hf(shards, lay)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)
    # the vocabulary is padded to a multiple of tp with zero rows, split evenly
    emb = shards["embedding.word_embeddings.weight"]
    assert [e.shape[0] for e in emb] == [lay.padded_vocab // tp] * tp
    assert lay.padded_vocab % tp == 0 and torch.count_nonzero(torch.cat(emb)[lay.vocab:]) == 0


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 2), (1, 4), (2, 3)])
@pytest.mark.parametrize(("tied", "head"), [(True, "lm"), (False, "lm"), (False, "value")])
def test_pipeline_stages_hold_contiguous_layers_and_together_give_back_every_weight(tp: int, pp: int, tied: bool,
                                                                                    head: str) -> None:
    lay = Layout(layers=12, hidden=8, heads=4, groups=2, head_dim=2, ffn=4, vocab=9, tied=tied, qkv_bias=True, tp=tp,
                 pp=pp, head=head, head_bias=head == "value")
    hf = hf_weights(lay)
    back: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        per_rank = [convert.to_megatron(hf, lay, r, stage) for r in range(tp)]
        local = per_rank[0]
        # layers numbered from 0 on every stage; the embedding first, the norm and the head last
        assert {int(n.split(".")[2]) for n in local if n.startswith("decoder.layers.")} == set(range(12 // pp))
        assert ("embedding.word_embeddings.weight" in local) is (stage == 0)
        assert ("decoder.final_layernorm.weight" in local) is (stage == pp - 1)
        assert ("output_layer.weight" in local) is (stage == pp - 1)
        if tied and stage == pp - 1:  # the last stage's copy of the tied embedding
            assert torch.equal(torch.cat([p["output_layer.weight"] for p in per_rank])[: lay.vocab],
                               hf["model.embed_tokens.weight"])
        part = convert.to_hf({name: [p[name] for p in per_rank] for name in local}, lay, stage)
        assert {lay.stage_of(n) for n in part} == {stage}
        assert not part.keys() & back.keys()
        back |= part
    first_layer_of_last_stage = f"model.layers.{(pp - 1) * 12 // pp}.mlp.down_proj.weight"
    assert lay.stage_of(first_layer_of_last_stage) == pp - 1
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_layers_not_divisible_by_the_stages_are_a_problem_with_the_numbers() -> None:
    lay = Layout(layers=5, hidden=8, heads=4, groups=2, head_dim=2, ffn=4, vocab=9, tied=True, qkv_bias=True, pp=2)
    assert convert.problems(lay) == ["num_hidden_layers = 5 is not divisible by pipeline parallel p = 2"]


@pytest.mark.parametrize(("head", "bias"), [("value", True), ("reward", False)])
def test_a_scalar_head_replaces_the_output_layer_whole_on_every_tp_rank(head: str, bias: bool) -> None:
    lay = Layout(layers=1, hidden=8, heads=4, groups=2, head_dim=2, ffn=4, vocab=9, tied=False, qkv_bias=True, tp=2,
                 head=head, head_bias=bias)
    hf = hf_weights(lay)
    per_rank = [convert.to_megatron(hf, lay, r) for r in range(2)]
    for local in per_rank:  # the [1, hidden] head is not split: every rank computes the same values
        assert torch.equal(local["output_layer.weight"], hf["score.weight"])
        assert ("output_layer.bias" in local) is bias and (not bias or torch.equal(local["output_layer.bias"],
                                                                                  hf["score.bias"]))
    back = convert.to_hf({name: [p[name] for p in per_rank] for name in per_rank[0]}, lay)
    assert back.keys() == hf.keys() and "lm_head.weight" not in back
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_qkv_is_interleaved_per_query_group_and_groups_split_contiguously_over_tp() -> None:
    # 4 query heads in 2 groups, head_dim 1, hidden 1: q rows 0..3, k rows 10, 11, v rows 20, 21
    lay = Layout(layers=1, hidden=1, heads=4, groups=2, head_dim=1, ffn=2, vocab=2, tied=True, qkv_bias=False, tp=1)
    hf = hf_weights(lay)
    a = "model.layers.0.self_attn."
    hf[a + "q_proj.weight"] = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    hf[a + "k_proj.weight"] = torch.tensor([[10.0], [11.0]])
    hf[a + "v_proj.weight"] = torch.tensor([[20.0], [21.0]])
    qkv = convert.to_megatron(hf, lay, 0)["decoder.layers.0.self_attention.linear_qkv.weight"].flatten().tolist()
    assert qkv == [0, 1, 10, 20, 2, 3, 11, 21]
    lay2 = Layout(**{**lay.__dict__, "tp": 2})
    ranks = [convert.to_megatron(hf, lay2, r)["decoder.layers.0.self_attention.linear_qkv.weight"].flatten().tolist()
             for r in range(2)]
    assert ranks == [[0, 1, 10, 20], [2, 3, 11, 21]]
    # fc1 per rank: [gate shard; up shard]
    hf["model.layers.0.mlp.gate_proj.weight"] = torch.tensor([[1.0], [2.0]])
    hf["model.layers.0.mlp.up_proj.weight"] = torch.tensor([[5.0], [6.0]])
    fc1 = [convert.to_megatron(hf, lay2, r)["decoder.layers.0.mlp.linear_fc1.weight"].flatten().tolist() for r in range(2)]
    assert fc1 == [[1, 5], [2, 6]]


def test_what_tp_cannot_split_is_named_with_the_numbers() -> None:
    lay = Layout(layers=1, hidden=8, heads=6, groups=3, head_dim=2, ffn=10, vocab=7, tied=True, qkv_bias=True, tp=4)
    assert convert.problems(lay) == [
        "num_key_value_heads = 3 is not divisible by tensor parallel t = 4",
        "num_attention_heads = 6 is not divisible by tensor parallel t = 4",
        "intermediate_size = 10 is not divisible by tensor parallel t = 4"]


def moe_layout(**kw: int) -> Layout:
    base = dict(layers=4, hidden=8, heads=4, groups=2, head_dim=2, ffn=16, vocab=9, tied=True, qkv_bias=True,
                experts=4, moe_ffn=6, shared_ffn=10, sparse_layers=(0, 1, 2, 3))
    return Layout(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(("ep", "pp"), [(1, 1), (2, 1), (4, 1), (2, 2)])
def test_mixture_of_experts_layers_split_their_experts_over_ep_and_give_back_every_weight(ep: int, pp: int) -> None:
    lay = moe_layout(ep=ep, pp=pp)
    hf = hf_weights(lay)
    back: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        per_rank = [convert.to_megatron(hf, lay, 0, stage, ep_rank=r) for r in range(ep)]
        shards: dict[str, list[torch.Tensor]] = {}
        for r, local in enumerate(per_rank):
            for name, t in local.items():
                glob = convert.global_expert_name(name, lay, r)
                if glob is not None:
                    shards[glob] = [t]
                elif r == 0:
                    shards[name] = [t]
                else:  # everything but the routed experts is the same on every ep rank
                    assert torch.equal(t, shards[name][0]), name
        experts = [n for n in per_rank[0] if n.startswith("decoder.layers.0.mlp.experts.")]
        assert len(experts) == 2 * lay.experts // ep  # fc1 and fc2 of each local expert
        back |= convert.to_hf(shards, lay, stage)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    # expert 3 is ep rank (3 // (4 / ep))'s local expert 3 % (4 / ep): gate rows, then up rows
    local = convert.to_megatron(hf, lay, 0, 0, ep_rank=3 * ep // 4)
    fc1 = local[f"decoder.layers.0.mlp.experts.local_experts.{3 % (4 // ep)}.linear_fc1.weight"]
    assert torch.equal(fc1, hf["model.layers.0.mlp.experts.gate_up_proj"][3])


def test_what_a_mixture_of_experts_model_cannot_split_is_named_with_the_numbers() -> None:
    assert convert.problems(moe_layout(ep=2)) == []
    assert convert.problems(moe_layout(ep=3)) == ["num_experts = 4 is not divisible by expert parallel e = 3"]
    assert convert.problems(moe_layout(experts=0, ep=2)) == [
        "expert parallel e = 2 needs a Mixture-of-Experts model (num_experts), this one is dense"]
    assert convert.problems(moe_layout(tp=2)) == []  # sequence parallel; without it training is refused by the engine
    assert convert.problems(moe_layout(tp=2, ep=2)) == [
        "expert parallel e = 2 with tensor parallel t = 2 is not built; use t = 1 with e"]
    assert convert.problems(moe_layout(tp=4, heads=8, groups=4)) == [
        "moe_intermediate_size = 6 is not divisible by tensor parallel t = 4",
        "shared_expert_intermediate_size = 10 is not divisible by tensor parallel t = 4"]
    assert convert.problems(moe_layout(sparse_layers=(1, 3))) == [
        "layers [0, 2] have a dense MLP (decoder_sparse_step / mlp_only_layers); the engine converts Qwen2-MoE "
        "models whose every layer is sparse"]


@pytest.mark.parametrize(("tp", "etp", "ep"), [(2, 2, 2), (2, 1, 4), (1, 2, 2), (2, 4, 1)])
def test_a_hybrid_layout_splits_each_routed_expert_over_its_own_expert_tp_and_gives_back_every_weight(
        tp: int, etp: int, ep: int) -> None:
    """``megatron:(attn:..t<tp>|ffn:..t<etp>e<ep>)``: attention and the shared expert over tp, each
    routed expert's fc1 rows and fc2 columns over etp, the experts over ep; back to HF exactly."""
    lay = moe_layout(tp=tp, ep=ep, expert_tp=etp, moe_ffn=8)
    assert lay.etp == etp and convert.problems(lay) == []
    hf = hf_weights(lay)
    shards: dict[str, list[torch.Tensor]] = {}
    for e in range(ep):
        for k in range(etp):
            local = convert.to_megatron(hf, lay, k % tp, 0, ep_rank=e, etp_rank=k)
            for name, t in local.items():
                glob = convert.global_expert_name(name, lay, e)
                if glob is not None:
                    shards.setdefault(glob, []).append(t)
    for r in range(tp):  # the rest as tp rank r holds it, on any expert rank
        for name, t in convert.to_megatron(hf, lay, r, 0, ep_rank=0, etp_rank=0).items():
            if convert.global_expert_name(name, lay, 0) is None:
                shards.setdefault(name, []).append(t)
    fc1 = convert.to_megatron(hf, lay, 0, 0, ep_rank=0, etp_rank=0)["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    shared = convert.to_megatron(hf, lay, 0, 0, ep_rank=0, etp_rank=0)["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"]
    assert fc1.shape[0] == 2 * 8 // etp and shared.shape[0] == 2 * 10 // tp
    back = convert.to_hf(shards, lay, 0)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)


def test_a_hybrid_layout_names_what_its_ffn_section_cannot_split() -> None:
    assert convert.problems(moe_layout(tp=2, ep=2, expert_tp=4)) == [
        "moe_intermediate_size = 6 is not divisible by expert tensor parallel t = 4"]
    assert convert.problems(moe_layout(experts=0, expert_tp=2, ep=1)) == [
        "a hybrid layout's ffn section (t = 2, e = 1) lays out routed experts; this model is dense"]
