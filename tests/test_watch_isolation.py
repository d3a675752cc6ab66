"""Issue 10, item 8: what ampdoctor itself runs is never the watch's training, and watches unwind in any order.

A ``diagnose`` inside an active watch runs the model several times (survey, detail, verification passes): none of
those forwards may count as the step's micro-batches or put non-finite flags on a finite step. Two watches on one
scaler, closed in either order, leave the scaler exactly as it was.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_ddp import make_model
from torch import nn
from torch.utils.checkpoint import checkpoint

import ampdoctor
from ampdoctor.training.runtime import Watch

FP16 = torch.float16


def boom_model() -> nn.Sequential:
    """boom's output is 16 * 5000 * x: 40000 for x = 0.5 (finite), 80000 (+inf in float16) for x = 1."""
    return make_model()


def tiny_loss(out: torch.Tensor, _: Any = None) -> torch.Tensor:
    return out.float().sum() * 1e-7


def step(model: nn.Module, scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer, x: torch.Tensor,
         diagnose_on: Any = None) -> None:
    """One training step; ``diagnose_on``: a batch the user diagnoses between the forward and the backward."""
    opt.zero_grad()
    with torch.autocast("cpu", dtype=FP16):
        loss = tiny_loss(model(x))
    if diagnose_on is not None:
        report = ampdoctor.diagnose(model, diagnose_on, loss_fn=tiny_loss)
        assert report.verdict == "overflow" and report.forward_origin.module.endswith("boom")  # type: ignore[union-attr]
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("stats_every", [1, 50])
def test_a_users_diagnose_inside_the_watch_is_not_the_watchs_step(stats_every: int) -> None:
    model = boom_model()
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    good = torch.full((2, 16), 0.5)
    with ampdoctor.watch(model, scaler, stats_every=stats_every, save_bundle=False) as doctor:
        step(model, scaler, opt, good)
        step(model, scaler, opt, good, diagnose_on=torch.ones(2, 16))  # the user's diagnose overflows boom
        step(model, scaler, opt, good)
    report = doctor.report()
    assert [s.micro_batches for s in report.steps] == [1, 1, 1]
    assert [s.forward_finite for s in report.steps] == [True, True, True]
    assert [s.skipped for s in report.steps] == [False, False, False]
    assert all(s.nonfinite_outputs == () and s.nonfinite_grads == () for s in report.steps)
    assert report.verdict == "healthy"
    if stats_every == 1:  # the diagnosis's boom output (+inf) never reached the step's statistics
        assert report.steps[1].out_abs_max["boom"] == 40000.0


def test_a_users_diagnose_of_a_checkpointed_model_inside_the_watch_is_not_recorded() -> None:
    """A reentrant checkpoint recomputes its region during the diagnosis's own backward: still not the watch's."""

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = boom_model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.inner, x, use_reentrant=True)  # type: ignore[no-any-return]

    model = Checkpointed()
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    good = torch.full((2, 16), 0.5).requires_grad_()
    with ampdoctor.watch(model, scaler, stats_every=1, save_bundle=False) as doctor:
        step(model, scaler, opt, good, diagnose_on=torch.ones(2, 16).requires_grad_())
    (record,) = doctor.report().steps
    assert record.micro_batches == 1 and record.forward_finite and not record.skipped
    assert record.nonfinite_outputs == () and record.nonfinite_grads == ()
    assert record.out_abs_max["inner.boom"] == 40000.0


def test_the_watchs_own_captures_are_not_recorded_by_another_watch() -> None:
    """Two watches on one model: the first one's capture of a failing step runs diagnose; the second one must not
    count those passes as micro-batches of its next step."""
    model = boom_model()
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with ampdoctor.watch(model, scaler, save_bundle=False, stats_every=1) as outer:
        with ampdoctor.watch(model, scaler, save_bundle=False, stats_every=1) as inner:
            step(model, scaler, opt, torch.ones(2, 16))  # overflows: both watches capture it
            step(model, scaler, opt, torch.full((2, 16), 0.5))
    for doctor in (outer, inner):
        report = doctor.report()
        assert [s.micro_batches for s in report.steps] == [1, 1]
        assert [s.forward_finite for s in report.steps] == [False, True]
        assert report.forward_origin is not None and report.forward_origin.module == "boom"


def original_methods(scaler: torch.amp.GradScaler) -> dict[str, Any]:
    return {name: scaler.__dict__.get(name) for name in ("scale", "update")}


@pytest.mark.parametrize("order", ["inner first", "outer first"])
def test_two_watches_on_one_scaler_unwind_in_any_order(order: str) -> None:
    model = boom_model()
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    a = ampdoctor.watch(model, scaler, save_bundle=False)
    b = ampdoctor.watch(model, scaler, save_bundle=False)
    step(model, scaler, opt, torch.full((2, 16), 0.5))
    first, second = (b, a) if order == "inner first" else (a, b)
    first.close()
    step(model, scaler, opt, torch.full((2, 16), 0.5))  # the watch still open records it, the closed one does not
    assert len(second.steps) == 2 and len(first.steps) == 1
    second.close()
    assert original_methods(scaler) == {"scale": None, "update": None}
    assert type(scaler).update is torch.amp.GradScaler.update
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


def test_watches_unwind_around_the_users_own_instance_method() -> None:
    model = boom_model()
    scaler = torch.amp.GradScaler("cpu")
    calls: list[str] = []

    def own_update(*args: Any, **kwargs: Any) -> None:
        calls.append("own")
        torch.amp.GradScaler.update(scaler, *args, **kwargs)

    scaler.update = own_update  # type: ignore[method-assign]
    a: Watch = ampdoctor.watch(model, scaler, save_bundle=False)
    b: Watch = ampdoctor.watch(model, scaler, save_bundle=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    step(model, scaler, opt, torch.full((2, 16), 0.5))
    a.close()
    b.close()
    assert scaler.__dict__["update"] is own_update and "scale" not in scaler.__dict__
    assert calls == ["own"] and len(a.steps) == len(b.steps) == 1
