"""Headroom: how many doublings a tensor can take before it overflows the diagnosed format."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Optional

from ..records import (
    FormatLimits,
    ModuleInfo,
    PassTrace,
    TensorStats,
)
from ..thresholds import HEADROOM_WARN_BITS
from .findings import NearLimit


def headroom_bits(abs_max: Optional[float], limits: FormatLimits) -> Optional[float]:
    """``log2(max / abs_max)``: how many doublings a tensor can take before it overflows the format."""
    if abs_max is None or not math.isfinite(abs_max):
        return None
    if abs_max == 0:
        return math.inf
    return math.log2(limits.max / abs_max)



def _may_exceed(stats: TensorStats, bound: float, factor: float = 1.0) -> bool:
    """False only when ``stats.abs_max`` is known to be None or at most ``bound`` once multiplied by ``factor``
    (> 0): the survey-level test without the property, asked for every output, parameter and gradient of a pass.
    A multiplication by a positive factor keeps the order, so ``max(-lo, hi) * f <= bound`` exactly when both
    ``-lo * f`` and ``hi * f`` are; NaN compares false (its ``abs_max`` is None)."""
    if stats.nan_count is not None or stats.finite_min is not None or stats.finite_max is not None:
        return True  # detailed: the finite extremes decide (the property)
    lo, hi = stats.min, stats.max
    if lo is None or hi is None:
        return False  # not measured: abs_max is None
    return hi * factor > bound or -lo * factor > bound


def near_limit(trace: PassTrace, modules: Iterable[ModuleInfo], limits: FormatLimits) -> list[NearLimit]:
    """Finite outputs, parameters and (scaled) gradients within HEADROOM_WARN_BITS of the format's max."""
    found: list[NearLimit] = []
    # Magnitudes at or below this keep more than HEADROOM_WARN_BITS + 1 bits: not near, and no logarithm taken
    # (asked for every output, parameter and gradient of the pass: ``_may_exceed`` first, the property after).
    far = limits.max * 2.0 ** -(HEADROOM_WARN_BITS + 1)
    low = limits.dtype

    def check(module: str, call: int, tensor: str, stats: TensorStats, factor: float = 1.0) -> None:
        abs_max = stats.abs_max
        if abs_max is None:
            return
        abs_max *= factor
        if abs_max <= far:
            return
        bits = headroom_bits(abs_max, limits)
        if bits is not None and 0 <= bits < HEADROOM_WARN_BITS:  # beyond the max is no longer 'near' it
            found.append(NearLimit(module, call, tensor, abs_max, bits))

    for c in trace.calls:
        for r in c.outputs:
            if r.stats.dtype == low and _may_exceed(r.stats, far):
                check(c.module, c.call, r.path, r.stats)
    for peak in trace.op_peaks:  # the largest value a call's own ops made (the scores inside an attention)
        if 0 <= peak.call_index < len(trace.calls):
            c = trace.calls[peak.call_index]
            check(c.module, c.call, "op:" + peak.op, TensorStats(limits.dtype, (), min=0.0, max=peak.abs_max))
    for info in modules:
        for p in info.params:
            if _may_exceed(p.stats, far):
                check(info.name, 0, "param:" + p.name.rsplit(".", 1)[-1], p.stats)
    scale = trace.scale
    for e in trace.grad_events:
        if e.kind == "output" and e.call is not None and e.stats.dtype == low and _may_exceed(e.stats, far, scale):
            c = trace.calls[e.call]
            check(c.module, c.call, "grad:" + e.path, e.stats, scale)  # what the scaled backward held
    found.sort(key=lambda n: n.headroom_bits)
    return found



def beyond_range_params(modules: Iterable[ModuleInfo], limits: FormatLimits) -> list[tuple[str, float]]:
    """Finite parameters with values autocast would turn into inf when it casts them to the low format."""
    # abs_max >= threshold implies abs_max > the largest float below it: the cheap test first, the property after.
    below = math.nextafter(limits.overflow_threshold, 0.0)
    return [
        (p.name, p.stats.abs_max)
        for info in modules
        for p in info.params
        if p.stats.dtype != limits.dtype
        and _may_exceed(p.stats, below)
        and p.stats.abs_max is not None
        and p.stats.abs_max >= limits.overflow_threshold
    ]
