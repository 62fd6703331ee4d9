"""The HF <-> megatron-core weight mapping (pure tensors, no megatron-core needed)."""

from __future__ import annotations

import pytest
import torch

from rlbatch.engines.train import megatron_convert as convert
from rlbatch.engines.train.megatron_convert import Layout


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
        w |= {m + "mlp.gate_proj.weight": r(lay.ffn, H), m + "mlp.up_proj.weight": r(lay.ffn, H),
              m + "mlp.down_proj.weight": r(H, lay.ffn), m + "input_layernorm.weight": r(H),
              m + "post_attention_layernorm.weight": r(H)}
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
