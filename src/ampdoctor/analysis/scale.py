"""Re-runs at other loss scales (and one float32 reference) that turn single passes into findings.

No torch here: everything goes through a ``Runner`` that the caller builds around the live model, so each
(scale, autocast) pass runs at most once per diagnosis. Finiteness is assumed monotone in the scale (overflow
only gets worse as the scale grows), and underflow losses are assumed to only shrink as it grows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Optional

from ..records import FormatLimits, FrozenMap, ModuleInfo, PassTrace
from ..thresholds import MAX_REFERENCE_EXTRA_BITS, MIN_REFERENCE_EXTRA_BITS, SCALE_WINDOW_LOSS_SHARE
from .findings import ScaleFinding, ScaleProbe, ScaleWindow, UnderflowFinding, WindowProbe
from .underflow import lost_gradients

# Scales above 2**MAX_WINDOW_EXPONENT are never probed (fp16 spans 40 bits from subnormal to max).
MAX_WINDOW_EXPONENT = 40
FP32_REFERENCE = "float32 backward (autocast off)"


def reference_extra_bits(trace: PassTrace, limits: FormatLimits, max_extra: int, margin_bits: float = 1.0) -> int:
    """How many doublings of the scale the largest scaled gradient of ``trace`` can take, with a margin."""
    # Only gradients held in the low-precision format can overflow it.
    low = [e.stats.abs_max or 0.0 for e in trace.grad_events if e.stats.dtype == limits.dtype]
    largest = max(low, default=0.0) * trace.scale
    if largest == 0:
        return max_extra
    bits = math.floor(math.log2(limits.max / largest) - margin_bits)
    return max(0, min(max_extra, bits))



class Runner:
    """Survey passes keyed by (scale, autocast): each is run once, then served from memory."""

    def __init__(self, run: Callable[[float, bool], PassTrace], allow_fp32: bool) -> None:
        self._run = run
        self._cache: dict[tuple[float, bool], PassTrace] = {}
        self.allow_fp32 = allow_fp32

    def __call__(self, scale: float) -> PassTrace:
        key = (scale, True)
        if key not in self._cache:
            self._cache[key] = self._run(scale, True)
        return self._cache[key]

    def seed(self, trace: PassTrace) -> None:
        self._cache[(trace.scale, True)] = trace

    def fp32(self) -> Optional[PassTrace]:
        """The same step with autocast off: the ground truth of which gradient values are nonzero."""
        if not self.allow_fp32:
            return None
        key = (1.0, False)
        if key not in self._cache:
            self._cache[key] = self._run(1.0, False)
        trace = self._cache[key]
        return trace if trace.gradients_finite() else None

    def finite(self, scale: float) -> bool:
        trace = self(scale)
        return trace.healthy()

    def runs(self) -> list[PassTrace]:
        return list(self._cache.values())


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


def probe_scales(runner: Runner, survey: PassTrace, modules: list[ModuleInfo]) -> ScaleFinding:
    """Binary search for the largest power-of-two scale >= 1 below the used one with finite gradients."""
    used = survey.scale
    runner.seed(survey)
    probes: list[ScaleProbe] = []

    def finite_at(exponent: int) -> bool:
        ok = runner.finite(2.0**exponent)
        probes.append(ScaleProbe(2.0**exponent, ok))
        return ok

    if used <= 1:
        return ScaleFinding(used, tuple(probes), None, None, used)
    if not finite_at(0):
        return ScaleFinding(used, tuple(probes), None, None, 1.0)
    top = math.ceil(math.log2(used))  # 2**top >= used: known (or assumed) non-finite
    low, high = bisect_exponents(0, top, finite_at)
    best = runner(2.0**low)
    reference = "the re-runs at other scales"
    references = [t for t in runner.runs() if t is not best]
    fp32 = runner.fp32()
    if fp32 is not None:
        references.append(fp32)
        reference = f"a {FP32_REFERENCE} and {reference}"
    lost = lost_gradients(best, references, modules, reference)
    lowest_bad = 2.0**high if high < top else used
    probes.sort(key=lambda p: p.scale)
    return ScaleFinding(used, tuple(probes), 2.0**low, lost.share if lost else None, lowest_bad)


def underflow_reference(
    runner: Runner, survey: PassTrace, modules: list[ModuleInfo], limits: FormatLimits
) -> Optional[UnderflowFinding]:
    """A reference backward: at a much larger scale when the survey's gradient maxima leave room, else float32."""
    runner.seed(survey)
    extra = reference_extra_bits(survey, limits, MAX_REFERENCE_EXTRA_BITS)
    while extra >= MIN_REFERENCE_EXTRA_BITS:
        reference = runner(survey.scale * 2.0**extra)
        if reference.gradients_finite():
            return lost_gradients(survey, [reference], modules, f"backward at scale {reference.scale:g}")
        extra //= 2
    fp32 = runner.fp32()
    if fp32 is not None:
        return lost_gradients(survey, [fp32], modules, FP32_REFERENCE)
    return None


