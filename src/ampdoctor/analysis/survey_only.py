"""What the survey alone says about loss scales, so that re-runs are spent only where they can change the answer.

Two answers come from the survey's own backward at the used scale ``2**u`` (its largest recorded gradients and the
binade histograms of every parameter gradient and of every gradient held in the low precision), without a re-run:

* :func:`underflow_evidence`: whether a reference backward at a larger scale could find gradient values lost to
  underflow at the used scale. A power-of-two scale multiplies every gradient exactly, except values that a
  rounding to the low precision flushed to zero or made subnormal; so what a larger scale ``2**t`` recovers is the
  values that lay within ``t - u`` binades *below* the flush threshold. The evidence is two-fold: (1) exact, an
  upper bound: a parameter gradient computed in the low precision can lose at most its zeros, and those are
  counted; (2) a prediction: the histograms show how many values lie within ``m = max(t - u, SKIP_MARGIN_BITS)``
  binades *above* the threshold. Gradient magnitudes spread smoothly over binades, so when that band is all but
  empty the band below it is too. A population of gradients wholly below the threshold, separated from every
  value the survey sees by more than ``m`` binades and feeding only float32-computed parameters, would escape
  (2): ``underflow_reference="always"`` runs the reference regardless.
* :func:`predicted_window`: the loss-scale window from the same records: the top by exact power-of-two arithmetic
  on the largest recorded low-precision gradient, the bottom at scale 1 when the histograms predict it with the
  wide margin the measured window already uses to skip its bottom re-run (``scale.CONFIDENT``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional, Union

from ..numbers import fmt_scale
from ..records import FormatLimits, FrozenMap, ModuleInfo, OpOverflow, PassTrace
from ..thresholds import SCALE_WINDOW_LOSS_SHARE
from .findings import ScaleWindow, WindowProbe
from .origin import param_owners
from .scale import (
    CONFIDENT,
    CONFIDENT_GRADIENTS,
    MAX_WINDOW_EXPONENT,
    Histograms,
    LossPrediction,
    exponent_of,
    low_precision_modules,
    predicted_top,
)

# The band above the flush threshold that must be all but empty (in binades, at least): a factor 256 between the
# smallest values the survey holds in numbers and the threshold.
SKIP_MARGIN_BITS = 8
# "All but empty": under this share of the parameter-gradient values, and of the low-precision gradients' values.
SKIP_SHARE = CONFIDENT * SCALE_WINDOW_LOSS_SHARE  # 0.1 %


@dataclass(frozen=True)
class SurveyEvidence:
    """Why the survey alone settles whether values are lost at the used scale (see the module docstring)."""

    scale: float  # the used scale
    top: float  # the largest finite scale, predicted from the largest recorded gradient
    low_zeros: int  # zero values of parameter gradients computed in the low precision (all they could lose)
    low_values: int  # their values
    nonzero: int  # nonzero parameter-gradient values at the used scale
    margin_bits: int  # the band above the flush threshold examined
    band_share: float  # share of parameter-gradient values predicted lost that many binades lower
    gradient_band_share: float  # the same for the gradients held in the low precision

    def note(self, low: str) -> str:
        bound = self.low_zeros / (self.nonzero + self.low_zeros) if self.nonzero + self.low_zeros else 0.0
        return (
            f"underflow reference not run (underflow_reference=\"auto\"): at scale {fmt_scale(self.scale)} the "
            f"parameter gradients computed in {low} hold {self.low_zeros:,} zero value(s) of {self.low_values:,} "
            f"(at most {bound:.3%} of the {self.nonzero:,} nonzero values could be lost there), and the binade "
            f"histograms put {self.band_share:.3%} of the parameter-gradient values and "
            f"{self.gradient_band_share:.3%} of the {low} gradients' values within {self.margin_bits} binades above "
            f"{low}'s flush threshold, so a larger scale (up to {fmt_scale(self.top)}, the largest finite predicted) "
            "could recover almost nothing; "
            "underflow_reference=\"always\" runs it (one more backward)"
        )


@dataclass(frozen=True)
class _Basis:
    """What both answers start from, worked out once per survey: the used exponent ``u``, the predicted top
    ``t``, parameter owners and the loss prediction from the survey's histograms."""

    u: int
    t: int
    owners: Mapping[str, str]
    prediction: LossPrediction
    low_modules: set[str]  # low_precision_modules(survey, limits)
    grads: list[tuple[str, Optional[int], int]]  # per parameter gradient: name, zero count (None: not counted), numel


def _basis(
    survey: PassTrace, histograms: Histograms, modules: Sequence[ModuleInfo], limits: FormatLimits
) -> Optional[_Basis]:
    """None unless the survey is healthy at a power-of-two scale, with histograms and a top within the window."""
    u = exponent_of(survey.scale)
    if u is None or not histograms or not survey.backward_ran or not survey.healthy():
        return None
    owners = param_owners(modules)
    low = low_precision_modules(survey, limits)
    t = predicted_top(survey, limits, modules, owners, low)
    if t < u or t >= MAX_WINDOW_EXPONENT:
        return None
    prediction = LossPrediction(histograms, u, _flush_exponent(limits), owners)
    grads = [(name, stats.zero_count, math.prod(stats.shape)) for name, stats in survey.param_grads().items()]
    return _Basis(u, t, owners, prediction, low, grads)


