"""Op-level peaks: the largest finite magnitude each module call's own low-precision ops produced in the forward.

Module hooks see a call's inputs and outputs only; the attention scores inside ``blocks.0.attn`` (``q @ k.T``, then
a softmax) never cross a module boundary, so their headroom is invisible there. The hidden-overflow watch
(:mod:`.hidden`) already queues one fused ``aminmax`` per low-precision op output for the pass's single readback;
this reads those same values once more on the host (no extra reduction, no device sync) and keeps, per call, the
largest finite one, when it is larger than the call's outputs show (:class:`~ampdoctor.records.OpPeak`).

Sentinels are left out: fills and selections (``masked_fill``, ``where``, a ``finfo.min`` fill) never count, a
negative side at ``-max`` (``(1 - mask) * finfo.min``) is a constant, not a value, and an op whose input values
reach the format's max or beyond (an additive ``finfo.min`` mask, a mask cast down) is mask arithmetic, not a
peak. An op whose output holds inf/NaN is an overflow (``OpOverflow``), not a peak.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..records import ModuleCall, OpPeak
from .hidden import ARITH, CAST, MAKE, HiddenWatch

# The finite maxima of the low formats (torch.finfo), by the watch's dtype names.
_FORMAT_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38}
_MAKERS = (MAKE, ARITH, CAST)


def _abs_max(values: Sequence[float], first: int, outputs: int) -> float:
    """Largest |v| over the node's (min, max) pairs; inf when any is non-finite."""
    seen = values[first : first + 2 * outputs]
    return max((abs(v) if math.isfinite(v) else math.inf for v in seen), default=0.0)


def _value_peak(values: Sequence[float], first: int, outputs: int, limit: float) -> float:
    """Largest |v| over the node's (min, max) pairs with a negative side at ``-limit`` or below left out (a
    ``finfo.min`` constant: ``(1 - mask) * finfo.min``); inf when any is non-finite."""
    seen = values[first : first + 2 * outputs]
    if not all(math.isfinite(v) for v in seen):
        return math.inf
    return max((abs(v) for v in seen if v > -limit), default=0.0)


def op_peaks(watch: HiddenWatch, values: Sequence[float], calls: Sequence[ModuleCall]) -> tuple[OpPeak, ...]:
    """Per module call, its own ops' largest finite low-precision output magnitude, where that is larger than the
    call's measured outputs (``calls``: the pass's records, same indices as the watch's). ``values``: the watch's
    values as read back (:meth:`HiddenWatch.read_values`)."""
    nodes: list[Any] = watch.nodes
    best: dict[int, tuple[float, str, int]] = {}
    for n in nodes:
        limit = _FORMAT_MAX.get(n.dtype)
        if n.call is None or limit is None or n.first < 0 or n.category not in _MAKERS:
            continue
        peak = _value_peak(values, n.first, n.outputs, limit)
        if not math.isfinite(peak) or peak <= best.get(n.call, (0.0, "", 0))[0]:
            continue
        if any(nodes[i].first >= 0 and _abs_max(values, nodes[i].first, nodes[i].outputs) >= limit for i in n.inputs):
            continue  # mask arithmetic: an operand already at the format's max (or beyond)
        best[n.call] = (peak, n.name, n.occurrence)
    found = []
    for index, (peak, name, occurrence) in sorted(best.items()):
        if index >= len(calls):
            continue
        shown = [r.stats.abs_max for r in calls[index].outputs if r.stats.measured]
        if all(v is not None for v in shown) and peak <= max((v for v in shown if v is not None), default=0.0):
            continue  # the call's outputs already show it
        found.append(OpPeak(index, peak, name, occurrence))
    return tuple(found)
