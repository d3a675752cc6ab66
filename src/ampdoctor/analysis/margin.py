"""The margin on a remedy's path: which low-precision tensors a fix of some modules must leave with headroom, and how
much they keep. Pure: records in, numbers out.

The path of a fix is the fixed modules' calls and every instance of their mechanism, their outputs and their own
ops' peaks (``PassTrace.op_peaks``), and the *consumers* of those calls up to and including the next
normalisation or softmax module: the calls that complete later and take their values, by the producer links the
capture records (``TensorRecord.producer``), or through code between modules (a residual add: an input no module
returned, not the batch, not a mask). A normalisation rescales what it receives, so the values after it no longer
follow the fixed ones. The enclosing calls (a block around an attention) count too, up to the first such boundary.

Sentinels are left out: a fill of ``finfo.min`` (or ``-inf``) on the negative side is a mask, not a value, and
op peaks already exclude mask arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Optional

from ..records import FormatLimits, ModuleCall, PassTrace, TensorStats
from .headroom import headroom_bits
from .origin import is_mask

# Class names of the modules that end a path: what they output no longer follows the values they received.
BOUNDARY_WORDS = ("Norm", "Softmax", "Softmin")
Role = Literal["fixed", "instance", "consumer"]


@dataclass(frozen=True)
class PathTensor:
    """One low-precision tensor on a fix's path and its headroom (bits below the format's max)."""

    label: str  # the call's label
    module: str
    tensor: str  # "out", "out[0]", or "op matmul" (the peak of the call's own ops)
    role: Role
    abs_max: float
    headroom_bits: float

    def describe(self) -> str:
        return f"{self.label} {self.tensor} ({self.headroom_bits:.2f} bits)"


def is_boundary(class_name: str) -> bool:
    """A normalisation or softmax module (LayerNorm, RMSNorm, GroupNorm, BatchNorm*, Softmax, LogSoftmax, ...)."""
    return any(word in class_name for word in BOUNDARY_WORDS)


def value_abs_max(stats: TensorStats, limits: FormatLimits) -> Optional[float]:
    """The largest finite magnitude of a tensor held in the diagnosed format, sentinels left out: a negative side
    at ``-max`` or beyond (a ``finfo.min`` fill, ``-inf`` of a mask) does not count. None when not in the format,
    not measured, or unknown (non-finite at survey level)."""
    if not stats.measured or stats.dtype != limits.dtype:
        return None
    lo = stats.finite_min if stats.finite_min is not None else stats.min
    hi = stats.finite_max if stats.finite_max is not None else stats.max
    if lo is None or hi is None or math.isnan(lo) or math.isnan(hi):
        return None
    sides = [abs(v) for v in (lo, hi) if math.isfinite(v) and v > -limits.max]
    if not sides:
        return 0.0 if lo == -math.inf or lo <= -limits.max else None
    if hi == math.inf:
        return None  # +inf is an overflow, not a sentinel: no headroom to speak of
    return max(sides)


def call_headroom(trace: PassTrace, call: ModuleCall, limits: FormatLimits) -> list[tuple[str, float, float]]:
    """(tensor, |x|max, bits) of the call's finite low-precision outputs and of its own ops' peak."""
    found = []
    for r in call.outputs:
        value = value_abs_max(r.stats, limits)
        bits = headroom_bits(value, limits)
        if value is not None and bits is not None:
            found.append((r.path, value, bits))
    peak = next((p for p in trace.op_peaks if p.call_index == call.index), None)
    if peak is not None:
        bits = headroom_bits(peak.abs_max, limits)
        if bits is not None:
            found.append((f"op {peak.op}", peak.abs_max, bits))
    return found


def _within(module: str, names: Iterable[str]) -> bool:
    return any(n == "" or module == n or module.startswith(n + ".") for n in names)


def consumers(trace: PassTrace, start: ModuleCall) -> list[ModuleCall]:
    """The calls after ``start`` (in order of completion) that take its values, up to and including the first
    normalisation or softmax among them; the root (the model's output) and calls inside ``start`` excluded."""
    if start.end_order < 0:
        return []
    by_index = {c.index: c for c in trace.calls}
    batch_refs = {r.ref for r in trace.batch if r.ref >= 0}
    ancestors: set[int] = set()
    parent = start.parent
    while parent is not None and parent in by_index:
        ancestors.add(parent)
        parent = by_index[parent].parent
    chain = {start.index}
    found: list[ModuleCall] = []
    later = sorted((c for c in trace.calls if c.end_order > start.end_order), key=lambda c: c.end_order)
    for c in later:
        if c.module == "" or _within(c.module, [start.module]):
            continue
        if c.index in ancestors:
            takes = True
        else:
            takes = any(
                r.producer in chain
                or (r.producer is None and r.ref not in batch_refs and not is_mask(r))
                for r in c.inputs
                if r.stats.measured
            )
        if not takes:
            continue
        chain.add(c.index)
        found.append(c)
        if is_boundary(c.class_name):
            break
    return found


def path_headroom(
    trace: PassTrace, fixed: Sequence[str], instances: Sequence[str], limits: FormatLimits
) -> list[PathTensor]:
    """Every finite low-precision tensor on the path of a fix of ``fixed`` (module names) whose mechanism has the
    ``instances``, with its headroom, least first. Calls of modules inside ``fixed`` are left out (they run in
    float32, or belong to what the fix replaces)."""
    starts = [c for c in trace.calls if c.module in fixed or c.module in instances]
    roles: dict[int, Role] = {}
    for c in starts:
        roles[c.index] = "fixed" if c.module in fixed else "instance"
    for c in starts:
        for later in consumers(trace, c):
            roles.setdefault(later.index, "consumer")
    found = []
    for c in trace.calls:
        role = roles.get(c.index)
        if role is None or (role != "fixed" and _within(c.module, fixed)):
            continue
        for tensor, value, bits in call_headroom(trace, c, limits):
            found.append(PathTensor(c.label, c.module, tensor, role, value, bits))
    found.sort(key=lambda p: p.headroom_bits)
    return found
