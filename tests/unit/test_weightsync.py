"""Weight-sync layout: buckets, and inference parameters flattened so a bucket lands in place."""

from __future__ import annotations

import torch

from rlbatch.engines.flat import flatten_parameters, span
from rlbatch.scheduler.weightsync import buckets


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
