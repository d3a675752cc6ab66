"""Headroom trends and a forecast of the step at which a module's output would overflow (pure: numbers in,
numbers out; no torch).

Each check feeds the largest finite |x| of some modules' low-precision outputs at one step (the root output every
step, the tightest modules every step, every module on sampled steps). Per module the forecaster keeps the last
``WINDOW`` headroom values (``log2(format max / |x|max)`` in bits) and fits a least-squares line through them:

* the **rate** is the headroom lost per step (minus the slope), the **steps left** the headroom over the rate;
* the slope is **significant** when it is at least ``T_SIGNIFICANT`` standard errors from zero (log2 of a maximum
  is noisy, about 0.2 bits from step to step; logits also grow legitimately while a model learns);
* a module is **at risk** on a check when its slope is significant, it loses at least ``MIN_RATE_BITS`` a step,
  its headroom is under ``warn_bits`` and the steps left are within ``horizon``. A warning needs two consecutive
  checks at risk, and repeats only when the forecast changes materially (the predicted crossing comes earlier by
  more than ``REPEAT_EARLIER`` of the steps that were left, and by at least ``REPEAT_MIN_STEPS``).

:meth:`Forecaster.trending` is the weaker test that asks for dense sampling: a significant upward trend of a
module's maximum that would cross within ``DENSE_HORIZON_FACTOR`` horizons, headroom under ``warn_bits`` +
``DENSE_MARGIN_BITS``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Optional

# Defaults of the watch's keywords: warn under this headroom (bits) ...
WARN_HEADROOM_BITS = 6.0
# ... when the forecast crossing is at most this many steps away.
FORECAST_HORIZON = 100
# Headroom values kept per module (the fit's window), and the fewest needed for a fit.
WINDOW = 16
MIN_POINTS = 8
# Points older than this many steps before the check do not enter the fit (sparse samples of long ago).
MAX_SPAN_STEPS = 64
# A slope this many standard errors from zero is significant (a warning; dense sampling needs less).
T_SIGNIFICANT = 4.0
T_DENSE = 3.0
# Slower than this (bits lost per step) is no trend worth a warning.
MIN_RATE_BITS = 0.02
# Checks in a row a module must be at risk before the warning.
CONSECUTIVE = 2
# A new warning when the predicted crossing step comes earlier by more than this share of the steps that were
# left at the last warning (and by at least REPEAT_MIN_STEPS steps).
REPEAT_EARLIER = 0.5
REPEAT_MIN_STEPS = 5
# Dense sampling: a significant trend that would cross within this many horizons, under warn_bits + this margin.
DENSE_HORIZON_FACTOR = 4
DENSE_MARGIN_BITS = 6.0
# Floor of the residual noise (bits): a perfectly straight series still has a finite t statistic.
NOISE_FLOOR_BITS = 1e-3


@dataclass(frozen=True)
class Fit:
    """A least-squares line through one module's recent headroom."""

    headroom_bits: float  # the latest measured headroom
    rate: float  # bits of headroom lost per step (positive: the maximum grows)
    t: float  # the slope in standard errors (positive: losing headroom)
    points: int

    @property
    def steps_left(self) -> float:
        return self.headroom_bits / self.rate if self.rate > 0 else math.inf


@dataclass(frozen=True)
class Forecast:
    """A module whose output is forecast to overflow: at ``step`` it had ``headroom_bits`` left, losing ``rate``
    bits a step, so it crosses the format's maximum in about ``steps_left`` steps."""

    module: str
    step: int
    headroom_bits: float
    rate: float
    steps_left: float
    dtype: str = "float16"

    @property
    def crossing(self) -> float:
        """The step at which it would cross."""
        return self.step + self.steps_left

    def text(self) -> str:
        name = self.module or "<root>"
        if ":" in name:  # an op inside a module (.optrack): "attn:matmul#0"
            module, op = name.rsplit(":", 1)
            name = f"op {op} in {module}"
        return (
            f"forecast: {name} is heading for a {self.dtype} overflow: {self.headroom_bits:.1f} bits of headroom at "
            f"step {self.step}, losing {self.rate:.2f} bits/step, about {self.steps_left:.0f} steps left (near step "
            f"{self.crossing:.0f}); look at what grows (data, learning rate, residual stream) and keep it in range"
        )


def headroom(value: float, format_max: float) -> Optional[float]:
    """Bits between |x|max and the format's maximum; None for a zero or non-finite maximum."""
    if not (value > 0 and math.isfinite(value)):
        return None
    return math.log2(format_max / value)


def fit(points: Iterable[tuple[int, float]]) -> Optional[Fit]:
    """The line through (step, headroom bits) points; None with fewer than MIN_POINTS or a single step."""
    pts = points if isinstance(points, list) else list(points)
    n = len(pts)
    if n < MIN_POINTS:
        return None
    sx = sy = sxx = sxy = syy = 0.0
    x0 = pts[-1][0]  # steps relative to the last one: no cancellation at large step numbers
    for step, y in pts:
        x = step - x0
        sx += x
        sy += y
        sxx += x * x
        sxy += x * y
        syy += y * y
    vxx = sxx - sx * sx / n  # sums of squares about the means
    if vxx <= 0:
        return None
    vxy = sxy - sx * sy / n
    vyy = syy - sy * sy / n
    slope = vxy / vxx
    residual = max(vyy - slope * vxy, 0.0)
    noise = max(math.sqrt(residual / (n - 2)), NOISE_FLOOR_BITS)
    return Fit(pts[-1][1], -slope, -slope / (noise / math.sqrt(vxx)), n)


