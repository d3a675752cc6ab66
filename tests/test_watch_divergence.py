"""Issue 14, item 2: a divergence is not a harmless scale overflow.

A regression MLP trained with SGD at a learning rate ten times too high: the loss goes from ~18 to 2134 at step 6,
the weights grow, GradScaler skips 8 steps in a row (8192 -> 32) and one good step follows at scale 32, which the
old run logic called *harmless*; one step later the forward overflows. The same loop at a sane learning rate
skips a few steps while GradScaler calibrates, and those stay harmless.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.records import StepRecord
from ampdoctor.report.document import DIVERGENCE_TITLE
from ampdoctor.training.divergence import LOSS_JUMP_FACTOR, growth, loss_limit, rising
from ampdoctor.training.runs import HARMLESS, PERSISTENT, RunTracker


def regression_run(lr: float, steps: int = 20) -> ampdoctor.Report:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(
        fc1=nn.Linear(16, 64), act1=nn.ReLU(), fc2=nn.Linear(64, 64), act2=nn.ReLU(), out=nn.Linear(64, 1)
    ))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler("cpu")
    gen = torch.Generator().manual_seed(1)
    x_all = torch.randn(512, 16, generator=gen)
    y_all = x_all @ torch.randn(16, 1, generator=gen)
    with ampdoctor.watch(model, scaler, stats_every=10, save_bundle=False) as doctor:
        for _ in range(steps):
            idx = torch.randint(0, 512, (32,), generator=gen)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x_all[idx])
            loss = (out.float() - y_all[idx]).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return doctor.report()


def test_a_learning_rate_divergence_is_not_harmless() -> None:
    report = regression_run(lr=0.5)
    steps = report.steps
    assert [s.step for s in steps if s.skipped] == [1, 2, 4, *range(6, 14), *range(15, 20)]
    assert [s.scale for s in steps[6:15]] == [8192.0 / 2**k for k in range(9)]  # 8 skips, then good at 32
    assert not steps[14].skipped and steps[14].forward_finite  # "recovered" at scale 32 ...
    assert steps[14].loss is not None and steps[14].loss > 1000  # ... with the loss far out of its range
    # GradScaler calibrating at the start: harmless; the run the divergence led into: not harmless
    assert [s.run for s in steps[:5] if s.skipped] == [HARMLESS] * 3
    assert {s.run for s in steps[6:14]} == {PERSISTENT}
    d = report.findings.divergence
    assert d is not None and d.began == 6 and d.skipped_from == 6 and d.peak_step == 6
    assert d.loss_median == pytest.approx(17.89, abs=0.01) and d.loss_peak == pytest.approx(2134, abs=1)
    assert d.loss_peak > LOSS_JUMP_FACTOR * d.loss_median
    # the output layer's weights grew fastest between the samples around the jump (steps 4 and 6: run starts)
    assert [(g.module, g.what, g.from_step, g.to_step) for g in d.growth] == [
        ("out", "weights", 4, 6), ("fc2", "weights", 4, 6)
    ]
    assert d.growth[0].factor == pytest.approx(3.70, abs=0.01)
    assert any("learning rate" in a for a in d.advice) and any("clip" in a for a in d.advice)
    assert any(w.startswith("divergence: the loss left its range at step 6") for w in report.findings.warnings)
    assert report.exit_code == 1
    assert not any(r.action == "loss_scale" for r in report.recommendations)  # "back-off handles it": untrue
    text = str(report)
    assert text.splitlines()[0].endswith("- divergence from step 6")
    assert DIVERGENCE_TITLE in text and DIVERGENCE_TITLE in report.to_markdown()
    assert "Divergence (not harmless" in report._repr_html_()
    assert ampdoctor.Report.from_json(report.to_json()) == report
    # the step that overflowed its forward afterwards is a persistent failure of its own, after the divergence
    assert "persistent failure from step 15: the forward was non-finite" in text


def test_the_same_loop_at_a_sane_learning_rate_only_has_harmless_skips() -> None:
    report = regression_run(lr=0.05, steps=30)
    assert report.findings.divergence is None
    skipped = [s for s in report.steps if s.skipped]
    assert [s.step for s in skipped] == [1, 7, 13] and {s.run for s in skipped} == {HARMLESS}
    assert report.verdict == "scale_overflow" and report.exit_code == 0


# -- the definitions, on hand-built records ------------------------------------------------------------------


def steps_from(losses: list[float], skipped: set[int], scale: float = 65536.0) -> list[StepRecord]:
    out = []
    for i, loss in enumerate(losses):
        new = scale / 2 if i in skipped else scale
        out.append(StepRecord(step=i, scale=scale, skipped=i in skipped, loss=loss, new_scale=new))
        scale = new
    return out


def statuses(records: list[StepRecord]) -> list[object]:
    tracker = RunTracker()
    for r in records:
        tracker.observe(r)
    return [(r.start, r.status, r.divergence.began if r.divergence else None) for r in tracker.runs]


def test_a_loss_jump_before_a_run_makes_it_a_divergence() -> None:
    flat = [2.0] * 10
    # step 10 jumps to 25 (> 10 x the median 2), steps 12-13 skip, step 14 is good again at a normal loss
    assert statuses(steps_from(flat + [25.0, 2.0, 2.0, 2.0, 2.0], {12, 13})) == [(12, PERSISTENT, 10)]
    # a jump to 19 (< 10 x 2) is in range: the same skips are harmless
    assert statuses(steps_from(flat + [19.0, 2.0, 2.0, 2.0, 2.0], {12, 13})) == [(12, HARMLESS, None)]
    # a jump more than LOOKBACK_STEPS (10) before the run is not what led into it
    assert statuses(steps_from(flat + [25.0] + [2.0] * 13, {22})) == [(22, HARMLESS, None)]


def test_a_run_that_recovers_with_the_loss_out_of_range_is_not_harmless() -> None:
    # steps 10-11 skip with a normal loss; the good step 12 that ends the run has a loss 50 x the median
    assert statuses(steps_from([2.0] * 12 + [100.0], {10, 11})) == [(10, PERSISTENT, 12)]


def test_no_range_without_history_or_with_a_non_positive_median() -> None:
    assert loss_limit(steps_from([2.0] * 4, set())) is None  # fewer than 5 losses
    assert loss_limit(steps_from([-1.0] * 8, set())) is None  # negative losses: no ratio to speak of
    assert loss_limit(steps_from([1.0, 2.0, 3.0, 4.0, 5.0], set())) == (3.0, 30.0)


def with_norms(step: StepRecord, **norms: float) -> StepRecord:
    from ampdoctor.records import FrozenMap

    return StepRecord(step=step.step, scale=step.scale, skipped=step.skipped, loss=step.loss,
                      new_scale=step.new_scale, weight_norm=FrozenMap(norms))


def test_fast_growth_counts_only_while_the_loss_rises() -> None:
    losses = [2.0] * 10 + [5.0, 5.0]  # rising (5 > 2 x 2) but never 10 x: no jump
    records = steps_from(losses, {11})
    records[0] = with_norms(records[0], head=1.0, body=1.0)
    records[11] = with_norms(records[11], head=3.0, body=1.1)  # head x3 in 11 steps: faster than x2 per 20 steps
    assert rising(records) and growth(records, 0)[0].module == "head"
    assert statuses(records) == [(11, PERSISTENT, 0)]
    falling = steps_from([2.0] * 10 + [1.0, 1.0], {11})  # the same growth while the loss falls: learning
    falling[0], falling[11] = with_norms(falling[0], head=1.0), with_norms(falling[11], head=3.0)
    assert not rising(falling) and statuses(falling) == [(11, "open", None)]
    slow = steps_from(losses, {11})
    slow[0], slow[11] = with_norms(slow[0], head=1.0), with_norms(slow[11], head=1.3)  # x1.3: not fast
    assert growth(slow, 0) == () and statuses(slow) == [(11, "open", None)]
