"""What every renderer says about hidden overflows: a title, a note and one row per (call, op, source line).
Pure: findings in, strings out (document.py lays them out for text and markdown, html.py for HTML)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from ..analysis import HiddenOverflow

HIDDEN_HEADERS = ("call", "class", "op", "source line", "count", "hidden by")


def hidden_title(hidden: Sequence[HiddenOverflow]) -> str:
    total = len(hidden)
    return f"Hidden overflows: {total} op(s) made inf/NaN that a later op hid (not healthy)"


def hidden_note(hidden: Sequence[HiddenOverflow]) -> str:
    dtype = hidden[0].dtype if hidden else "float16"
    unconfirmed = sum(not h.classified for h in hidden)
    text = (
        f"each {dtype} op made inf/NaN from finite inputs; the call's output stayed finite, so the step looks "
        "healthy but has no margin: a slightly larger input, a later step or a sibling block overflows for real. "
        "Mask fills and mask arithmetic are not counted"
    )
    if unconfirmed:
        text += f"; {unconfirmed} flagged by the survey only (not counted per element: the re-run did not run)"
    return text


def where_text(h: HiddenOverflow) -> str:
    if h.location is None:
        return "-"
    return f"{os.path.basename(h.location.file)}:{h.location.line}: {h.location.code}"


# The hidden-overflow table's rows are the first findings in op order (not ranked).
HIDDEN_SHOWN = "first in op order"


def hidden_rows(hidden: Sequence[HiddenOverflow], max_rows: int = 20) -> list[list[str]]:
    """One row per finding, in op order: call, class, op (with the function the code called), line, count,
    what hid it."""
    rows = []
    for h in hidden[:max_rows]:
        times = f" (x{len(h.occurrences)})" if len(h.occurrences) > 1 else ""
        count = "flagged" if h.count is None else str(h.count)
        rows.append([h.label, h.class_name, f"{h.op} ({h.function}){times}", where_text(h), count, h.hidden_by])
    return rows
