"""Divergence told apart from a harmless scale overflow (pure: step records in, records out; no torch).

The definitions, used by the run logic (:mod:`.runs`) and stated in the README:

* a step's loss is **in range** unless it is finite and more than ``LOSS_JUMP_FACTOR`` (10) times the median of
  the finite losses of the (up to) ``LOSS_MEDIAN_STEPS`` (20) steps before it; with fewer than
  ``LOSS_MIN_HISTORY`` (5) such losses, or a median <= 0, there is no range yet. (A non-finite loss is a
  non-finite forward: a persistent failure of its own.)
* a module's weights (the norm of its own parameters) or low-precision activations (their largest |x|) **grow
  fast** between two samples when they at least doubled (activations: grew ``ACTIVATION_MIN_FACTOR``, 4x,
  since they vary with the batch), at least as fast as doubling every ``GROWTH_DOUBLING_STEPS`` (20) steps;
* a run of bad steps is a **divergence** when a loss left its range from ``LOOKBACK_STEPS`` (10) steps before the
  run on, or when the loss is *rising* (above ``LOSS_RISE_FACTOR`` (2) times its recent median) while some module
  grew fast between samples taken from ``GROWTH_WINDOW_STEPS`` (100) steps before the run on. (Growth alone is
  no divergence: early in training an output layer grows fast while the loss falls.)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Optional

from ..analysis import Divergence, Growth
from ..analysis.findings import GrowthKind
from ..records import StepRecord
from ..report.document import divergence_lines

LOSS_JUMP_FACTOR = 10.0
LOSS_MEDIAN_STEPS = 20
LOSS_MIN_HISTORY = 5
LOOKBACK_STEPS = 10
LOSS_RISE_FACTOR = 2.0
WEIGHT_MIN_FACTOR = 2.0
ACTIVATION_MIN_FACTOR = 4.0
GROWTH_DOUBLING_STEPS = 20
GROWTH_WINDOW_STEPS = 100
# Modules named per kind of growth.
GROWTH_NAMED = 3

ADVICE = (
    "lower the learning rate (or the peak of its schedule)",
    "warm the learning rate up over the first hundreds of steps",
    "clip gradients: scaler.unscale_(optimizer); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) before "
    "scaler.step(optimizer)",
    "normalise where it grows: a LayerNorm/RMSNorm before the layers named here, or weight decay on them",
)


def loss_limit(previous: Sequence[StepRecord]) -> Optional[tuple[float, float]]:
    """(median, upper end of the range) from the steps before a step (oldest first); None: no range yet."""
    losses = [s.loss for s in previous[-LOSS_MEDIAN_STEPS:] if s.loss is not None and math.isfinite(s.loss)]
    if len(losses) < LOSS_MIN_HISTORY:
        return None
    median = statistics.median(losses)
    return (median, LOSS_JUMP_FACTOR * median) if median > 0 else None


def out_of_range(loss: Optional[float], limit: Optional[tuple[float, float]]) -> bool:
    """A finite loss above the range (a non-finite loss is a non-finite forward: a failure of its own, not a sign
    of one to come)."""
    if loss is None or limit is None or not math.isfinite(loss):
        return False
    return loss > limit[1]


def rising(history: Sequence[StepRecord]) -> bool:
    """The latest finite loss is above ``LOSS_RISE_FACTOR`` times the median of the ones before it."""
    finite = [s for s in history if s.loss is not None and math.isfinite(s.loss)]
    if not finite:
        return False
    limit = loss_limit(finite[:-1])
    return limit is not None and finite[-1].loss is not None and finite[-1].loss > LOSS_RISE_FACTOR * limit[0]


def fast(kind: GrowthKind, before: float, after: float, span: int) -> bool:
    if span <= 0 or before <= 0 or not math.isfinite(before):
        return False
    factor = after / before if math.isfinite(after) else math.inf
    least = WEIGHT_MIN_FACTOR if kind == "weights" else ACTIVATION_MIN_FACTOR
    return factor >= least and factor >= 2.0 ** (span / GROWTH_DOUBLING_STEPS)


def growth(samples: Sequence[StepRecord], since: int) -> tuple[Growth, ...]:
    """Modules that grew fast between samples from step ``since`` on (oldest first), fastest first per kind."""
    found: list[tuple[float, Growth]] = []
    kept = [s for s in samples if s.step >= since]
    for kind in ("weights", "activations"):
        best: dict[str, tuple[float, Growth]] = {}
        for i, late in enumerate(kept):
            for early in kept[:i]:
                span = late.step - early.step
                a, b = _values(early, kind), _values(late, kind)
                for module, after in b.items():
                    before = a.get(module)
                    if before is None or not fast(kind, before, after, span):  # type: ignore[arg-type]
                        continue
                    rate = math.log2(after / before) / span if math.isfinite(after) else math.inf
                    g = Growth(module, kind, before, after, early.step, late.step)  # type: ignore[arg-type]
                    if module not in best or rate > best[module][0]:
                        best[module] = (rate, g)
        found += sorted(best.values(), key=lambda rg: -rg[0])[:GROWTH_NAMED]
    return tuple(g for _, g in found)


def _values(step: StepRecord, kind: str) -> dict[str, float]:
    return dict(step.weight_norm if kind == "weights" else step.out_abs_max)


def detect(
    history: Sequence[StepRecord], samples: Sequence[StepRecord], jumps: Sequence[tuple[int, float, float]],
    run_start: int, now: StepRecord,
) -> Optional[Divergence]:
    """The divergence that led into the run of bad steps starting at ``run_start``, as known at step ``now``.

    ``history``: recent steps up to ``now`` (oldest first); ``samples``: steps with weight norms or activations
    (:func:`has_values`), ``now`` included when it has them; ``jumps``: (step, loss, median) of the losses
    that left their range.
    """
    jump = next((j for j in jumps if run_start - LOOKBACK_STEPS <= j[0] <= now.step), None)
    grown = growth(samples, run_start - GROWTH_WINDOW_STEPS)
    if jump is None and not (grown and rising(history)):
        return None
    began = jump[0] if jump is not None else min(g.from_step for g in grown)
    losses = [(s.loss, s.step) for s in history if s.step >= began and s.loss is not None]
    peak = max(losses, key=lambda ls: ls[0] if math.isfinite(ls[0]) else math.inf, default=None)
    return Divergence(
        began=began,
        skipped_from=run_start,
        loss_median=jump[2] if jump is not None else None,
        loss_peak=peak[0] if peak is not None else None,
        peak_step=peak[1] if peak is not None else None,
        growth=grown,
        advice=ADVICE,
    )


def has_values(step: StepRecord) -> bool:
    """The step carries weight norms or activation maxima (a sample for :func:`growth`)."""
    return bool(step.weight_norm) or bool(step.out_abs_max)


def summary(d: Divergence) -> str:
    """What happened, in one line that starts with the stable name ``divergence``."""
    return "divergence: " + "; ".join(divergence_lines(d))
