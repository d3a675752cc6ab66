"""Non-finite gradients that no GradScaler skips (bfloat16, a disabled scaler): the watch checks them itself.

The model: ``x * (1 + sqrt(gain * gain))`` with ``gain`` initialised to zero (a learnable gain around 1): the
forward and the loss are finite, but d sqrt(u)/du at u = 0 is inf, times d(gain * gain)/d gain = 0: NaN in
``gain``'s gradient. GradScaler would skip such a step; without one the optimizer applies it, so the step is a
persistent failure from the first one, and a capture finds SqrtBackward0 in ``gain``'s module.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.capture.gradcheck import MAX_NAMED, GradCheck
from ampdoctor.records import StepRecord
from ampdoctor.training.runs import is_bad, persistent_reason

BF16 = torch.bfloat16


class ZeroGain(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.zeros(width))  # zero: |gain| has a NaN gradient there

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1 + torch.sqrt(self.gain * self.gain))


def nan_grad_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), ZeroGain(), nn.Linear(8, 1))


def healthy_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


def bf16_loop(model: nn.Module, steps: int = 3, guard: bool = False, **watch_kwargs: Any) -> ampdoctor.Watch:
    """A plain bfloat16 loop: no scaler, ``doctor.step()`` after the backward, before the optimizer. ``guard``: the
    loop skips the optimizer step itself when a gradient is non-finite (else SGD makes the weights NaN, even at
    lr 0: 0 * NaN)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    with ampdoctor.watch(model, save_bundle=False, **watch_kwargs) as doctor:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=BF16):
                loss = model(x).float().pow(2).mean()
            doctor.see_loss(loss)
            loss.backward()
            doctor.step()
            if not guard or all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
                opt.step()
    return doctor


@pytest.mark.parametrize("guard", [True, False])
def test_bfloat16_nan_gradients_with_a_finite_loss_are_a_persistent_failure_with_their_origin(
    caplog: pytest.LogCaptureFixture, guard: bool
) -> None:
    model = nan_grad_model()
    with caplog.at_level(logging.WARNING, logger="ampdoctor"):
        doctor = bf16_loop(model, guard=guard, stats_every=0)
    report = doctor.report()
    steps = report.steps
    # the loop's own guard keeps the weights finite (before, the watch called that run HEALTHY); without it
    # the NaN weights make every later forward non-finite (before, the report blamed them, at step 1)
    finite = [True] * 3 if guard else [True, False, False]
    assert [s.loss is not None and s.loss == s.loss for s in steps] == finite
    assert [s.forward_finite for s in steps] == finite
    assert [s.grads_finite for s in steps] == [False] * 3
    assert [s.skipped for s in steps] == [False] * 3  # nothing skipped them
    assert [s.run for s in steps] == ["persistent"] * 3
    assert steps[0].captured and steps[0].nonfinite_params == ("1.gain",)
    assert report.verdict == "nan"
    origin = report.backward_origin
    assert origin is not None and origin.module == "1"
    assert origin.op is not None and origin.op.node == "SqrtBackward0"
    assert report.run.scale_source == "no GradScaler, step 0"
    assert report.run.loss_source == "the step's recorded output gradient"
    assert "step 0: persistent failure, parameter gradients were non-finite (1.gain) with no GradScaler" in caplog.text
    assert "the weights changed" not in " ".join(report.run.notes)  # closed before the optimizer
    text = str(report)
    assert "3 step(s) recorded, 0 skipped, 3 with non-finite gradients that no GradScaler skipped" in text
    assert "run(s) of bad steps: 0 harmless, 1 persistent" in text
    html = report.to_html()
    assert "taken, non-finite gradients" in html


def test_a_disabled_grad_scaler_is_no_guard_either_and_its_step_closes_the_step_before_the_optimizer() -> None:
    model = nan_grad_model()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    with ampdoctor.watch(model, scaler, save_bundle=False, stats_every=0, dtype=torch.float16) as doctor:
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    report = doctor.report()
    assert [s.step for s in report.steps] == [0, 1]  # update() closed nothing more
    assert [s.grads_finite for s in report.steps] == [False, False]
    assert [s.forward_finite for s in report.steps] == [True, False]  # SGD applied the NaN gradients
    assert [s.run for s in report.steps] == ["persistent", "persistent"]
    # the capture replayed step 0 on the weights of its forward: scaler.step closed it before the optimizer
    assert report.backward_origin is not None and report.backward_origin.module == "1"
    assert report.forward_origin is None
    assert "the weights changed" not in " ".join(report.run.notes)
    assert "step" not in scaler.__dict__ and "update" not in scaler.__dict__  # the taps are gone