def measure_window(
    runner: Runner, survey: PassTrace, modules: list[ModuleInfo], limits: FormatLimits
) -> Optional[ScaleWindow]:
    """The range of loss scales that neither overflow nor lose >= 1 % of gradient values, measured by re-runs.

    The arithmetic (largest unscaled gradient against the format's max) gives the first candidate for the top;
    re-runs confirm it, because the gradient maxima of a non-linear backward need not scale exactly.
    """
    reference = runner.fp32()
    if reference is None:
        return None
    runner.seed(survey)
    probes: dict[float, WindowProbe] = {}

    def probe(exponent: int) -> WindowProbe:
        scale = 2.0**exponent
        if scale not in probes:
            trace = runner(scale)
            finite = trace.healthy()
            lost = lost_gradients(trace, [reference], modules, FP32_REFERENCE) if finite else None
            probes[scale] = WindowProbe(scale, finite, lost.share if lost else (0.0 if finite else None))
        return probes[scale]

    def useful(exponent: int) -> bool:
        share = probe(exponent).lost_share
        return share is not None and share < SCALE_WINDOW_LOSS_SHARE

    # Top: start from the arithmetic, step down to a finite scale, then up while the next one stays finite.
    low_grads = [
        e.stats.abs_max or 0.0 for t in runner.runs() if t.gradients_finite() for e in t.grad_events
        if e.stats.dtype == limits.dtype
    ]
    largest = max(low_grads, default=0.0)
    top = MAX_WINDOW_EXPONENT if largest == 0 else math.floor(math.log2(limits.max / largest))
    top = max(0, min(MAX_WINDOW_EXPONENT, top))
    while top >= 0 and not probe(top).gradients_finite:
        top -= 1
    while 0 <= top < MAX_WINDOW_EXPONENT and probe(top + 1).gradients_finite:
        top += 1
    max_safe = 2.0**top if top >= 0 else None
    min_useful: Optional[float] = None
    if top >= 0 and useful(top):
        if useful(0):
            min_useful = 1.0
        else:
            good, _ = bisect_exponents(top, 0, useful)
            min_useful = 2.0**good
    per_module: dict[str, float] = {}
    for scale in sorted(probes):
        if not probes[scale].gradients_finite:
            continue
        lost = lost_gradients(runner(scale), [reference], modules, FP32_REFERENCE)
        losing = {s.module for s in (lost.spots if lost else []) if s.share >= SCALE_WINDOW_LOSS_SHARE}
        for info in modules:
            if info.params and info.name not in losing:
                per_module.setdefault(info.name, scale)
    return ScaleWindow(
        current=survey.scale,
        max_safe=max_safe,
        min_useful=min_useful,
        probes=tuple(sorted(probes.values(), key=lambda p: p.scale)),
        module_min_useful=FrozenMap(per_module),
        reference=FP32_REFERENCE,
    )
