"""Offload/reload moves a role's state to host buffers and back, bit for bit, reusing buffers."""

from __future__ import annotations

import torch

from rlbatch.engines.offload import TensorStash, grad_tensors, optimizer_tensors


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    model(torch.randn(4, 5)).sum().backward()  # leave gradients in place
    return model, opt


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.detach().clone() for t in [*model.parameters(), *grad_tensors(model), *optimizer_tensors(opt)]]


def test_round_trip_is_bit_exact_and_frees_storage() -> None:
    model, opt = _model_and_optimizer()
    before = _snapshot(model, opt)
    stashes = [TensorStash("params", model.parameters), TensorStash("grads", lambda: grad_tensors(model)),
               TensorStash("optimizer", lambda: optimizer_tensors(opt))]
    moved = [s.offload() for s in stashes]
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert moved[0].bytes == sum(p.numel() * 4 for p in model.parameters())
    assert moved[2].bytes == 2 * moved[0].bytes  # AdamW: exp_avg and exp_avg_sq
    back = [s.reload() for s in stashes]
    assert [m.bytes for m in moved] == [b.bytes for b in back]
    after = _snapshot(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_buffers_are_reused_and_training_continues() -> None:
    model, opt = _model_and_optimizer()
    stash = TensorStash("params", model.parameters)
    stash.offload()
    stash.reload()
    first = [b.data_ptr() for b in stash._host]
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 5)).sum().backward()
        opt.step()
        stash.offload()
        stash.reload()
    assert [b.data_ptr() for b in stash._host] == first, "host buffers must be reused across steps"


def test_offload_twice_and_reload_twice_are_no_ops() -> None:
    model, _ = _model_and_optimizer()
    stash = TensorStash("params", model.parameters)
    assert stash.offload().bytes > 0
    assert stash.offload().bytes == 0
    assert stash.reload().bytes > 0
    assert stash.reload().bytes == 0
