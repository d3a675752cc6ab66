"""The user's ``.grad`` fields through a diagnosis of a model whose own code runs a backward (test-time training,
an auxiliary inner loss), and parameters made under ``torch.inference_mode()``: nothing the user owns changes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import ampdoctor

FP16 = torch.float16


class InnerLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.float().pow(2).mean().backward(retain_graph=True)  # an auxiliary inner loss, backpropagated here
        return self.b(h)


def _loss(out: torch.Tensor, _batch: object) -> torch.Tensor:
    return out.float().mean()


def test_a_backward_inside_the_forward_leaves_none_where_grad_was_none() -> None:
    torch.manual_seed(0)
    model = InnerLoss()
    ampdoctor.diagnose(model, torch.randn(3, 4), loss_fn=_loss, dtype=FP16, progress=False)
    assert [p.grad for p in model.parameters()] == [None] * 4
    model.zero_grad(set_to_none=False)  # the user's next step (it raised on a stand-in gradient left behind)
    model(torch.randn(3, 4)).sum().backward()
    assert all(p.grad is not None and p.grad.is_contiguous() for p in model.parameters())


def test_a_backward_inside_the_forward_never_accumulates_into_the_users_grads() -> None:
    torch.manual_seed(0)
    model = InnerLoss()
    model(torch.randn(3, 4)).sum().backward()  # the user's own step left gradients
    grads = [p.grad for p in model.parameters()]
    values = [g.clone() for g in grads if g is not None]
    ampdoctor.diagnose(model, torch.randn(3, 4), loss_fn=_loss, dtype=FP16, progress=False)
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(p.grad, v) for p, v in zip(model.parameters(), values))


def test_parameters_made_under_inference_mode_are_diagnosed() -> None:
    torch.manual_seed(0)
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    before = [p.clone() for p in model.parameters()]
    report = ampdoctor.diagnose(model, torch.randn(3, 4), loss_fn=_loss, dtype=FP16, progress=False)
    assert report.verdict == "healthy"
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_verify_steps_with_an_optimizer_that_needs_a_closure_is_refused_up_front() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight.fill_(3e4)  # an overflow: there would be remedies to train
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.LBFGS(model.parameters())
    try:
        ampdoctor.diagnose(model, torch.ones(3, 4), dtype=FP16, optimizer=optimizer, verify_steps=2, progress=False)
    except ampdoctor.InvalidInput as exc:
        assert "optimizer" in str(exc) and "LBFGS" in str(exc) and "verify_steps=0" in str(exc)
    else:
        raise AssertionError("LBFGS with verify_steps was accepted")
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_guard_that_fails_to_start_loses_no_grad_and_claims_nothing(monkeypatch: Any) -> None:
    import ampdoctor.capture.state as state

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model(torch.randn(3, 4)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    real = state.fingerprints
    monkeypatch.setattr(state, "fingerprints", lambda tensors: (_ for _ in ()).throw(MemoryError("out of memory")))
    try:
        ampdoctor.diagnose(model, torch.randn(3, 4), loss_fn=_loss, dtype=FP16, progress=False)
    except MemoryError:
        pass
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    monkeypatch.setattr(state, "fingerprints", real)
    ampdoctor.diagnose(model, torch.randn(3, 4), loss_fn=_loss, dtype=FP16, progress=False)  # not left claimed
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))


def test_a_sparse_parameters_fingerprint_moves_with_its_values_and_indices() -> None:
    from ampdoctor.capture.state import fingerprints

    coo = torch.eye(4).to_sparse().coalesce()
    before = fingerprints([coo])
    coo._values()[1] = 3.0
    after_value = fingerprints([coo])
    coo._indices()[1, 0] = 2
    assert before != after_value != fingerprints([coo])
    csr = torch.eye(4).to_sparse_csr()
    first = fingerprints([csr])
    csr.values()[0] = 2.0
    assert fingerprints([csr]) != first