def test_healthy_bfloat16_steps_stay_healthy_and_the_check_touches_no_gradient() -> None:
    model = healthy_model()
    versions: list[list[int]] = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    with ampdoctor.watch(model, save_bundle=False, stats_every=0) as doctor:
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=BF16):
                loss = model(x).float().pow(2).mean()
            doctor.see_loss(loss)
            loss.backward()
            before = [p.grad._version for p in model.parameters() if p.grad is not None]
            doctor.step()
            versions.append([p.grad._version for p in model.parameters() if p.grad is not None])
            assert versions[-1] == before  # read, never written
            opt.step()
    report = doctor.report()
    assert report.verdict == "healthy"
    assert all(s.grads_finite and not s.nonfinite_params for s in report.steps)
    assert not any("watch hook error" in n for n in report.run.notes)
    assert "with non-finite gradients" not in str(report)


def test_finite_gradients_whose_float32_norm_overflows_are_not_called_non_finite() -> None:
    layer = nn.Linear(1000, 1, bias=False)
    layer.weight.grad = torch.full((1, 1000), 1e36)  # each finite; their L1 norm (1e39) is not in float32
    check = GradCheck(layer)
    [value] = check.values()
    assert value.item() == float("inf")  # the cheap check flags it ...
    assert check.nonfinite() == ((), 0, False)  # ... the exact one clears it


def test_the_check_names_the_non_finite_gradients_in_model_order_up_to_a_bound() -> None:
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(MAX_NAMED)])
    model[0].to(BF16)  # a low-precision gradient too
    names = [name for name, _ in model.named_parameters()]
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, float("nan") if i % 2 else 1.0)
    model[0].weight.grad = torch.tensor([[float("inf"), 0.0], [0.0, 0.0]], dtype=BF16)
    check = GradCheck(model)
    values = check.values()
    assert len(values) == 1 and not torch.isfinite(values[0]) and values[0].dtype == torch.float32
    named, count, nan_only = check.nonfinite()
    bad = [n for i, n in enumerate(names) if i % 2 or i == 0]
    assert count == len(bad) and named == tuple(bad[:MAX_NAMED])
    assert not nan_only  # the inf in 0.weight


def test_no_gradient_at_all_is_nothing_to_check() -> None:
    check = GradCheck(nn.Linear(2, 2))
    assert check.values() == []
    assert check.nonfinite() == ((), 0, False)


@pytest.mark.parametrize(
    "record, bad, reason",
    [
        (StepRecord(0, 1.0, False), False, ""),
        (StepRecord(0, 1.0, False, grads_finite=False, nonfinite_params=("a.w", "b.w")), True,
         "parameter gradients were non-finite (a.w, b.w) with no GradScaler to skip the step (unless the loop "
         "skips it itself, the optimizer applies them)"),
        (StepRecord(0, 1.0, False, grads_finite=False), True,
         "parameter gradients were non-finite with no GradScaler to skip the step (unless the loop skips it "
         "itself, the optimizer applies them)"),
        (StepRecord(0, 1.0, True, grads_finite=False), True, ""),  # skipped: GradScaler's verdict stands
    ],
)
def test_runs_treat_unguarded_non_finite_gradients_as_persistent(record: StepRecord, bad: bool, reason: str) -> None:
    assert is_bad(record) is bad
    assert persistent_reason(record) == reason


def test_log_to_gets_the_count_of_applied_non_finite_gradient_steps() -> None:
    logged: dict[str, dict[int, Any]] = {}

    def sink(tag: str, value: Any, step: Optional[int]) -> None:
        logged.setdefault(tag, {})[int(step or 0)] = value

    bf16_loop(nan_grad_model(), guard=True, stats_every=0, log_to=sink, max_captures=0)
    assert logged["ampdoctor/nonfinite_grad_steps"] == {0: 1.0, 1: 2.0, 2: 3.0}
    assert set(logged["ampdoctor/skipped_steps"].values()) == {0.0}
    healthy: dict[str, dict[int, Any]] = {}
    bf16_loop(healthy_model(), stats_every=0, log_to=lambda t, v, s: healthy.setdefault(t, {}).update({s: v}))
    assert "ampdoctor/nonfinite_grad_steps" not in healthy


