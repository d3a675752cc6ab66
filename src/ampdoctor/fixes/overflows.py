"""Which ops of a verification re-run still make inf/NaN from finite inputs (hidden or not): what keeps a remedy
from being verified. Pure: records in, records out.

Verification re-runs are survey passes: they flag ops without counting or classifying them per element. The
diagnosis's detailed re-run classified every op the survey flagged, and left out those whose non-finite elements
were all sentinels (mask arithmetic such as an additive ``finfo.min`` mask overflowing to ``-inf``):
:func:`sentinel_ops` names them, so a re-run that flags them again is not read as an overflow left behind.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..records import OpOverflow, PassTrace

OpKey = tuple[str, int, str, int]  # (module, call, op, occurrence)


def op_key(o: OpOverflow) -> OpKey:
    return (o.module, o.call, o.op, o.occurrence)


def sentinel_ops(survey: PassTrace, classified: PassTrace) -> frozenset[OpKey]:
    """The ops ``survey`` flagged (count unknown) that ``classified`` (the detailed re-run that counts and
    classifies every flagged op per element) left out: all their non-finite elements were sentinels."""
    if classified is survey or not classified.detailed:
        return frozenset()
    kept = {op_key(o) for o in classified.op_overflows}
    return frozenset(op_key(o) for o in survey.op_overflows if o.count is None and op_key(o) not in kept)


def made(trace: PassTrace, ignore: frozenset[OpKey] = frozenset()) -> list[OpOverflow]:
    """The ops of ``trace`` that made inf/NaN from finite inputs (hidden or not), known sentinel ops aside."""
    return [o for o in trace.op_overflows if o.count != 0 and not (ignore and o.count is None and op_key(o) in ignore)]


def overflow_free(trace: PassTrace, ignore: frozenset[OpKey] = frozenset()) -> bool:
    """``PassTrace.overflow_free`` for a survey-level re-run: healthy, and no op made inf/NaN, known sentinels
    aside."""
    return trace.healthy() and not made(trace, ignore)


def hiding(trace: PassTrace, ignore: frozenset[OpKey] = frozenset()) -> set[str]:
    """Modules with an op that made inf/NaN from finite inputs in ``trace``: hidden overflows count in the grouping
    and in the margin."""
    return {
        o.module
        for o in getattr(trace, "op_overflows", ())
        if getattr(o, "count", None) != 0 and not (ignore and o.count is None and op_key(o) in ignore)
    }


def describe(left: Sequence[OpOverflow]) -> str:
    """'; but an op still makes inf/NaN from finite inputs (hidden or not): blocks.0 (matmul)' ("" when none)."""
    if not left:
        return ""
    where = ", ".join(dict.fromkeys(f"{o.label} ({o.op})" for o in left))
    return f"; but an op still makes inf/NaN from finite inputs (hidden or not): {where}"
