"""Runs of bad training steps: harmless, persistent or still open (pure: records in, records out; no torch).

A *bad* step is a skipped one (GradScaler found inf/NaN), one whose forward was non-finite, or, without a
GradScaler, one whose gradients held inf/NaN. Consecutive bad steps form a run (ARCHITECTURE.md §2):

* **persistent** as soon as one of its steps has a non-finite forward, non-finite gradients that no scaler
  skipped (the optimizer applies them), a skip takes the scale below 1 (the
  gradients are non-finite even unscaled), or a divergence led into it (:mod:`.divergence`: the loss left its
  range, or a layer's weights or activations grew fast, shortly before; GradScaler backing off fixes none of
  these);
* **harmless** when it *recovered* — a good step (not skipped, finite forward, at a scale >= 1) ended it — and
  the loss stayed *in range* throughout, that good step included (GradScaler did its job);
* **open** while neither happened yet.

The scaler's **first back-off** is expected: GradScaler starts at a scale (65536) that is usually too high and
halves it on each skip until the gradients fit. A run that starts before the first good step, with a finite
forward, is therefore not captured at its start (a capture replays ``diagnose``: seconds at step 0 for nothing);
it is still captured the moment it turns persistent (a non-finite forward, the scale below 1, a divergence).

:class:`RunTracker` folds a stream of :class:`~ampdoctor.records.StepRecord` into runs and says which steps a
capture should explain; the functions below merge the runs of several ranks and annotate steps with them.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Optional

from ..analysis import Divergence, ScaleFinding, ScaleProbe
from ..numbers import fmt_scale
from ..records import RunStatus, StepRecord
from .divergence import (
    GROWTH_WINDOW_STEPS,
    LOOKBACK_STEPS,
    LOSS_MEDIAN_STEPS,
    detect,
    has_values,
    loss_limit,
    out_of_range,
    summary,
)

HARMLESS: RunStatus = "harmless"
PERSISTENT: RunStatus = "persistent"
OPEN: RunStatus = "open"

# Runs of bad steps remembered (the first persistent one is always kept).
MAX_RUNS_KEPT = 1000
# Samples (steps with weight norms or activations) and loss jumps remembered for divergence detection.
MAX_SAMPLES_KEPT = 64
MAX_JUMPS_KEPT = 16

# Gravity of a run's status: with several ranks a step gets the gravest verdict any rank gave it.
SEVERITY: dict[RunStatus, int] = {HARMLESS: 0, OPEN: 1, PERSISTENT: 2}

# Why a step deserves a full capture: it starts a run, or it is where the run turned persistent. Each kind has
# its own budget (``max_captures``), so a long training run of harmless skips cannot spend the persistent one.
CaptureKind = Literal["run_start", "persistent"]


@dataclass(frozen=True)
class Run:
    """A run of consecutive bad steps (skipped, or with a non-finite forward)."""

    start: int
    end: Optional[int] = None  # the last bad step, once a good step ended the run
    status: RunStatus = OPEN
    persistent_step: Optional[int] = None  # the step that made it persistent
    reason: str = ""  # why it is persistent
    skips: int = 0  # skipped steps in the run (a non-finite forward without a skip counts as bad, not skipped)
    capture_step: Optional[int] = None  # the step whose capture explains the run so far
    harmless_scale: Optional[float] = None  # the scale of the good step that ended a harmless run
    divergence: Optional[Divergence] = None  # the divergence that led into it (then it is persistent)


@dataclass(frozen=True)
class Observed:
    """What one step did to the runs."""

    run: Optional[Run]  # the run a bad step belongs to (as updated by it); None for a good step
    capture: Optional[CaptureKind] = None  # this step should be captured, and why
    ended: Optional[Run] = None  # the run a good step ended


def is_bad(step: StepRecord) -> bool:
    return step.skipped or not step.forward_finite or not step.grads_finite


def persistent_reason(step: StepRecord) -> str:
    """Why this bad step makes its run persistent, or ``""`` when it does not."""
    if not step.forward_finite:
        return "the forward was non-finite (loss or model output)"
    if step.unguarded:
        first = f" ({', '.join(step.nonfinite_params[:3])}{' ...' if len(step.nonfinite_params) > 3 else ''})"
        return (
            f"parameter gradients were non-finite{first if step.nonfinite_params else ''} with no GradScaler to "
            "skip the step (unless the loop skips it itself, the optimizer applies them)"
        )
    if step.skipped and step.new_scale is not None and step.new_scale < 1:
        return f"the scale fell below 1 ({fmt_scale(step.new_scale)}): gradients are non-finite even unscaled"
    return ""


class RunTracker:
    """Folds steps, in order, into runs of bad steps (and remembers what divergence detection needs)."""

    def __init__(self, max_kept: int = MAX_RUNS_KEPT) -> None:
        self._runs: list[Run] = []
        self._open = False  # the last run in ``_runs`` is still going
        self._max_kept = max(2, max_kept)
        self._history: deque[StepRecord] = deque(maxlen=LOSS_MEDIAN_STEPS + LOOKBACK_STEPS + 1)
        self._samples: deque[StepRecord] = deque(maxlen=MAX_SAMPLES_KEPT)
        self._jumps: deque[tuple[int, float, float]] = deque(maxlen=MAX_JUMPS_KEPT)  # (step, loss, median)
        self._good_seen = False  # a good step was seen: a run from now on is no first back-off

    @property
    def runs(self) -> tuple[Run, ...]:
        return tuple(self._runs)

    @property
    def open_run(self) -> Optional[Run]:
        return self._runs[-1] if self._open else None

    @property
    def last_jump(self) -> Optional[int]:
        """The last step whose loss left its range."""
        return self._jumps[-1][0] if self._jumps else None

    def _remember(self, step: StepRecord) -> None:
        limit = loss_limit(list(self._history))
        if out_of_range(step.loss, limit) and limit is not None and step.loss is not None:
            self._jumps.append((step.step, step.loss, limit[0]))
        self._history.append(step)
        if has_values(step):
            self._samples.append(step)
        while self._samples and self._samples[0].step < step.step - GROWTH_WINDOW_STEPS - LOOKBACK_STEPS:
            self._samples.popleft()

    def _divergence(self, run: Run, step: StepRecord) -> Optional[Divergence]:
        return detect(list(self._history), list(self._samples), list(self._jumps), run.start, step)

    def observe(self, step: StepRecord) -> Observed:
        self._remember(step)
        if not is_bad(step):
            self._good_seen = True
            if not self._open:
                return Observed(None)
            run = self._runs[-1]
            ended = dataclasses.replace(run, end=step.step - 1)
            if run.status == OPEN:  # recovered (finite forward, scale >= 1: else it would be persistent) ...
                diverged = self._divergence(run, step)  # ... with the loss in range throughout?
                if diverged is not None:
                    ended = _diverged(ended, step.step, diverged)
                else:
                    ended = dataclasses.replace(ended, status=HARMLESS, harmless_scale=step.scale)
            self._runs[-1] = ended
            self._open = False
            return Observed(None, ended=ended)
        capture: Optional[CaptureKind] = None
        if not self._open:
            if len(self._runs) >= self._max_kept:  # forget the oldest, but never the first persistent run
                self._runs.pop(1 if self._runs[0].status == PERSISTENT else 0)
            self._runs.append(Run(start=step.step))
            self._open = True
            # the scaler's first back-off (no good step yet, a finite forward) is expected: no capture for it
            capture = "run_start" if self._good_seen or not step.forward_finite else None
        run = dataclasses.replace(self._runs[-1], skips=self._runs[-1].skips + int(step.skipped))
        if run.status != PERSISTENT:
            diverged = self._divergence(run, step)
            reason = persistent_reason(step)
            if reason:
                run = dataclasses.replace(run, status=PERSISTENT, persistent_step=step.step, reason=reason,
                                          divergence=diverged)
                capture = "persistent"
            elif diverged is not None:
                run = _diverged(run, step.step, diverged)
                capture = "persistent"
        self._runs[-1] = run
        return Observed(run, capture)

    def explained_by(self, step: int) -> Run:
        """The open run is explained by the capture of ``step`` from now on."""
        if not self._open:
            raise ValueError("no open run")
        self._runs[-1] = dataclasses.replace(self._runs[-1], capture_step=step)
        return self._runs[-1]


def _diverged(run: Run, step: int, divergence: Divergence) -> Run:
    return dataclasses.replace(
        run, status=PERSISTENT, persistent_step=step, reason=summary(divergence), divergence=divergence
    )


def track(steps: Iterable[StepRecord]) -> tuple[Run, ...]:
    """The runs of a sequence of steps (one rank, in order)."""
    tracker = RunTracker()
    for step in steps:
        tracker.observe(step)
    return tracker.runs


# -- several ranks --------------------------------------------------------------------------------------------


def merged_runs(runs: Iterable[Run]) -> list[Run]:
    """Ranks skip together (the gradients are reduced): one run per start step, with the gravest status."""
    by_start: dict[int, Run] = {}
    for r in runs:
        seen = by_start.get(r.start)
        if seen is None or SEVERITY[r.status] > SEVERITY[seen.status]:
            by_start[r.start] = r
    return [by_start[k] for k in sorted(by_start)]


def annotate(steps: Sequence[StepRecord], runs: Iterable[Run]) -> list[StepRecord]:
    """Each bad step gets the status of the run it is in; with several ranks' runs, the gravest one."""
    status: dict[int, RunStatus] = {}
    bad_steps = {s.step for s in steps if is_bad(s)}
    for run in runs:
        last = run.end if run.end is not None else math.inf
        for step in bad_steps:
            if run.start <= step <= last and (step not in status or SEVERITY[run.status] >= SEVERITY[status[step]]):
                status[step] = run.status
    return [dataclasses.replace(s, run=status[s.step]) if s.step in status else s for s in steps]


def scale_from_runs(runs: Iterable[Run]) -> Optional[ScaleFinding]:
    """A loss-scale finding from training alone: the first harmless run skipped at a scale, and training was
    good again at a lower one (each skip halves the scale: the first skip was at ``good * 2**skips``)."""
    ended = [r for r in runs if r.status == HARMLESS and r.harmless_scale is not None]
    if not ended:
        return None
    r = ended[0]
    good = float(r.harmless_scale or 1.0)
    used = good * 2.0 ** max(1, r.skips)
    return ScaleFinding(used, (ScaleProbe(good, True), ScaleProbe(used, False)), good, None, used)
