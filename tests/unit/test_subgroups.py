"""The rank sets of the groups beyond a role's mesh axes (``rlbatch.placement.subgroups``)."""

from __future__ import annotations

import pytest

from rlbatch.placement.subgroups import axis_groups, create, subgroups

MESH = (("pp", 2), ("dp", 2), ("cp", 1), ("tp", 2))
RANKS = list(range(10, 18))  # row-major: pp outermost, tp innermost


def test_axis_groups_vary_only_along_the_named_axes() -> None:
    assert axis_groups(RANKS, MESH, {"tp"}) == [(10, 11), (12, 13), (14, 15), (16, 17)]
    assert axis_groups(RANKS, MESH, {"pp"}) == [(10, 14), (11, 15), (12, 16), (13, 17)]
    assert axis_groups(RANKS, MESH, {"dp"}) == [(10, 12), (11, 13), (14, 16), (15, 17)]


def test_pipeline_stages_get_model_parallel_and_end_groups_and_none_without() -> None:
    four = (("pp", 4), ("dp", 1), ("cp", 1), ("tp", 2))
    assert subgroups(RANKS, four) == {
        "model_parallel": [tuple(RANKS)],                       # one replica: all its tp x pp ranks
        "pipeline_ends": [(10, 16), (11, 17)],                  # stage 0 and stage 3 at each tp
    }
    assert subgroups(RANKS, MESH)["model_parallel"] == [(10, 11, 14, 15), (12, 13, 16, 17)]
    assert subgroups(RANKS, (("pp", 1), ("dp", 4), ("cp", 1), ("tp", 2))) == {}


def test_create_calls_new_group_for_every_set_in_order_and_keeps_this_ranks() -> None:
    calls: list[list[int]] = []

    def new_group(ranks: list[int]) -> str:
        calls.append(ranks)
        return "g" + "-".join(map(str, ranks))

    mine = create(RANKS, MESH, 15, new_group)
    assert calls == [[10, 11, 14, 15], [12, 13, 16, 17], [10, 14], [11, 15], [12, 16], [13, 17]]
    assert mine == {"model_parallel": "g10-11-14-15", "pipeline_ends": "g11-15"}


def test_expert_groups_split_each_positions_dp_ranks_into_consecutive_blocks() -> None:
    mesh = (("pp", 2), ("dp", 4), ("cp", 1), ("tp", 1))
    ranks = list(range(8))  # stage 0: 0-3, stage 1: 4-7
    groups = subgroups(ranks, mesh, ep=2)
    assert groups["expert"] == [(0, 1), (2, 3), (4, 5), (6, 7)]          # consecutive, as placement checks them
    assert groups["expert_dp"] == [(0, 2), (1, 3), (4, 6), (5, 7)]       # the same experts
    assert set(subgroups(ranks, mesh, ep=4)["expert_dp"]) == {(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)}
    assert "expert" not in subgroups(ranks, mesh)
    with pytest.raises(ValueError, match="e=3 does not divide data parallel d=4"):
        subgroups(ranks, mesh, ep=3)


MEGATRON_CORE_EXPERT_GRID = {
    "megatron:(attn:d2t2|ffn:t2e2)": {"expert": [(0, 2), (1, 3)], "expert_tp": [(0, 1), (2, 3)],
                                      "expert_tp_ep": [(0, 1, 2, 3)], "expert_dp": [(0,), (1,), (2,), (3,)]},
    "megatron:(attn:d2t2|ffn:e4)": {"expert": [(0, 1, 2, 3)], "expert_tp": [(0,), (1,), (2,), (3,)],
                                    "expert_tp_ep": [(0, 1, 2, 3)], "expert_dp": [(0,), (1,), (2,), (3,)]},
    "megatron:(attn:d4t2|ffn:t2e2)": {"expert": [(0, 2), (1, 3), (4, 6), (5, 7)],
                                      "expert_tp": [(0, 1), (2, 3), (4, 5), (6, 7)],
                                      "expert_tp_ep": [(0, 1, 2, 3), (4, 5, 6, 7)],
                                      "expert_dp": [(0, 4), (1, 5), (2, 6), (3, 7)]},
    "megatron:(attn:d2p2t2|ffn:p2e4)": {"expert": [(0, 1, 2, 3), (4, 5, 6, 7)],
                                        "expert_tp": [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)],
                                        "expert_tp_ep": [(0, 1, 2, 3), (4, 5, 6, 7)],
                                        "expert_dp": [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)]},
}
"""megatron-core 0.19.2's own expert grid for these layouts: ``RankGenerator(tp=ffn t, ep=ffn e,
dp=ffn d, pp=p, cp=1, order="tp-cp-ep-dp-pp").get_ranks(...)`` for 'ep', 'tp', 'tp-ep' and 'dp',
sorted (printed once; importing megatron-core costs a unit test ~7 s)."""


@pytest.mark.parametrize("spec", list(MEGATRON_CORE_EXPERT_GRID))
def test_hybrid_expert_groups_are_megatron_cores_expert_grid(spec: str) -> None:
    """A hybrid layout's expert groups over the attention mesh's ranks are the rank sets of
    megatron-core's expert grid (tp innermost, then ep, expert dp, pp)."""
    from rlbatch.placement.backend import parse_backend

    b = parse_backend(spec)
    a = b.dims
    mesh = (("pp", a.p), ("dp", a.d), ("cp", a.c), ("tp", a.t))
    groups = subgroups(list(range(b.world_size)), mesh, ffn=b.ffn)
    assert {k: sorted(v) for k, v in groups.items() if k.startswith("expert")} == MEGATRON_CORE_EXPERT_GRID[spec]
    assert ("model_parallel" in groups) == (a.p > 1)


def test_hybrid_expert_groups_of_areals_example_and_a_layout_that_does_not_cover_the_ranks() -> None:
    from rlbatch.placement.backend import ParallelDims

    groups = subgroups(list(range(32)), (("pp", 2), ("dp", 4), ("cp", 2), ("tp", 2)), ffn=ParallelDims(d=2, p=2, t=4, e=2))
    assert groups["expert_tp"][:2] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert groups["expert"][:2] == [(0, 4), (1, 5)]
    assert groups["expert_tp_ep"][0] == tuple(range(8)) and groups["expert_dp"][0] == (0, 8)
    with pytest.raises(ValueError, match=r"p\*d\*e\*t = 1\*1\*2\*1 does not cover the role's 4 ranks"):
        subgroups(list(range(4)), (("pp", 1), ("dp", 4), ("cp", 1), ("tp", 1)), ffn=ParallelDims(e=2))