class Forecaster:
    """Per-module headroom series, their fits, and the forecast warnings (see the module docstring)."""

    def __init__(
        self,
        warn_bits: float = WARN_HEADROOM_BITS,
        horizon: float = FORECAST_HORIZON,
        format_max: float = 65504.0,
        dtype: str = "float16",
    ) -> None:
        self.warn_bits = warn_bits
        self.horizon = horizon
        self.format_max = format_max
        self.dtype = dtype
        self.series: dict[str, deque[tuple[int, float]]] = {}
        self.now: dict[str, float] = {}  # each module's latest headroom (the last point of its series)
        self.order: dict[str, int] = {}  # first seen, in completion order (a child before its parent)
        self.at_risk: dict[str, int] = {}  # consecutive checks at risk
        self.fits: dict[str, Fit] = {}  # the latest fit of each module checked
        self.checked: list[str] = []  # the modules of the last check
        self.warned: Optional[Forecast] = None
        self.warnings: list[Forecast] = []

    def latest(self) -> dict[str, float]:
        """The latest headroom (bits) of every module seen."""
        return dict(self.now)

    def tightest(self, k: int, among: Optional[Iterable[str]] = None) -> list[str]:
        """The ``k`` modules with the least latest headroom (of ``among`` when given), tightest first (ties: the
        first seen first)."""
        now = self.now
        names = [m for m in among if m in now] if among is not None else list(now)
        names.sort(key=self.order.__getitem__)  # two stable sorts on C-level keys: by (headroom, first seen)
        names.sort(key=now.__getitem__)
        return names[:k]

    def observe(self, step: int, maxima: Mapping[str, float]) -> Optional[Forecast]:
        """One check: each module's |x|max at ``step`` (in completion order). Returns a forecast to warn about
        (new, or materially changed), else None."""
        checked = []
        format_max, log2, inf = self.format_max, math.log2, math.inf
        all_series, now, fits, at_risk = self.series, self.now, self.fits, self.at_risk
        far = self.warn_bits + DENSE_MARGIN_BITS  # at or above: far from the limit, no gate could pass
        oldest = step - MAX_SPAN_STEPS
        risky: list[Forecast] = []
        for module, value in maxima.items():  # one pass: each module's point, then its fit when it is near
            if not 0 < value < inf:  # headroom(), inline: a zero or non-finite maximum has none
                continue
            bits = log2(format_max / value)
            series = all_series.get(module)
            if series is None:
                series = all_series[module] = deque(maxlen=WINDOW)
                self.order[module] = len(self.order)
            if series and series[-1][0] == step:
                bits = min(bits, series[-1][1])
                series[-1] = (step, bits)
            else:
                series.append((step, bits))
            now[module] = bits
            checked.append(module)
            f: Optional[Fit] = None
            if bits < far:
                f = fit(list(series) if series[0][0] >= oldest else [p for p in series if p[0] >= oldest])
            if f is None:
                if module in fits:
                    del fits[module]
                at_risk[module] = 0
                continue
            fits[module] = f
            if self._risky(f):
                at_risk[module] = at_risk.get(module, 0) + 1
                if at_risk[module] >= CONSECUTIVE:
                    risky.append(Forecast(module, step, f.headroom_bits, f.rate, f.steps_left, self.dtype))
            else:
                at_risk[module] = 0
        self.checked = checked
        if not risky:
            if self.warned is not None and step > self.warned.crossing + self.horizon:
                self.warned = None  # long past and quiet: a new trend may warn again
            return None
        best = min(risky, key=lambda f: (f.crossing, self.order.get(f.module, 0)))
        if self.warned is not None:
            earlier = self.warned.crossing - best.crossing
            left = max(self.warned.crossing - step, 0.0)
            if earlier <= max(REPEAT_MIN_STEPS, REPEAT_EARLIER * left):
                return None
        self.warned = best
        self.warnings.append(best)
        return best

    def _risky(self, f: Fit) -> bool:
        return (
            f.t >= T_SIGNIFICANT and f.rate >= MIN_RATE_BITS and f.headroom_bits < self.warn_bits
            and f.steps_left <= self.horizon
        )

    def trending(self, modules: Optional[Iterable[str]] = None) -> bool:
        """Some module (of ``modules``, else of the last check) trends towards the maximum: worth dense sampling."""
        for m in (self.checked if modules is None else modules):
            if m not in self.fits:
                continue
            f = self.fits[m]
            if (
                f.t >= T_DENSE and f.rate >= MIN_RATE_BITS and f.headroom_bits < self.warn_bits + DENSE_MARGIN_BITS
                and f.steps_left <= DENSE_HORIZON_FACTOR * self.horizon
            ):
                return True
        return False
