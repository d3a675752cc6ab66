"""Each compared call against its own float32 re-run: where the error jumps (``reference=True``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

from ..records import (
    Comparison,
)
from .findings import PrecisionFinding

# A call's relative error "jumps" when it is at least this many times the median over compared calls.
JUMP_FACTOR = 10.0


def precision_finding(comparisons: Sequence[Comparison]) -> Optional[PrecisionFinding]:
    if not comparisons:
        return None
    errors = sorted(c.relative_error for c in comparisons if math.isfinite(c.relative_error))
    median = errors[len(errors) // 2] if errors else 0.0
    worst = max(comparisons, key=lambda c: c.relative_error if math.isfinite(c.relative_error) else math.inf)
    jump = None
    if not math.isfinite(worst.relative_error) or worst.relative_error >= JUMP_FACTOR * max(median, 1e-12):
        jump = worst.label
    return PrecisionFinding(tuple(comparisons), jump, tuple(c.label for c in comparisons if c.underflow_count))


