"""The watch's headroom forecast: a significant trend warns ahead of the overflow, a stationary run never does;
the scaler's first back-off costs nothing and says nothing."""

from __future__ import annotations

import logging
import math
import random
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from forecast_loops import Outcome, data_drift, healthy, lr_too_high, residual_growth
from torch import nn

import ampdoctor
from ampdoctor.training.forecast import (
    CONSECUTIVE,
    MIN_POINTS,
    Forecaster,
    fit,
)

FP16_MAX = 65504.0
WARNING = re.compile(r"step (\d+): forecast: (\S+) is heading for a float16 overflow: ([\d.]+) bits of headroom at "
                     r"step \d+, losing ([\d.]+) bits/step, about (\d+) steps left")


def forecasts(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str, float, float, int]]:
    out = []
    for r in caplog.records:
        if r.name == "ampdoctor" and r.levelno == logging.WARNING and (m := WARNING.search(r.getMessage())):
            out.append((int(m[1]), m[2], float(m[3]), float(m[4]), int(m[5])))
    return out


# -- the forecaster alone (pure) --------------------------------------------------------------------------------


def test_a_straight_line_fits_exactly() -> None:
    f = fit([(s, 10.0 - 0.25 * s) for s in range(10)])
    assert f is not None and f.rate == pytest.approx(0.25) and f.headroom_bits == pytest.approx(7.75)
    assert f.steps_left == pytest.approx(31.0) and f.t > 100
    assert fit([(s, 1.0) for s in range(MIN_POINTS - 1)]) is None  # too few points


def test_a_drift_warns_once_after_two_checks_at_risk() -> None:
    """|x|max grows 15 % a step from 1000 (6 bits of headroom): 0.2 bits a step. The first MIN_POINTS - 1 checks
    cannot fit; the next two are at risk; the second one warns, and the steady drift never warns again."""
    f = Forecaster(warn_bits=6.0, horizon=100, format_max=FP16_MAX)
    warned = [(s, w) for s in range(25) if (w := f.observe(s, {"layer": 1000 * 1.15**s})) is not None]
    assert len(warned) == 1
    step, w = warned[0]
    assert step == MIN_POINTS - 1 + CONSECUTIVE - 1
    assert w.module == "layer" and w.rate == pytest.approx(math.log2(1.15))
    assert w.headroom_bits == pytest.approx(math.log2(FP16_MAX / (1000 * 1.15**step)))
    assert w.steps_left == pytest.approx(w.headroom_bits / w.rate)


def test_gates_headroom_horizon_and_significance() -> None:
    fast_far = Forecaster(warn_bits=6.0, format_max=FP16_MAX)  # 0.2 bits a step but 10+ bits left
    slow_near = Forecaster(warn_bits=6.0, horizon=20, format_max=FP16_MAX)  # 5 bits, 0.05 bits/step: 100 steps
    for s in range(40):
        assert fast_far.observe(s, {"a": 10 * 1.15**s}) is None or 10 * 1.15**s > FP16_MAX / 64
        assert slow_near.observe(s, {"a": 2000 * 2 ** (0.05 * s)}) is None
    # and the same slow trend within a longer horizon warns
    near = Forecaster(warn_bits=6.0, horizon=200, format_max=FP16_MAX)
    assert any(near.observe(s, {"a": 2000 * 2 ** (0.05 * s)}) is not None for s in range(40))


@pytest.mark.parametrize("seed", range(5))
def test_stationary_noise_under_the_threshold_never_warns(seed: int) -> None:
    """5 bits of headroom, 0.2 bits of noise from step to step, 2000 checks: no significant slope twice in a row."""
    rng = random.Random(seed)
    f = Forecaster(warn_bits=6.0, format_max=FP16_MAX)
    level = FP16_MAX / 2**5
    assert all(f.observe(s, {"a": level * 2 ** rng.gauss(0, 0.2)}) is None for s in range(2000))


def test_a_forecast_repeats_only_when_it_changes_materially() -> None:
    f = Forecaster(warn_bits=8.0, horizon=200, format_max=FP16_MAX)
    warned = []
    for s in range(60):  # 0.1 bits a step, then from step 30 three times as fast
        bits = 0.1 * s if s < 30 else 3.0 + 0.3 * (s - 30)
        if (w := f.observe(s, {"a": 8 * 2**bits})) is not None:
            warned.append(w)
    assert len(warned) == 2 and warned[1].crossing < warned[0].crossing - 5


