"""How numbers read in every report, note and message (foundation: imported by every layer). Pure."""

from __future__ import annotations

from typing import Optional


def fmt_num(value: Optional[float]) -> str:
    """16384 (whole numbers below 1e7 as they are), 0.3453 (4 significant digits from 1e-3 to 1e5), else
    1.100e+12: the same value reads the same in every rendering."""
    if value is None:
        return "-"
    if value != value:
        return "nan"
    if value in (float("inf"), float("-inf")):
        return "inf" if value > 0 else "-inf"
    if value == int(value) and abs(value) < 1e7:
        return str(int(value))  # 16384, not 1.638e+04
    if 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.3e}"


def fmt_scale(scale: Optional[float]) -> str:
    """A loss scale as people type it: whole numbers in full up to 2**49 (4194304, not 4.1943e+06), others as
    :func:`fmt_num` (0.5, 1.126e+15; None: "-")."""
    if scale is not None and scale == scale and abs(scale) < 2.0**50 and scale == int(scale):
        return str(int(scale))
    return fmt_num(scale)
