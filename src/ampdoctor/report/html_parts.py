"""Small pieces shared by the HTML renderers: escaping, cells, the legend, numbers. Pure."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from html import escape

from ..records import TensorStats
from ..thresholds import HEADROOM_TIGHT_BITS, HEADROOM_WARN_BITS
from .document import describe_bad
from .inert import inert
from .numbers import fmt_num

# Names listed inline (propagation, not captured) before "and N more".
INLINE_NAMES = 8


def _e(value: object) -> str:
    """Escaped for HTML text and quoted attributes, on one line: control and invisible-format characters (a
    bidirectional override that reorders a name, an escape sequence) and a non-UTF-8 file name's undecodable bytes
    shown as visible escapes (:func:`~.inert.inert`, as the text report shows them; a lone surrogate would also
    make the page unencodable)."""
    return escape(inert(str(value)), quote=True)


def _pre(text: str) -> str:
    """:func:`_e` for a block shown with its line breaks (``<pre>``: source lines, snippets, the text report)."""
    return "\n".join(_e(line) for line in text.split("\n"))


def _code(value: object) -> str:
    return f"<code>{_e(value)}</code>"


def _shape(shape: Iterable[int]) -> str:
    dims = list(shape)
    return "×".join(str(d) for d in dims) if dims else "scalar"


def _nonfinite(stats: TensorStats) -> str:
    if not stats.measured or stats.is_finite:
        return ""
    return describe_bad(stats)


def _names(labels: Sequence[str]) -> str:
    shown = ", ".join(_code(label) for label in labels[:INLINE_NAMES])
    more = len(labels) - INLINE_NAMES
    return shown + (f" and {more} more" if more > 0 else "")


def _td(text: str, num: bool = False, raw: bool = False, attrs: str = "") -> str:
    cls = ' class="ad-num"' if num else ""
    return f"<td{cls}{attrs}>{text if raw else _e(text)}</td>"


def _legend() -> str:
    keys = (
        ("nonfinite", "inf/NaN"),
        ("warn", f"< {fmt_num(HEADROOM_WARN_BITS)} bit"),
        ("tight", f"< {fmt_num(HEADROOM_TIGHT_BITS)} bits"),
        ("fine", "fine"),
    )
    return (
        '<span class="ad-legend">'
        + "".join(f'<span class="ad-key ad-{k}"></span>{_e(label)}' for k, label in keys)
        + "</span>"
    )