def test_a_watch_with_an_enabled_scaler_leaves_the_check_to_grad_scaler(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(GradCheck, "values", lambda self: calls.append(1) or [])
    model = healthy_model()
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(4, 8)
    with ampdoctor.watch(model, scaler, save_bundle=False, stats_every=0) as doctor:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert len(doctor.report().steps) == 2
    assert calls == []  # GradScaler's found-inf flags say it; no second pass over the gradients


def test_a_disabled_scaler_with_two_optimizers_and_accumulation_closes_one_step_per_update() -> None:
    model = healthy_model()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    opts = [torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[2].parameters(), lr=0.1)]
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    with ampdoctor.watch(model, scaler, save_bundle=False, stats_every=0) as doctor:
        for _ in range(3):
            for _ in range(2):  # two micro-batches
                with torch.autocast("cpu", dtype=BF16):
                    loss = model(x).float().pow(2).mean() / 2
                scaler.scale(loss).backward()
            for opt in opts:
                scaler.step(opt)
            scaler.update()
            for opt in opts:
                opt.zero_grad()
    steps = doctor.report().steps
    assert [s.step for s in steps] == [0, 1, 2]
    assert [s.micro_batches for s in steps] == [2, 2, 2]
    assert all(s.loss is not None and s.grads_finite and not s.skipped for s in steps)
    assert doctor.report().verdict == "healthy"


# -- step boundaries with a disabled scaler, and scalers that are not torch's ----------------------------------


def disabled_loop(
    model: nn.Module, iterations: int, order: str, steps_per_iteration: int = 1
) -> ampdoctor.Watch:
    """A bfloat16 loop through ``GradScaler(enabled=False)``; ``order``: what closes each iteration, in order
    (``s`` scaler.step, ``d`` doctor.step(), ``u`` scaler.update; ``c`` an LBFGS closure through scaler.step)."""
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    opt: torch.optim.Optimizer = (
        torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=1) if "c" in order
        else torch.optim.SGD(model.parameters(), lr=0.0)
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=BF16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        return loss

    with ampdoctor.watch(model, scaler, save_bundle=False, stats_every=0) as doctor:
        for _ in range(iterations):
            if "c" not in order:
                closure()
            for what in order:
                if what == "c":
                    scaler.step(opt, closure)
                elif what == "s":
                    scaler.step(opt)
                elif what == "d":
                    doctor.step()
                else:
                    scaler.update()
    return doctor


@pytest.mark.parametrize("order", ["su", "sdu", "dsu", "ssu", "cu", "s"])
def test_each_iteration_is_one_step_whatever_closes_it(order: str) -> None:
    doctor = disabled_loop(healthy_model(), 3, order)
    steps = doctor.report().steps
    assert [s.step for s in steps] == [0, 1, 2]  # no empty step, none late
    assert [s.micro_batches for s in steps] == [1, 1, 1]
    assert all(s.loss is not None and s.grads_finite for s in steps)
    assert doctor.report().verdict == "healthy"


def test_a_disabled_scalers_report_says_so_and_names_scaler_scale_as_the_loss() -> None:
    report = disabled_loop(healthy_model(), 2, "su").report()
    assert report.run.scale_source == "the watched GradScaler, disabled (enabled=False)"
    assert report.run.loss_source == "scaler.scale(loss)"
    report = bf16_loop(healthy_model(), stats_every=0).report()
    assert report.run.scale_source == "no GradScaler"
    assert report.run.loss_source == "doctor.see_loss(loss) or the output's loss"


class NoStepScaler:
    """Duck-typed and disabled, without ``step`` (the loop calls the optimizer itself)."""

    def is_enabled(self) -> bool:
        return False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def update(self) -> None:
        pass


