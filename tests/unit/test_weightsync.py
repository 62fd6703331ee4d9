"""Weight-sync layout: buckets, inference parameters flattened so a bucket lands in place, and the
streamed export: its units, its manifest, a colocated load that holds one unit at a time."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlbatch.engines.base import Unit, WeightStream, layer_units
from rlbatch.engines.flat import flatten_parameters, span
from rlbatch.loop.weightsync import WeightBroadcast, buckets, load_in_process
from tests.alive import Alive


def test_buckets_fill_up_to_the_limit_and_an_oversized_tensor_travels_alone() -> None:
    # fp32 on the wire: 1024 bytes hold 256 elements
    assert buckets([100, 100, 56, 1, 1000, 10], 1024) == [(0, 3), (3, 4), (4, 5), (5, 6)]
    assert buckets([], 1024) == []


def test_flattened_parameters_keep_values_and_ties_and_share_one_buffer() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 4), torch.nn.Linear(4, 11, bias=True))
    model[1].weight = model[0].weight  # tied, as embeddings and lm_head often are
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.tensor([1, 2, 3])
    out = model(x)
    flatten_parameters(model)
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in before.items())
    assert model[1].weight is model[0].weight
    assert len({p.untyped_storage().data_ptr() for p in params.values()}) == 1
    assert torch.equal(model(x), out)


def test_span_writes_through_to_adjacent_parameters_only() -> None:
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(s)) for s in [(2, 3), (4,), (5,)])
    flatten_parameters(model)
    a, b, c = model
    view = span([a, b], torch.float32)
    assert view is not None and view.shape == (10,)
    view.copy_(torch.arange(10.0))
    assert torch.equal(a.detach().reshape(-1), torch.arange(6.0)) and torch.equal(b.detach(), torch.arange(6.0, 10.0))
    assert torch.equal(c.detach(), torch.zeros(5))
    assert span([a, c], torch.float32) is None  # not back to back
    assert span([b, a], torch.float32) is None  # not in this order
    assert span([a, b], torch.bfloat16) is None  # not the wire dtype
    assert span([torch.zeros(3), torch.zeros(3)], torch.float32) is None  # separate storages


def test_buckets_count_the_wire_dtype() -> None:
    # bf16 on the wire: 1024 bytes hold 512 elements
    assert buckets([100, 100, 56, 200, 1000], 1024, element_bytes=2) == [(0, 4), (4, 5)]


def test_layer_units_are_runs_of_one_layer_and_the_parts_around_them() -> None:
    names = ["model.embed_tokens.weight", "model.layers.0.a", "model.layers.0.b", "model.layers.1.a",
             "model.layers.10.a", "model.norm.weight", "lm_head.weight"]
    assert layer_units(names) == [names[:1], names[1:3], names[3:4], names[4:5], names[5:]]


def _units(sizes: list[list[int]]) -> WeightStream:
    """A stream that makes each unit's tensors fresh when asked for, as an engine's gather does."""
    names = [[f"u{u}.t{k}" for k in range(len(unit))] for u, unit in enumerate(sizes)]

    def produce(dtype: torch.dtype | None) -> Iterator[Unit]:
        for unit_names, unit in zip(names, sizes, strict=True):
            yield [(n, torch.full((s,), float(s), dtype=dtype or torch.float32)) for n, s in zip(unit_names, unit,
                                                                                                strict=True)]

    return WeightStream([(n, torch.Size([s])) for ns, unit in zip(names, sizes, strict=True)
                         for n, s in zip(ns, unit, strict=True)], produce)


def test_a_colocated_load_holds_one_unit_at_a_time_in_the_dtype_asked_for() -> None:
    sizes = [[300], [100, 200, 50], [400, 10], [5]]
    stream, alive, loaded = _units(sizes), Alive(), {}

    class Infer:
        def load_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
            loaded.update({n: t.clone() for n, t in named})
            return sum(t.numel() * t.element_size() for _, t in named)

    def watched(dtype: torch.dtype | None, produce=stream._produce) -> Iterator[Unit]:  # type: ignore[no-untyped-def]
        for unit in produce(dtype):
            alive.saw(t for _, t in unit)  # as each unit arrives, before the consumer has it
            yield unit
            del unit

    stream._produce = watched
    total = load_in_process(stream, Infer(), torch.bfloat16)
    assert total == 2 * sum(map(sum, sizes))
    assert alive.peak == 2 * max(map(sum, sizes))  # one unit: the previous one is gone before the next is made
    assert [n for n, _ in stream.manifest] == list(loaded) and all(t.dtype == torch.bfloat16 for t in loaded.values())


def test_an_export_that_strays_from_its_manifest_is_refused() -> None:
    good = _units([[3, 4], [5]])
    for manifest, what in (([("u0.t0", torch.Size([3])), ("u0.t1", torch.Size([9])), ("u1.t0", torch.Size([5]))], "manifest says"),
                           (good.manifest + [("extra", torch.Size([1]))], "the manifest lists 4")):
        with pytest.raises(RuntimeError, match=what):
            WeightStream(manifest, good._produce).drain()
    assert [n for n, _ in WeightStream.of([("a", torch.zeros(2)), ("b", torch.ones(3))]).tensors(torch.bfloat16)] == ["a", "b"]


class _Sink:
    """An inference engine's side of a sync: what it loaded, bucket by bucket."""

    def __init__(self) -> None:
        self.loaded: list[list[str]] = []

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        self.loaded.append([n for n, _ in named])
        return 0

    def weight_views(self, names: list[str], dtype: torch.dtype) -> torch.Tensor | None:
        return None


def test_a_rank_can_be_made_to_stop_before_any_bucket_of_the_stream(one_rank_mesh: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fault point ``sync_bucket`` comes before each bucket's broadcast: a test makes one rank
    hang (or fail) mid-stream, after the buckets before it went through."""
    import torch.distributed as dist

    from rlbatch.runtime import faults
    from rlbatch.runtime.world import SYNC

    world = SimpleNamespace(rank=0, device=torch.device("cpu"), groups={SYNC: dist.group.WORLD},
                            check=lambda op, role, fn, *a, **k: fn(*a, **k))
    monkeypatch.setattr(faults, "_seen", {})
    monkeypatch.setenv("RLBATCH_FAULT", "raise:0:sync_bucket:3")
    sink = _Sink()
    with pytest.raises(RuntimeError, match="injected fault on rank 0 at sync_bucket"):
        WeightBroadcast()(world, _units([[300], [100, 200], [400], [5]]), sink, 0, 300 * 4)  # type: ignore[arg-type]
    assert sink.loaded == [["u0.t0"], ["u1.t0", "u1.t1"]]  # buckets of 300 floats: [300], [100, 200], then [400]
