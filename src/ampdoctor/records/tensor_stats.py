"""Statistics of one tensor (:class:`TensorStats`), the record a pass makes for every tensor it sees."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from .frozen import NanEq


@dataclass(frozen=True, eq=False, init=False)
class TensorStats(NanEq):
    """Statistics of one tensor.

    ``min``/``max`` are taken over all values, so they are NaN or infinite when the tensor is. Fields that are
    ``None`` were not measured at this level of detail (the survey pass measures only min, max and zeros).
    ``finite_min``/``finite_max``/``min_abs_nonzero`` ignore non-finite values. ``subnormal_count`` counts
    nonzero finite values below the smallest normal of the diagnosed format; ``cast_*`` count what casting to
    that format would do (0 for tensors already in it).
    """

    dtype: str
    shape: tuple[int, ...]
    min: Optional[float] = None
    max: Optional[float] = None
    zero_count: Optional[int] = None
    nan_count: Optional[int] = None
    posinf_count: Optional[int] = None
    neginf_count: Optional[int] = None
    finite_min: Optional[float] = None
    finite_max: Optional[float] = None
    min_abs_nonzero: Optional[float] = None
    subnormal_count: Optional[int] = None
    cast_overflow_count: Optional[int] = None
    cast_flush_count: Optional[int] = None

    def __init__(
        self,
        dtype: str,
        shape: tuple[int, ...],
        min: Optional[float] = None,  # noqa: A002 (the field's name)
        max: Optional[float] = None,  # noqa: A002
        zero_count: Optional[int] = None,
        nan_count: Optional[int] = None,
        posinf_count: Optional[int] = None,
        neginf_count: Optional[int] = None,
        finite_min: Optional[float] = None,
        finite_max: Optional[float] = None,
        min_abs_nonzero: Optional[float] = None,
        subnormal_count: Optional[int] = None,
        cast_overflow_count: Optional[int] = None,
        cast_flush_count: Optional[int] = None,
    ) -> None:
        # A pass makes one record per tensor it saw (tens of thousands on a model of many small modules): only the
        # measured fields are set on the instance; the others read the class's None. About a fifth of the memory
        # and half the time of setting all fourteen.
        put = object.__setattr__
        put(self, "dtype", dtype)
        put(self, "shape", shape)
        put(self, "min", min)
        put(self, "max", max)
        if zero_count is not None:
            put(self, "zero_count", zero_count)
        if nan_count is not None:
            put(self, "nan_count", nan_count)
            put(self, "posinf_count", posinf_count)
            put(self, "neginf_count", neginf_count)
            put(self, "finite_min", finite_min)
            put(self, "finite_max", finite_max)
            put(self, "min_abs_nonzero", min_abs_nonzero)
            put(self, "subnormal_count", subnormal_count)
            put(self, "cast_overflow_count", cast_overflow_count)
            put(self, "cast_flush_count", cast_flush_count)
        else:
            for name, value in (("posinf_count", posinf_count), ("neginf_count", neginf_count),
                                ("finite_min", finite_min), ("finite_max", finite_max),
                                ("min_abs_nonzero", min_abs_nonzero), ("subnormal_count", subnormal_count),
                                ("cast_overflow_count", cast_overflow_count), ("cast_flush_count", cast_flush_count)):
                if value is not None:
                    put(self, name, value)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def measured(self) -> bool:
        """False for non-floating or empty tensors, whose values are not examined."""
        return self.min is not None

    @property
    def detailed(self) -> bool:
        return self.nan_count is not None

    @property
    def has_nan(self) -> bool:
        if self.nan_count is not None:
            return self.nan_count > 0
        return self.min is not None and (math.isnan(self.min) or math.isnan(self.max or 0.0))

    @property
    def has_posinf(self) -> bool:
        if self.posinf_count is not None:
            return self.posinf_count > 0
        return self.max == math.inf

    @property
    def has_neginf(self) -> bool:
        if self.neginf_count is not None:
            return self.neginf_count > 0
        return self.min == -math.inf

    @property
    def is_finite(self) -> bool:
        lo, hi = self.min, self.max
        if self.nan_count is None and self.posinf_count is None and self.neginf_count is None:
            # The survey level, inlined (asked for every record of every pass): NaN != NaN.
            if lo is None:
                return hi != math.inf
            return lo == lo and lo != -math.inf and hi != math.inf and (hi is None or hi == hi)
        return not (self.has_nan or self.has_posinf or self.has_neginf)

    @property
    def only_neginf(self) -> bool:
        """Non-finite, and every non-finite value is ``-inf`` (the signature of an additive mask)."""
        return self.has_neginf and not self.has_nan and not self.has_posinf

    @property
    def nonfinite_count(self) -> Optional[int]:
        if self.nan_count is None or self.posinf_count is None or self.neginf_count is None:
            return None
        return self.nan_count + self.posinf_count + self.neginf_count

    @property
    def abs_max(self) -> Optional[float]:
        """Largest finite magnitude, or None when unknown (not measured, or non-finite at survey level)."""
        if self.finite_min is not None and self.finite_max is not None:
            return max(abs(self.finite_min), abs(self.finite_max))
        lo, hi = self.min, self.max
        if lo is None or hi is None or not self.is_finite:
            return None
        return -lo if -lo > hi else hi  # max(|lo|, |hi|) for lo <= hi (NaN excluded above)

    @property
    def nonzero_count(self) -> Optional[int]:
        return None if self.zero_count is None else self.numel - self.zero_count

    def scaled_down(self, scale: float) -> TensorStats:
        """The same statistics divided by a loss scale (exact for powers of two)."""
        if scale == 1.0:
            return self

        def div(v: Optional[float]) -> Optional[float]:
            return None if v is None else v / scale

        return dataclasses.replace(
            self,
            min=div(self.min),
            max=div(self.max),
            finite_min=div(self.finite_min),
            finite_max=div(self.finite_max),
            min_abs_nonzero=div(self.min_abs_nonzero),
        )


_new = object.__new__
_put = object.__setattr__


def survey_stats(
    dtype: str, shape: tuple[int, ...], low: Optional[float], high: Optional[float], zero_count: Optional[int] = None
) -> TensorStats:
    """``TensorStats(dtype, shape, low, high, zero_count)`` by the shortest path: a pass makes one per tensor."""
    stats = _new(TensorStats)
    _put(stats, "dtype", dtype)
    _put(stats, "shape", shape)
    _put(stats, "min", low)
    _put(stats, "max", high)
    if zero_count is not None:
        _put(stats, "zero_count", zero_count)
    return stats
