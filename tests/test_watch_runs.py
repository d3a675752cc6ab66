"""The run logic of the watch (``ampdoctor.training.runs``) on hand-built step sequences: no torch, no model.

Notation of the sequences below: ``g`` a good step, ``s`` a skipped step with a finite forward, ``f`` a step
whose forward was non-finite (and skipped), ``d`` a skip that took the scale below 1. Each step halves the scale
on a skip, as GradScaler does.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ampdoctor.records import StepRecord
from ampdoctor.training.runs import (
    HARMLESS,
    OPEN,
    PERSISTENT,
    Observed,
    Run,
    RunTracker,
    annotate,
    merged_runs,
    persistent_reason,
    scale_from_runs,
    track,
)


def steps(pattern: str, scale: float = 65536.0, rank: int = 0, first: int = 0) -> list[StepRecord]:
    """Step records for a pattern of g/s/f/d letters (see the module docstring)."""
    out = []
    for i, kind in enumerate(pattern):
        skipped = kind != "g"
        new = 0.5 if kind == "d" else (scale / 2 if skipped else scale)
        out.append(StepRecord(
            step=first + i, scale=scale, skipped=skipped, forward_finite=kind != "f", new_scale=new, rank=rank
        ))
        scale = new
    return out


def observe_all(pattern: str, **kwargs: float) -> tuple[RunTracker, list[Observed]]:
    tracker = RunTracker()
    return tracker, [tracker.observe(s) for s in steps(pattern, **kwargs)]


def test_a_run_ended_by_a_good_step_is_harmless_at_the_good_steps_scale() -> None:
    tracker, seen = observe_all("gssgg")
    # 65536 good, 65536 skip, 32768 skip, 16384 good
    assert [o.capture for o in seen] == [None, "run_start", None, None, None]
    assert seen[0] == Observed(None) and seen[4] == Observed(None)
    assert seen[2].run == Run(start=1, skips=2)
    expected = Run(start=1, end=2, status=HARMLESS, skips=2, harmless_scale=16384.0)
    assert seen[3].ended == expected and seen[3].run is None
    assert tracker.runs == (expected,) and tracker.open_run is None


def test_a_non_finite_forward_makes_the_run_persistent_and_asks_for_a_second_capture() -> None:
    tracker, seen = observe_all("gsfsg")
    assert [o.capture for o in seen] == [None, "run_start", "persistent", None, None]
    reason = "the forward was non-finite (loss or model output)"
    assert seen[2].run == Run(start=1, status=PERSISTENT, persistent_step=2, reason=reason, skips=2)
    # the good step ends it, but a persistent run stays persistent (no harmless scale)
    assert tracker.runs == (Run(start=1, end=3, status=PERSISTENT, persistent_step=2, reason=reason, skips=3),)


def test_a_run_that_starts_with_a_non_finite_forward_is_captured_once_as_persistent() -> None:
    _, seen = observe_all("fg")
    assert [o.capture for o in seen] == ["persistent", None]


def test_a_skip_that_takes_the_scale_below_1_is_persistent() -> None:
    tracker, seen = observe_all("ssd", scale=4.0)  # 4 -> 2 -> 1 -> 0.5
    # no good step yet: the scaler's first back-off is not captured, until it turns persistent
    assert [o.capture for o in seen] == [None, None, "persistent"]
    assert tracker.open_run == Run(
        start=0, status=PERSISTENT, persistent_step=2, skips=3,
        reason="the scale fell below 1 (0.5): gradients are non-finite even unscaled",
    )
    assert persistent_reason(steps("s")[0]) == ""  # an ordinary skip is no reason


def test_a_run_still_going_is_open() -> None:
    tracker, _ = observe_all("gss")
    assert tracker.runs == (Run(start=1, skips=2, status=OPEN),) and tracker.open_run == tracker.runs[0]


def test_a_non_finite_forward_without_a_skip_is_bad_too() -> None:
    """bfloat16 without a scaler: nothing is skipped, the forward alone says the step failed."""
    record = StepRecord(step=0, scale=1.0, skipped=False, forward_finite=False, new_scale=1.0)
    tracker = RunTracker()
    assert tracker.observe(record).capture == "persistent"
    assert tracker.runs[0].skips == 0 and tracker.runs[0].status == PERSISTENT


def test_later_skips_point_at_the_capture_of_their_run() -> None:
    tracker = RunTracker()
    first, second = steps("ss")
    tracker.observe(first)
    assert tracker.explained_by(0).capture_step == 0
    assert tracker.observe(second).run == Run(start=0, skips=2, capture_step=0)
    tracker.observe(steps("g", first=2)[0])
    with pytest.raises(ValueError, match="no open run"):
        tracker.explained_by(2)


def test_runs_kept_are_bounded_and_the_first_persistent_one_stays() -> None:
    tracker = RunTracker(max_kept=3)
    for s in steps("fg" + "sg" * 4):  # persistent run at 0, then harmless runs at 2, 4, 6, 8
        tracker.observe(s)
    assert [(r.start, r.status) for r in tracker.runs] == [(0, PERSISTENT), (6, HARMLESS), (8, HARMLESS)]


def test_merged_runs_keep_the_gravest_status_per_start() -> None:
    rank0 = track(steps("gssg"))  # harmless run from step 1
    rank1 = track(steps("gsfg"))  # persistent run from step 1
    rank1_late = track(steps("gggs"))  # open run from step 3
    merged = merged_runs([*rank0, *rank1, *rank1_late])
    assert [(r.start, r.status) for r in merged] == [(1, PERSISTENT), (3, OPEN)]


def test_annotate_gives_each_bad_step_the_gravest_verdict_of_any_rank() -> None:
    rank0, rank1 = steps("gssgs", rank=0), steps("gsfgs", rank=1)
    records = sorted(rank0 + rank1, key=lambda s: (s.step, s.rank))
    for runs in ([*track(rank0), *track(rank1)], [*track(rank1), *track(rank0)]):  # whatever order they come in
        annotated = annotate(records, runs)
        by_rank = {r: [s.run for s in annotated if s.rank == r] for r in (0, 1)}
        assert by_rank[0] == [None, PERSISTENT, PERSISTENT, None, OPEN]  # rank 1 made steps 1-2 persistent
        assert by_rank[1] == [None, PERSISTENT, PERSISTENT, None, OPEN]


def test_the_loss_scale_finding_from_training_alone() -> None:
    """Two skips (65536, 32768), good again at 16384: the first skip was at 16384 * 2**2."""
    finding = scale_from_runs(track(steps("gssg")))
    assert finding is not None
    assert finding.largest_finite_scale == 16384.0 and finding.used_scale == 65536.0
    assert [(p.scale, p.gradients_finite) for p in finding.probes] == [(16384.0, True), (65536.0, False)]
    assert scale_from_runs(track(steps("gsf"))) is None  # no harmless run: nothing learned about the scale


def test_the_run_logic_imports_no_torch() -> None:
    code = (
        "import sys, json\n"
        "sys.modules['torch'] = None  # any import of torch now fails loudly\n"
        "from ampdoctor.records import StepRecord\n"
        "from ampdoctor.training.runs import track\n"
        "runs = track([StepRecord(step=0, scale=2.0, skipped=True, new_scale=1.0),\n"
        "              StepRecord(step=1, scale=1.0, skipped=False, new_scale=1.0)])\n"
        "print(json.dumps([r.status for r in runs]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [HARMLESS]
