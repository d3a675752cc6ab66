"""Re-runs at other loss scales that turn single passes into findings: predicted first, then confirmed.

No torch here: everything goes through a ``Runner`` that the caller builds around the live model, so each
(scale, autocast) pass runs at most once per diagnosis. Multiplying the loss by a power of two multiplies every
gradient by it exactly, except near the subnormal range. So the top of the loss-scale window follows from the
largest recorded gradient, and the bottom from binade histograms of the parameter gradients of one backward;
re-runs only confirm the two ends (and correct a prediction that a probe contradicts). Finiteness is assumed
monotone in the scale, and losses to underflow are assumed to only shrink as it grows.

Lost gradient values are counted against the largest finite scale of the low-precision format (the same
dtype, the same forward): what any loss scale could still keep. Values too small for the format at every
scale are visible only against a float32 backward, which the caller may allow (``allow_fp32``).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Optional

from ..numbers import fmt_scale
from ..records import FormatLimits, FrozenMap, ModuleInfo, PassTrace
from ..thresholds import SCALE_WINDOW_LOSS_SHARE
from .findings import ScaleFinding, ScaleProbe, ScaleWindow, UnderflowFinding, WindowProbe
from .origin import param_owners
from .prediction import Histograms as Histograms
from .prediction import LossPrediction as LossPrediction
from .underflow import lost_gradients

# Scales above 2**MAX_WINDOW_EXPONENT are never probed (fp16 spans 40 bits from subnormal to max).
MAX_WINDOW_EXPONENT = 40
FP32_REFERENCE = "float32 backward (autocast off)"
# A bottom predicted at scale 1 needs no re-run when its predicted loss is under this share of the window's 1 % and
# the low-precision gradients together lose under CONFIDENT_GRADIENTS of their values there (a gradient that loses
# more, such as a flushed loss gradient, loses values before any parameter histogram can see it; measured on a
# transformer: 7.7 % of the activation gradients' values flushed at a scale where 3 % of the parameter-gradient
# values were lost).
CONFIDENT = 0.1
CONFIDENT_GRADIENTS = 0.01
# Elsewhere a scale is predicted useless once the low-precision gradients lose this share (a bottom predicted a
# little low costs one re-run up, one predicted high is kept: the side not re-run stays predicted).
GRADIENTS_LOSING = 0.1
# run(scale, autocast, histograms): one pass; the histograms only when asked for (they cost a pass over the gradients)
RunFn = Callable[[float, bool, bool], tuple[PassTrace, Histograms]]


class Runner:
    """Survey-level passes keyed by (scale, autocast): each is run once, then served from memory with the binade
    histograms of its parameter gradients."""

    def __init__(self, run: RunFn, allow_fp32: bool) -> None:
        self._run = run
        self._cache: dict[tuple[float, bool], tuple[PassTrace, Histograms]] = {}
        self.allow_fp32 = allow_fp32
        self.top: Optional[tuple[int, bool]] = None  # (exponent of the largest finite scale, next one measured)

    def __call__(self, scale: float, histograms: bool = False) -> PassTrace:
        return self._get(scale, True, histograms)[0]

    def _get(self, scale: float, autocast: bool, histograms: bool = False) -> tuple[PassTrace, Histograms]:
        key = (scale, autocast)
        if key not in self._cache:
            self._cache[key] = self._run(scale, autocast, histograms)
        return self._cache[key]

    def histograms(self, scale: float) -> Histograms:
        return self._get(scale, True)[1]

    def seed(self, trace: PassTrace, histograms: Histograms) -> None:
        self._cache.setdefault((trace.scale, True), (trace, histograms))

    def fp32(self) -> Optional[PassTrace]:
        """The same step with autocast off: the ground truth of which gradient values are nonzero."""
        if not self.allow_fp32:
            return None
        trace = self._get(1.0, False, True)[0]
        return trace if trace.gradients_finite() else None

    def fp32_histograms(self) -> Histograms:
        return self._get(1.0, False)[1] if self.fp32() is not None else {}

    def finite(self, scale: float, histograms: bool = False) -> bool:
        return self(scale, histograms).healthy()

    def measured(self, scale: float) -> bool:
        return (scale, True) in self._cache

    def runs(self) -> list[PassTrace]:
        return [trace for (_, autocast), (trace, _) in self._cache.items() if autocast]


def bisect_exponents(holds: int, fails: int, predicate: Callable[[int], bool]) -> tuple[int, int]:
    """Narrow a monotone predicate known to hold at ``holds`` and fail at ``fails`` (either order) down to two
    neighbouring exponents; returns (the one where it holds, the one where it fails)."""
    while abs(holds - fails) > 1:
        mid = (holds + fails) // 2
        if predicate(mid):
            holds = mid
        else:
            fails = mid
    return holds, fails


def exponent_of(scale: float) -> Optional[int]:
    """``e`` when ``scale == 2**e``, else None."""
    mantissa, exponent = math.frexp(scale)
    return exponent - 1 if mantissa == 0.5 else None


def low_precision_modules(trace: PassTrace, limits: FormatLimits) -> set[str]:
    """The modules with a call returning a tensor in the low precision: their parameter gradients are computed in it
    (a Linear under autocast: its weight gradient is the float16 result of a matmul, cast to float32 after)."""
    low = limits.dtype
    found: set[str] = set()
    for c in trace.calls:
        for r in c.outputs:
            if r.stats.dtype == low:
                found.add(c.module)
                break
    return found


def predicted_top(
    trace: PassTrace,
    limits: FormatLimits,
    modules: Sequence[ModuleInfo] = (),
    owners: Optional[Mapping[str, str]] = None,
    low_modules: Optional[set[str]] = None,
) -> int:
    """The exponent of the largest power-of-two scale at which the largest recorded low-precision gradient of
    ``trace`` stays below the overflow threshold (exact: a power of two scales it exactly).

    Low-precision gradients are those held in the format, and the parameter gradients of modules that ran in it
    (a Linear under autocast: its weight gradient is the float16 result of a matmul, cast to float32 after).
    ``owners`` (``param_owners(modules)``) and ``low_modules`` (``low_precision_modules``): when the caller has
    them already.
    """
    if low_modules is None:
        low_modules = low_precision_modules(trace, limits)
    if owners is None:
        owners = param_owners(modules)
    largest = 0.0
    dtype = limits.dtype
    for e in trace.grad_events:
        low = e.stats.dtype == dtype or (e.kind == "param" and owners.get(e.param or "") in low_modules)
        if low:
            abs_max = e.stats.abs_max
            if abs_max and abs_max > largest:
                largest = abs_max
    if largest == 0 or not math.isfinite(largest):
        return MAX_WINDOW_EXPONENT
    exponent = math.floor(math.log2(limits.overflow_threshold / largest))
    while largest * 2.0**exponent >= limits.overflow_threshold:
        exponent -= 1
    while largest * 2.0 ** (exponent + 1) < limits.overflow_threshold:
        exponent += 1
    return max(0, min(MAX_WINDOW_EXPONENT, exponent))


def find_top(
    runner: Runner,
    base: PassTrace,
    limits: FormatLimits,
    modules: Sequence[ModuleInfo],
    known_bad: Optional[int] = None,
) -> Optional[int]:
    """The exponent of the largest finite power-of-two scale, from ``base`` (a finite backward) by arithmetic,
    confirmed by one re-run there (more only when an unrecorded intermediate overflows first). ``known_bad``: an
    exponent already seen non-finite. None when not even scale 1 is finite."""
    if runner.top is not None:
        return runner.top[0]
    guess = predicted_top(base, limits, modules)
    if known_bad is not None:
        guess = min(guess, known_bad - 1)
    base_exponent = exponent_of(base.scale) if base.healthy() else None
    if guess < 0:
        return None
    # The top's backward is the reference for what any scale keeps: its histograms predict the bottom.
    if runner.finite(2.0**guess, histograms=True):
        top, next_measured = guess, known_bad == guess + 1
    else:
        holds = base_exponent if base_exponent is not None and base_exponent < guess else -1
        if holds < 0 and guess > 0 and runner.finite(1.0, histograms=True):
            holds = 0
        if holds < 0:
            runner.top = (-1, True)
            return None
        top, _ = bisect_exponents(holds, guess, lambda e: runner.finite(2.0**e, histograms=True))
        next_measured = True
    runner.top = (top, next_measured)
    return top


def _reference_name(runner: Runner, top: Optional[int]) -> str:
    same = f"backward at scale {fmt_scale(2.0**top)}, the largest finite" if top is not None else ""
    if runner.fp32() is not None:
        return f"a {FP32_REFERENCE} and the {same}" if same else FP32_REFERENCE
    return same


def _references(runner: Runner, top: Optional[int]) -> list[PassTrace]:
    refs = [runner(2.0**top)] if top is not None else []
    fp32 = runner.fp32()
    return refs + ([fp32] if fp32 is not None else [])


def probe_scales(runner: Runner, survey: PassTrace, modules: list[ModuleInfo], limits: FormatLimits) -> ScaleFinding:
    """The largest power-of-two scale >= 1 below the used one with finite gradients: a re-run at 1 (finite there
    or a real defect), the top predicted from it, confirmed by a re-run."""
    used = survey.scale
    runner.seed(survey, {})
    if used <= 1:
        return ScaleFinding(used, (), None, None, used)
    if not runner.finite(1.0):
        return ScaleFinding(used, (ScaleProbe(1.0, False),), None, None, 1.0)
    bad = math.ceil(math.log2(used))  # 2**bad >= used: known (or assumed) non-finite
    top = find_top(runner, runner(1.0), limits, modules, known_bad=bad)
    assert top is not None
    best = runner(2.0**top)
    lost = lost_gradients(best, _references(runner, top), modules, _reference_name(runner, top))
    probes = sorted(
        {ScaleProbe(t.scale, t.healthy()) for t in runner.runs() if t.scale < used}, key=lambda p: p.scale
    )
    lowest_bad = 2.0 ** (top + 1) if top + 1 < bad else used
    return ScaleFinding(used, tuple(probes), 2.0**top, lost.share if lost else None, lowest_bad)


def underflow_reference(
    runner: Runner, survey: PassTrace, modules: list[ModuleInfo], limits: FormatLimits
) -> Optional[UnderflowFinding]:
    """Gradient values lost to zero at the used scale, against the backward at the largest finite scale (and a
    float32 backward when allowed). When the used scale is that largest one (predicted), a re-run at twice it
    confirms that no larger scale keeps more; there is then no same-dtype reference, and None without float32."""
    runner.seed(survey, {})
    top = find_top(runner, survey, limits, modules)
    used = exponent_of(survey.scale)
    if top is not None and used is not None and top == used and runner.top is not None and not runner.top[1]:
        while top < MAX_WINDOW_EXPONENT and runner.finite(2.0 ** (top + 1), histograms=True):
            top += 1  # the prediction missed (it is exact for recorded values): step up to what is finite
        runner.top = (top, True)
    if top is not None and 2.0**top <= survey.scale:
        top = None  # the survey itself: no backward keeps more than it does
    references = _references(runner, top)
    if not references:
        return None
    return lost_gradients(survey, references, modules, _reference_name(runner, top))


def measure_window(
    runner: Runner, survey: PassTrace, modules: list[ModuleInfo], limits: FormatLimits
) -> Optional[ScaleWindow]:
    """The range of loss scales that neither overflow nor lose >= 1 % of gradient values.

    Top: the largest finite scale (``find_top``); the next one up overflows by arithmetic on the largest recorded
    gradient, or was seen to. Bottom: predicted from the binade histograms of the reference backward (float32's
    when allowed, else the top's), then one re-run on the side of the predicted end that was not measured yet;
    a re-run that contradicts the prediction is followed by a bisection between measured scales.
    """
    base = survey if survey.healthy() else (runner(1.0) if runner.measured(1.0) else None)
    if base is None:
        return None
    top = find_top(runner, base, limits, modules)
    if top is None:
        return None
    references = _references(runner, top)
    reference = _reference_name(runner, top)
    owners = param_owners(modules)
    fp32_hist = runner.fp32_histograms()
    hist, at = (fp32_hist, 0) if fp32_hist else (runner.histograms(2.0**top), top)
    prediction = LossPrediction(hist, at, math.floor(math.log2(limits.flush_threshold)), owners)
    ref_nonzero: dict[str, int] = defaultdict(int)
    for name, stats in references[0].param_grads().items():
        ref_nonzero[owners.get(name, name)] += stats.nonzero_count or 0
    total_ref = sum(ref_nonzero.values())
    totals: dict[int, float] = {}  # measured lost share, overall and per module, by exponent
    shares: dict[int, dict[str, float]] = {}

    def measure(exponent: int) -> None:
        if exponent not in totals:
            lost = lost_gradients(runner(2.0**exponent), references, modules, reference)
            totals[exponent] = lost.share if lost else 0.0
            shares[exponent] = {s.module: s.share for s in (lost.spots if lost else ())}

    for trace in runner.runs():  # every finite power-of-two pass already run counts as measured
        exponent = exponent_of(trace.scale)
        if exponent is not None and 0 <= exponent <= top and trace.healthy():
            measure(exponent)

    def useful(exponent: int, module: Optional[str] = None) -> bool:
        """Measured where a pass ran, predicted elsewhere: a scale above one measured useful is useful (losses
        only shrink as the scale grows), and one where the low-precision gradients together are predicted to lose
        GRADIENTS_LOSING of their values is not (their zeros reach parameter gradients that no parameter histogram
        shows at the top: a flushed activation gradient); else the parameter histograms say."""

        def measured_share(e: int) -> float:
            return totals[e] if module is None else shares[e].get(module, 0.0)

        if exponent in totals:
            return measured_share(exponent) < SCALE_WINDOW_LOSS_SHARE
        if any(e <= exponent and measured_share(e) < SCALE_WINDOW_LOSS_SHARE for e in totals):
            return True
        if prediction.gradient_share(exponent) >= GRADIENTS_LOSING:
            return False
        if module is None:
            share = prediction.lost(exponent) / total_ref if total_ref else 0.0
        else:
            share = prediction.lost(exponent, module) / ref_nonzero[module] if ref_nonzero.get(module) else 0.0
        return share < SCALE_WINDOW_LOSS_SHARE

    def confirmed(exponent: int) -> bool:
        measure(exponent)
        return useful(exponent)

    min_useful: Optional[int] = None
    if useful(top):
        predicted = _lowest(top, useful)
        # The bottom at scale 1 predicted with a wide margin (see CONFIDENT), the used scale not the top: no
        # re-run. Otherwise one re-run confirms the predicted end.
        threshold = CONFIDENT * SCALE_WINDOW_LOSS_SHARE
        if (
            predicted == 0
            and 0 not in totals
            and top != exponent_of(survey.scale)
            and prediction.lost(0) <= threshold * total_ref
            and prediction.gradient_share(0) < CONFIDENT_GRADIENTS
        ):
            min_useful = 0
            reference += f"; scale 1 predicted to lose under {threshold:.1%}, not re-run"
        else:
            min_useful = _settle_bottom(predicted, top, lambda e: e in totals, confirmed)
    per_module: dict[str, float] = {}
    for info in modules:
        if info.params and useful(top, info.name):
            per_module[info.name] = 2.0 ** _lowest(top, functools.partial(_useful_for, useful, info.name))
    probes = [WindowProbe(2.0**e, True, totals[e]) for e in totals]
    probes += [WindowProbe(t.scale, False, None) for t in runner.runs() if not t.healthy()]
    if runner.top is not None and not runner.top[1] and top < MAX_WINDOW_EXPONENT:
        probes.append(WindowProbe(2.0 ** (top + 1), False, None))  # by arithmetic on the recorded maximum
    unique = {p.scale: p for p in probes}
    return ScaleWindow(
        current=survey.scale,
        max_safe=2.0**top,
        min_useful=2.0**min_useful if min_useful is not None else None,
        probes=tuple(sorted(unique.values(), key=lambda p: p.scale)),
        module_min_useful=FrozenMap(per_module),
        reference=reference,
    )


def _useful_for(useful: Callable[[int, Optional[str]], bool], module: str, exponent: int) -> bool:
    return useful(exponent, module)


def _lowest(top: int, useful: Callable[[int], bool]) -> int:
    """The lowest exponent from which every one up to ``top`` is useful (losses only shrink as the scale grows, so
    a scale measured to lose bounds every lower one's prediction)."""
    exponent = top
    while exponent > 0 and useful(exponent - 1):
        exponent -= 1
    return exponent


def _settle_bottom(
    predicted: int, top: int, measured: Callable[[int], bool], confirmed: Callable[[int], bool]
) -> int:
    """The smallest useful exponent from the first one predicted useful: one re-run on the side of that end not
    measured yet (the other side stays predicted). A re-run that contradicts the prediction (it loses) is followed
    by re-runs 1, 2, 4 ... exponents further up (the prediction is usually close), up to the smallest scale
    already measured useful, until one is useful; then a bisection of the last step."""
    if not measured(predicted):
        if confirmed(predicted):
            return predicted
        # Known useful without a re-run: the smallest scale measured useful above (the top, the used scale ...).
        ceiling = min(e for e in range(predicted + 1, top + 1) if e == top or (measured(e) and confirmed(e)))
        fails, step = predicted, 1
        while True:
            holds = min(fails + step, ceiling)
            if holds == ceiling or confirmed(holds):
                break
            fails, step = holds, 2 * step
        return bisect_exponents(holds, fails, confirmed)[0]
    if predicted == 0 or measured(predicted - 1) or not confirmed(predicted - 1):
        return predicted
    return bisect_exponents(predicted - 1, -1, lambda e: e >= 0 and confirmed(e))[0]


def margin_scale(max_safe: float, margin_bits: float) -> float:
    """The loss scale to recommend: ``max_safe`` (the largest finite power of two) divided by ``2**margin_bits``,
    rounded up to whole bits so that it stays a power of two (exact gradient arithmetic), and never below 1 (a scale
    under 1 is GradScaler's useless range): the gradients keep at least ``margin_bits`` of headroom when it can."""
    return max(1.0, max_safe / 2.0 ** math.ceil(margin_bits)) if max_safe >= 1 else max_safe


def gradient_headroom(trace: PassTrace, limits: FormatLimits, modules: Sequence[ModuleInfo] = ()) -> float:
    """Bits between the largest low-precision gradient of ``trace`` as held (times its scale) and the format's
    max (the gradients ``predicted_top`` looks at); inf when none is recorded, -inf when one is non-finite."""
    low_modules = low_precision_modules(trace, limits)
    owners = param_owners(modules)
    largest = 0.0
    for e in trace.grad_events:
        low = e.stats.dtype == limits.dtype or (e.kind == "param" and owners.get(e.param or "") in low_modules)
        if not low:
            continue
        if not e.stats.is_finite:
            return -math.inf
        largest = max(largest, e.stats.abs_max or 0.0)
    return math.log2(limits.max / (largest * trace.scale)) if largest > 0 else math.inf
