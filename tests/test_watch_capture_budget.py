"""When the watch's captures of a kind run out (``max_captures``), the report says so, once, naming the first step
left uncaptured: it must not read as if every failure was captured."""

from __future__ import annotations

from typing import Any

from torch import nn

from ampdoctor.records import StepRecord
from ampdoctor.training.failures import FailureTracker


def _tracker(max_captures: int, notes: list[str]) -> FailureTracker:
    return FailureTracker(root=nn.Identity(), max_captures=max_captures, save_bundle=False, bundle_dir=None, rank=0,
                          world_size=1, scaler=None, note=notes.append)


def _plan_all(tracker: FailureTracker, pattern: str) -> list[Any]:
    """``g`` a good step, ``s`` a skipped one with a finite forward (as tests/test_watch_runs.py writes them)."""
    scale, plans = 65536.0, []
    micro: list[Any] = [object()]  # the step's recorded forward (a capture needs one)
    for step, kind in enumerate(pattern):
        new = scale / 2 if kind == "s" else scale
        plan = tracker.plan(StepRecord(step=step, scale=scale, skipped=kind == "s", new_scale=new), micro)
        if plan.capture:
            tracker.used[plan.kind] += 1  # what execute() counts for a capture it ran
        plans.append(plan)
        scale = new
    return plans


def test_the_first_step_left_uncaptured_is_named_once() -> None:
    notes: list[str] = []
    plans = _plan_all(_tracker(1, notes), "ggsgggsggsgg")
    assert [p.record.step for p in plans if p.capture] == [2]
    assert notes == [
        "step 6 was not captured: the 1 captures of runs of skipped steps (max_captures) were spent; later ones "
        "are counted, not captured (watch(..., max_captures=N) keeps more)"
    ]


def test_captures_switched_off_say_so_once() -> None:
    notes: list[str] = []
    _plan_all(_tracker(0, notes), "ggsgggsgg")
    assert notes == ["step 2 was not captured (max_captures=0): runs of skipped steps are counted, not captured"]


def test_no_note_while_captures_are_left() -> None:
    notes: list[str] = []
    plans = _plan_all(_tracker(8, notes), "ggsgggsgg")
    assert [p.record.step for p in plans if p.capture] == [2, 6] and notes == []