def test_a_disabled_scaler_without_step_still_checks_the_gradients_at_update() -> None:
    model = nan_grad_model()
    scaler = NoStepScaler()
    x = torch.randn(4, 8)
    with ampdoctor.watch(model, scaler, save_bundle=False, stats_every=0, max_captures=0) as doctor:
        for _ in range(2):
            with torch.autocast("cpu", dtype=BF16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.update()
            model.zero_grad()
    steps = doctor.report().steps
    assert [s.grads_finite for s in steps] == [False, False] and steps[0].nonfinite_params == ("1.gain",)


class OwnScaler:
    """An enabled scaler that is not torch's (no found-inf flags): it skips a non-finite step itself without
    lowering its scale (DeepSpeed's hysteresis does that). It is trusted: no second check of the gradients."""

    def __init__(self) -> None:
        self.value = 1024.0

    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        return self.value

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.value

    def update(self) -> None:
        pass


def test_an_enabled_scaler_that_is_not_torchs_is_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(GradCheck, "values", lambda self: calls.append(1) or [])
    model = nan_grad_model()
    scaler = OwnScaler()
    with ampdoctor.watch(model, scaler, save_bundle=False, stats_every=0, max_captures=0) as doctor:
        for _ in range(2):
            with torch.autocast("cpu", dtype=BF16):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.update()
            model.zero_grad()
    report = doctor.report()
    assert calls == [] and all(s.grads_finite for s in report.steps)
    assert "no GradScaler" not in str(report)


# -- what the report keeps of the check ---------------------------------------------------------------------


class FirstCallOnly(nn.Module):
    """NaN gradient for ``gain`` on the first training forward only (a counter in a plain attribute): the
    capture's replay is a later call, so it cannot reproduce the failure."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.zeros(8))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        g = torch.sqrt(self.gain * self.gain) if self.calls == 1 else self.gain.abs()
        return x * (1 + g)


def test_a_capture_that_does_not_reproduce_keeps_the_checks_names_and_the_verdict_follows_nan() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), FirstCallOnly(), nn.Linear(8, 1))
    report = bf16_loop(model, steps=1, stats_every=0).report()
    first = report.steps[0]
    assert first.captured and first.backward_origin is None  # the replay was healthy
    assert first.nonfinite_params == ("1.gain",) and first.grads_nan
    assert report.verdict == "nan"  # NaN gradients, no inf: not "overflow"


def test_inf_gradients_not_captured_are_an_overflow_and_nan_ones_a_nan() -> None:
    torch.manual_seed(0)
    report = bf16_loop(nan_grad_model(), steps=1, stats_every=0, max_captures=0).report()
    assert report.verdict == "nan" and report.steps[0].grads_nan

    class InfGrad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.zeros(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.sqrt(self.gain)  # d sqrt(u)/du at 0: +inf, times a finite gradient

    report = bf16_loop(nn.Sequential(nn.Linear(8, 8), InfGrad(), nn.Linear(8, 1)), steps=1, stats_every=0,
                       max_captures=0).report()
    assert not report.steps[0].grads_finite and not report.steps[0].grads_nan
    assert report.verdict == "overflow"


def test_a_parameter_replaced_after_the_watch_started_is_checked() -> None:
    model = healthy_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(4, 8)
    with ampdoctor.watch(model, save_bundle=False, stats_every=0, max_captures=0) as doctor:
        for i in range(2):
            if i == 1:  # a re-init replaces the head's parameters
                model[2] = nn.Sequential(nn.Linear(8, 8), ZeroGain(), nn.Linear(8, 1))
                opt = torch.optim.SGD(model.parameters(), lr=0.0)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=BF16):
                loss = model(x).float().pow(2).mean()
            doctor.see_loss(loss)
            loss.backward()
            doctor.step()
    steps = doctor.report().steps
    assert [s.grads_finite for s in steps] == [True, False]
    assert steps[1].nonfinite_params == ("2.1.gain",)


class SparseNet(nn.Module):
    """A sparse embedding whose row 0 is zero, read as sqrt(e * e): that row's gradient is NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8, sparse=True)
        with torch.no_grad():
            self.emb.weight[0] = 0.0
        self.head = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.emb(ids)
        return self.head(torch.sqrt(e * e))


@pytest.mark.parametrize("bad", [True, False])
def test_sparse_gradients_are_checked_through_their_values(bad: bool) -> None:
    torch.manual_seed(0)
    model = SparseNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ids = torch.tensor([[0, 1, 2]]) if bad else torch.tensor([[1, 2, 3]])
    with ampdoctor.watch(model, save_bundle=False, stats_every=0, max_captures=0) as doctor:
        with torch.autocast("cpu", dtype=BF16):
            loss = model(ids).float().pow(2).mean()
        doctor.see_loss(loss)
        loss.backward()
        assert model.emb.weight.grad is not None and model.emb.weight.grad.is_sparse
        doctor.step()
        opt.step()
    [step] = doctor.report().steps
    assert step.grads_finite is not bad
    assert step.nonfinite_params == (("emb.weight",) if bad else ())