def test_ties_name_the_module_that_completed_first() -> None:
    """A container's output is its last child's: the child (completed first) is named."""
    f = Forecaster(format_max=FP16_MAX)
    out = [f.observe(s, {"body.1": 1000 * 1.15**s, "body": 1000 * 1.15**s}) for s in range(12)]
    assert [w.module for w in out if w is not None] == ["body.1"]


# -- training loops -----------------------------------------------------------------------------------------------


def assert_warned_ahead(o: Outcome, caplog: pytest.LogCaptureFixture, lead: int = 5) -> None:
    assert o.first_bad is not None, "the loop was meant to overflow"
    seen = forecasts(caplog)
    assert seen, "no forecast warning"
    step, module, bits, rate, left = seen[0]
    assert step <= o.first_bad - lead
    failing = next(s for s in o.report.steps if s.step == o.first_bad)
    assert failing.sampled and failing.nonfinite_outputs  # densely sampled by then: the first module to overflow
    assert module == failing.nonfinite_outputs[0]
    assert 0 < bits < 6.0 and rate > 0.05 and left <= 100
    assert any(w.startswith(f"forecast: {module} is heading") for w in o.report.findings.warnings)  # report has it


def test_data_drift_is_forecast_before_the_first_non_finite_loss(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ampdoctor")
    o = data_drift(max_captures=1)
    assert 30 <= (o.first_bad or 0) <= 50
    assert_warned_ahead(o, caplog)
    assert forecasts(caplog)[0][1] == "body.1"
    assert len(forecasts(caplog)) == 1  # a steady drift: one warning
    sampled = [s.step for s in o.report.steps if s.sampled]
    assert set(range(20, o.first_bad or 0)) <= set(sampled)  # dense sampling once the trend was seen


@pytest.mark.slow
def test_a_learning_rate_too_high_is_forecast(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ampdoctor")
    assert_warned_ahead(lr_too_high(max_captures=1), caplog)


@pytest.mark.slow
def test_residual_growth_is_forecast_in_the_block_that_overflows(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ampdoctor")
    o = residual_growth(max_captures=1)
    assert_warned_ahead(o, caplog)
    assert forecasts(caplog)[0][1] == "blocks.7"


@pytest.mark.slow
@pytest.mark.parametrize("tight", [False, True])
def test_a_healthy_stationary_run_logs_no_warning(caplog: pytest.LogCaptureFixture, tight: bool) -> None:
    caplog.set_level(logging.WARNING, logger="ampdoctor")
    o = healthy(tight, max_captures=1)
    assert o.first_bad is None and o.steps == 200
    assert [r.getMessage() for r in caplog.records if r.name == "ampdoctor" and r.levelno >= logging.WARNING] == []
    assert not any(w.startswith("forecast:") for w in o.report.findings.warnings)


# -- the scaler's first back-off ----------------------------------------------------------------------------------


def wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def first_step(model: nn.Module, scaler: torch.amp.GradScaler, x: torch.Tensor, y: torch.Tensor) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x).float(), y)
    scaler.scale(loss * 1e4).backward()  # large enough that 65536 overflows the float16 gradients: a back-off
    scaler.step(opt)
    scaler.update()


def test_the_scalers_first_back_off_is_quiet_and_cheap(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first back-off runs no pass of ampdoctor's own (what made step 0 cost seconds) and logs nothing. Its
    time against a plain step is measured by benchmarks/watch_overhead.py, not here (timings flake under load)."""
    from ampdoctor.capture.session import Session

    passes: list[object] = []
    real_run = Session.run
    monkeypatch.setattr(Session, "run", lambda self, *a, **k: passes.append(a) or real_run(self, *a, **k))
    caplog.set_level(logging.DEBUG, logger="ampdoctor")
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    model, scaler = wide_mlp(), torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, scaler) as doctor:
        first_step(model, scaler, x, y)
    assert scaler.get_scale() == 32768.0  # it did back off
    step = doctor.report().steps[0]
    assert step.skipped and not step.captured
    assert passes == []
    assert [r.getMessage() for r in caplog.records if r.name == "ampdoctor"] == []


def test_a_capture_that_does_run_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A skip after a good step is no first back-off: its capture runs, and an INFO line says so first."""
    from test_watch_replay import readme_loop

    caplog.set_level(logging.INFO, logger="ampdoctor")
    report = readme_loop(tmp_path, loss_fn=None, steps=3, scaler_kwargs={"init_scale": 32.0, "growth_interval": 1})
    steps = report.report().steps
    assert [s.skipped for s in steps] == [False, False, True] and steps[2].captured
    info = [r.getMessage() for r in caplog.records if r.name == "ampdoctor" and r.levelno == logging.INFO]
    assert info == ["ampdoctor: step 2: diagnosing the first skip of a run (a capture: a few seconds)"]