def underflow_evidence(
    survey: PassTrace, basis: _Basis, modules: Sequence[ModuleInfo], limits: FormatLimits
) -> Optional[SurveyEvidence]:
    """The evidence that a reference backward at a larger scale would find (almost) nothing lost at the survey's
    scale, or None when the survey does not show it (then the reference runs)."""
    u, t, owners, prediction = basis.u, basis.t, basis.owners, basis.prediction
    low = basis.low_modules
    nonzero = low_zeros = low_values = 0
    for name, zeros, numel in basis.grads:
        if zeros is None:
            return None  # not counted: no bound
        nonzero += numel - zeros
        if owners.get(name) in low:
            low_zeros += zeros
            low_values += numel
    if nonzero == 0 or low_zeros > SKIP_SHARE * nonzero:
        return None
    margin = max(t - u, SKIP_MARGIN_BITS)
    band = prediction.lost(u - margin) / nonzero
    gradient_band = prediction.gradient_share(u - margin)
    if band >= SKIP_SHARE or gradient_band >= SKIP_SHARE:
        return None
    return SurveyEvidence(survey.scale, 2.0**t, low_zeros, low_values, nonzero, margin, band, gradient_band)


def predicted_window(
    survey: PassTrace, basis: _Basis, modules: Sequence[ModuleInfo], limits: FormatLimits
) -> Optional[ScaleWindow]:
    """The loss-scale window from the survey alone, or None when it does not settle it (then it is measured).

    Top: the largest power of two at which the largest recorded low-precision gradient stays finite (that the next
    one overflows is exact; that this one holds assumes no unrecorded intermediate overflows first). Bottom: scale
    1, only when the histograms predict it loses under ``CONFIDENT`` of the window's 1 % and the low-precision
    gradients together under ``CONFIDENT_GRADIENTS`` of theirs (the rule the measured window uses too)."""
    t, owners, prediction = basis.t, basis.owners, basis.prediction
    if basis.u < 0:
        return None
    by_module: dict[str, int] = defaultdict(int)
    for name, zeros, numel in basis.grads:
        by_module[owners.get(name, name)] += 0 if zeros is None else numel - zeros
    total = sum(by_module.values())
    if not total or prediction.lost(0) > SKIP_SHARE * total or prediction.gradient_share(0) >= CONFIDENT_GRADIENTS:
        return None
    counts = {info.name: by_module[info.name] for info in modules if info.params and by_module.get(info.name)}
    lowest = prediction.lowest_useful(counts, t, SCALE_WINDOW_LOSS_SHARE)
    per_module = {name: 2.0**exponent for name, exponent in lowest.items()}
    return ScaleWindow(
        current=survey.scale,
        max_safe=2.0**t,
        min_useful=1.0,
        probes=(WindowProbe(2.0 ** (t + 1), False, None),),  # by arithmetic on the recorded maximum
        module_min_useful=FrozenMap(per_module),
        reference=(
            f"predicted from the survey at scale {fmt_scale(survey.scale)}, not re-run: the top by exact power-of-two "
            f"arithmetic on its largest {limits.dtype} gradient, the bottom from its binade histograms (scale 1 "
            f"predicted to lose under {SKIP_SHARE:.1%}); scale_window=True confirms both ends by re-runs"
        ),
        measured=False,
    )


def settle_from_survey(
    survey: PassTrace,
    histograms: Histograms,
    modules: Sequence[ModuleInfo],
    limits: FormatLimits,
    policy: str,
    fp32_reference: bool,
    window_wanted: Union[bool, str],
) -> tuple[Optional[ScaleWindow], str]:
    """What the survey settles alone, for a survey with finite gradients: the loss-scale window predicted without a
    re-run (None: measure it, or not wanted), and the note that stands in for the underflow reference ("": run
    it). ``policy``: ``diagnose``'s ``underflow_reference``; ``window_wanted``: its ``scale_window`` (False when the
    window is deferred)."""

    def predict(basis: Optional[_Basis]) -> Optional[ScaleWindow]:
        if window_wanted != "auto" or basis is None:
            return None
        return predicted_window(survey, basis, modules, limits)

    if policy == "never":
        return predict(_basis(survey, histograms, modules, limits)), (
            'underflow reference not run (underflow_reference="never"): gradient values lost to underflow at the '
            "used scale are not counted"
        )
    if policy == "always" or fp32_reference or window_wanted is True:
        return None, ""  # a measured window's first re-run is the reference's backward anyway
    basis = _basis(survey, histograms, modules, limits)  # once, for both answers
    evidence = underflow_evidence(survey, basis, modules, limits) if basis is not None else None
    if evidence is None:
        return None, ""
    window = predict(basis)
    if window is None and window_wanted:
        return None, ""  # the measured window's first re-run is the reference's backward: it costs nothing more
    return window, evidence.note(limits.dtype)


def deferred_window_note(hidden: Sequence[OpOverflow]) -> str:
    """The note for a loss-scale window left out because the forward makes inf/NaN that a later op hides."""
    ops = ", ".join(dict.fromkeys(f"{o.label} ({o.op})" for o in hidden))
    return (
        f"loss-scale window not measured: the forward makes inf/NaN that a later op hides ({ops}), so this step's "
        "gradients change with the remedy; diagnose again after applying it, or pass scale_window=True to measure "
        "it on this step"
    )


def _flush_exponent(limits: FormatLimits) -> int:
    return math.floor(math.log2(limits.flush_threshold))
