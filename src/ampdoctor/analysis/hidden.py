"""Hidden overflows: ops that made inf or NaN from finite inputs inside a module call (or the loss) whose output
stayed finite, because a later op hid the values (softmax of ``-inf``, ``clamp``, ``where``, ``nan_to_num``,
``masked_fill``, a ``max``). A finding of its own: never HEALTHY. Pure: records in, findings out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..records import LOSS, OpOverflow, PassTrace, SourceLocation, call_label

# What the report says when no op that consumed the values was seen giving a finite result.
NOT_VISIBLE = "not visible in the module's output"


@dataclass(frozen=True)
class HiddenOverflow:
    """One op at one source line inside one module call that made inf/NaN the call's output does not show.

    ``count``: elements made non-finite, summed over the op's ``occurrences`` at this line (None when only the
    survey flagged it: not counted); ``sentinels``: non-finite elements left out as mask arithmetic.
    """

    module: str  # LOSS for the loss function
    call: int
    class_name: str
    op: str
    function: str
    dtype: str
    count: Optional[int]
    occurrences: tuple[int, ...]  # the op's occurrence indices in the call (0-based, per op name)
    hidden_by: str  # the op that hid the values, or NOT_VISIBLE
    location: Optional[SourceLocation] = None
    classified: bool = False  # counted and classified per element on a re-run (else: flagged by the survey)
    sentinels: int = 0

    @property
    def label(self) -> str:
        return call_label(self.module, self.call) if self.module != LOSS else LOSS


def hidden_overflows(trace: PassTrace) -> tuple[HiddenOverflow, ...]:
    """The trace's op overflows whose module call's (or the loss's) output stayed finite, one per (call, op,
    source line) in op order; occurrences of an op at one line (a loop) are summed."""
    groups: dict[tuple[object, ...], list[OpOverflow]] = {}
    for o in trace.op_overflows:
        if o.count == 0 or not _output_finite(trace, o):
            continue
        where = (o.location.file, o.location.line) if o.location is not None else ("", -1 - o.occurrence)
        groups.setdefault((o.module, o.call, o.op, *where), []).append(o)
    found = []
    for members in groups.values():
        first = members[0]
        counts = [m.count for m in members]
        class_name = trace.calls[first.call_index].class_name if first.call_index is not None else "loss"
        found.append(
            HiddenOverflow(
                module=first.module,
                call=first.call,
                class_name=class_name,
                op=first.op,
                function=first.function,
                dtype=first.dtype,
                count=None if any(c is None for c in counts) else sum(c for c in counts if c is not None),
                occurrences=tuple(m.occurrence for m in members),
                hidden_by=first.hidden_by or NOT_VISIBLE,
                location=first.location,
                classified=all(m.classified for m in members),
                sentinels=sum(m.sentinels for m in members),
            )
        )
    return tuple(found)


def _output_finite(trace: PassTrace, o: OpOverflow) -> bool:
    """The module call's outputs (the loss, for the loss function) hold no inf or NaN."""
    if o.call_index is None:
        return trace.loss is not None and trace.loss.is_finite
    if o.call_index >= len(trace.calls):
        return False
    return all(r.stats.is_finite for r in trace.calls[o.call_index].outputs if r.stats.measured)
