"""The HTML tables of a report: forward calls, backward gradients, training steps; long tables fold. Pure.

Every row comes from :mod:`.rows` (the per-call row model the other renderers read too).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

from ..thresholds import HEADROOM_TIGHT_BITS, HEADROOM_WARN_BITS
from .document import fmt_num
from .html_parts import _code, _e, _legend, _nonfinite, _shape, _td
from .rows import LEVEL_RANK, CallRow, ReportRows, TensorRow, bits_text, left_out_line, op_peak_text

if TYPE_CHECKING:
    from .data import ReportData

# Tables longer than this fold runs of unremarkable rows into one summary row ...
FULL_TABLE_ROWS = 60
# ... when the run is at least this long.
COLLAPSE_MIN_RUN = 3
# A table shows at most this many remarkable rows (the origin first, then the least headroom); the others fold
# into the runs around them, a line says how many were left out, and the JSON report has every row.
MAX_SHOWN_ROWS = 50


@dataclass(frozen=True)
class Row:
    """One table row: its colour level, whether it may fold into a run, a label for run summaries, the cells."""

    level: str
    foldable: str  # "" (always shown), "fine", "carried" (non-finite, passed on) or "skipped" (a training step)
    label: str
    # The cells' HTML, or what makes it: built only for rows shown (a table of ten thousand calls shows a few
    # dozen; the others fold into summary rows).
    cells: Union[str, Callable[[], str]]
    origin: bool = False
    bits: Optional[float] = None

    def html(self) -> str:
        return self.cells if isinstance(self.cells, str) else self.cells()


def _bound(rows: Sequence[Row]) -> tuple[list[Row], int]:
    """The rows with all but the :data:`MAX_SHOWN_ROWS` most relevant remarkable ones marked ``hidden`` (origin
    rows first, then by colour level and headroom), and how many were hidden."""
    remarkable = [i for i, r in enumerate(rows) if not r.foldable]
    if len(remarkable) <= MAX_SHOWN_ROWS:
        return list(rows), 0
    ranked = sorted(
        remarkable,
        key=lambda i: (not rows[i].origin, LEVEL_RANK.get(rows[i].level, len(LEVEL_RANK)),  # type: ignore[call-overload]
                       rows[i].bits if rows[i].bits is not None else math.inf, i),
    )
    keep = set(ranked[:MAX_SHOWN_ROWS])
    bounded = [r if r.foldable or i in keep else dataclasses.replace(r, foldable="hidden") for i, r in enumerate(rows)]
    return bounded, len(remarkable) - MAX_SHOWN_ROWS


def _hidden_run(run: Sequence[Row], columns: int, noun: str) -> str:
    """One summary row for consecutive rows not shown: hidden remarkable ones and the runs of fine or carried
    ones between them."""
    kinds = {"hidden": 0, "fine": 0, "carried": 0, "skipped": 0}
    for r in run:
        kinds[r.foldable] += 1
    named = (("healthy", "fine"), ("carrying non-finite values", "carried"), ("skipped", "skipped"))
    parts = [f"{kinds['hidden']} left out"] + [f"{kinds[kind]} {what}" for what, kind in named if kinds[kind]]
    css = "nonfinite" if any(r.level == "nonfinite" for r in run) else "fine"
    return (
        f'<tr class="ad-run ad-{css}"><td colspan="{columns}">⋯ {len(run)} {_e(noun)} not shown '
        f"({_e(', '.join(parts))}): {_code(run[0].label)} … {_code(run[-1].label)}</td></tr>"
    )


def _fold(rows: Sequence[Row], columns: int, noun: str) -> str:
    """Rows as ``<tr>``s; in a long table, runs of fine (or carried non-finite) rows become one summary row, and
    rows past the bound (``hidden``) fold with the runs around them."""
    out: list[str] = []
    fold = len(rows) > FULL_TABLE_ROWS
    bounded = fold and any(r.foldable == "hidden" for r in rows)  # then every run of unshown rows is one row
    i = 0
    while i < len(rows):
        row = rows[i]
        j = i + 1
        if fold and row.foldable:
            while j < len(rows) and (rows[j].foldable == row.foldable or (bounded and rows[j].foldable)):
                j += 1
        if bounded and any(r.foldable == "hidden" for r in rows[i:j]):
            out.append(_hidden_run(rows[i:j], columns, noun))
            i = j
            continue
        if j - i >= COLLAPSE_MIN_RUN:
            run = rows[i:j]
            if row.foldable == "fine":
                known = [r.bits for r in run if r.bits is not None]
                least = f", least headroom {min(known):.1f} bits" if known else ""
                what = f"{len(run)} healthy {noun}{least}"
                css = "fine"
            elif row.foldable == "skipped":
                what = f"{len(run)} skipped {noun}"
                css = "nonfinite"
            else:
                what = f"{len(run)} {noun} carrying the non-finite values onward"
                css = "nonfinite"
            out.append(
                f'<tr class="ad-run ad-{css}"><td colspan="{columns}">⋯ {_e(what)}: {_code(run[0].label)} … '
                f"{_code(run[-1].label)}</td></tr>"
            )
            i = j
            continue
        for r in rows[i:j]:
            classes = f"ad-{r.level}" + (" ad-origin" if r.origin else "")
            out.append(f'<tr class="{classes}">{r.html()}</tr>')
        i = j
    return "".join(out)



_FORWARD_HEAD = (
    "#",
    "call",
    "class",
    "inputs |x|max",
    "output",
    "dtype",
    "shape",
    "|x|max",
    "min |x|>0",
    "headroom bits",
    "non-finite",
    "",
)



def _forward_row(c: CallRow) -> Row:
    note = _forward_note(c)
    foldable = ""
    if not note:
        foldable = {"fine": "fine", "none": "fine", "nonfinite": "carried"}.get(c.level, "")
    elif note == "carries it":
        foldable = "carried"
    return Row(c.level, foldable, c.label, lambda: _forward_cells(c), c.role == "origin", c.headroom_bits)


def _forward_note(c: CallRow) -> str:
    note = {
        "unfinished": "did not complete",
        "origin": "◀ origin",
        "creator": "made inf/NaN (contains the origin)",
        "carries": "carries it",
        "": "",
    }[c.role]
    if c.mask_input:
        note = (note + "; " if note else "") + "mask input"
    if c.op_peak is not None:
        note = (note + "; " if note else "") + f"op inside: {op_peak_text(c)}"
    return note


def _forward_cells(c: CallRow) -> str:
    top = c.worst
    stats = top.stats if top is not None else None
    in_text = fmt_num(c.inputs_abs_max) if c.inputs_abs_max is not None else ("-" if not c.inputs_measured else "")
    if c.nonfinite_input:
        in_text += " + inf/NaN"
    note = _forward_note(c)
    more = len([r for r in c.outputs if r.stats.measured]) - 1
    out_name = (top.tensor if top is not None else "-") + (f" (+{more})" if more > 0 else "")
    order = str(c.call.end_order) if c.call.end_order >= 0 else "-"
    return "".join(
        (
            _td(order, True),
            _td(_code(c.label), raw=True, attrs=f' style="padding-left:{0.5 + 0.8 * c.depth:.1f}em"'),
            _td(c.call.class_name),
            _td(in_text, True),
            _td(out_name),
            _td(stats.dtype if stats else ""),
            _td(_shape(stats.shape) if stats else ""),
            _td(fmt_num(stats.abs_max) if stats else "", True),
            _td(fmt_num(stats.min_abs_nonzero) if stats and stats.min_abs_nonzero is not None else "", True),
            _td(bits_text(c.headroom_bits, stats.measured) if stats else "", True),
            _td(_nonfinite(stats) if stats else ""),
            _td(note),
        )
    )


def forward_rows(report: ReportData) -> list[Row]:
    """The forward table: one row per call in completion order, showing its worst output."""
    return [_forward_row(c) for c in ReportRows.of(report).calls]


_BACKWARD_HEAD = (
    "#",
    "gradient",
    "of",
    "tensor",
    "dtype",
    "shape",
    "|g|max",
    "held (× scale)",
    "min |g|>0",
    "headroom bits",
    "non-finite",
    "",
)
_KIND = {"output": "∂ output", "input": "∂ input", "param": "∂ param"}


def _backward_row(r: TensorRow) -> Row:
    foldable = "" if r.origin else {"nonfinite": "carried", "fine": "fine", "none": "fine"}.get(r.level, "")
    return Row(r.level, foldable, r.label or r.param or "?", lambda: _backward_cells(r), r.origin, r.headroom_bits)


def _backward_cells(r: TensorRow) -> str:
    note = "◀ origin" if r.origin else ("carries it" if r.level == "nonfinite" else "")
    if r.via_base:
        note = (note + "; " if note else "") + "via view base"
    s = r.stats
    kind = r.kind.removeprefix("grad_")
    return "".join(
        (
            _td(str(r.grad_order), True),
            _td(_KIND.get(kind, kind)),
            _td(_code(r.label or r.param or "?"), raw=True),
            _td("" if kind == "param" else r.tensor.removeprefix("grad:")),
            _td(s.dtype),
            _td(_shape(s.shape)),
            _td(fmt_num(s.abs_max), True),
            _td(fmt_num(r.abs_max_held), True),
            _td(fmt_num(s.min_abs_nonzero) if s.min_abs_nonzero is not None else "", True),
            _td(bits_text(r.headroom_bits, s.measured), True),
            _td(_nonfinite(s)),
            _td(note),
        )
    )


def backward_rows(report: ReportData) -> list[Row]:
    """The backward table: one row per gradient event in execution order (statistics unscaled)."""
    return [_backward_row(r) for r in ReportRows.of(report).grads]


def _table(head: Sequence[str], rows: Sequence[Row], noun: str) -> str:
    header = "".join(f"<th>{_e(h)}</th>" for h in head)
    bounded, hidden = _bound(rows) if len(rows) > FULL_TABLE_ROWS else (list(rows), 0)
    table = f'<table class="ad-calls"><tr>{header}</tr>{_fold(bounded, len(head), noun)}</table>'
    if hidden:
        table += f'<p class="ad-muted">{_e(left_out_line(hidden, MAX_SHOWN_ROWS))}</p>'
    return table


def _counts(rows: Sequence[Row]) -> str:
    n = {k: sum(1 for r in rows if r.level == k) for k in ("nonfinite", "warn", "tight")}
    parts = [
        f"{n['nonfinite']} non-finite",
        f"{n['warn']} under {fmt_num(HEADROOM_WARN_BITS)} bit",
        f"{n['tight']} under {fmt_num(HEADROOM_TIGHT_BITS)} bits",
    ]
    return ", ".join(parts)


def forward_section(report: ReportData) -> str:
    rows = forward_rows(report)
    if not rows:
        return ""
    limits = report.run.limits
    summary = (
        f"Forward: {len(rows)} module calls ({_counts(rows)}); headroom = log2({fmt_num(limits.max)} / |x|max)"
    )
    return (
        f"<details open><summary>{_e(summary)} {_legend()}</summary>"
        f"{_table(_FORWARD_HEAD, rows, 'calls')}</details>"
    )


def backward_section(report: ReportData) -> str:
    trace = report.trace
    if not trace.backward_ran:
        return '<div class="ad-section ad-muted">No backward pass was run.</div>'
    rows = backward_rows(report)
    if not rows:
        return ""
    f = report.findings
    is_open = " open" if f.backward_origin is not None or f.scale is not None or f.underflow is not None else ""
    summary = (
        f"Backward: {len(rows)} gradient events ({_counts(rows)}); |g| unscaled, held = × loss scale "
        f"{fmt_num(trace.scale)}"
    )
    return (
        f"<details{is_open}><summary>{_e(summary)} {_legend()}</summary>"
        f"{_table(_BACKWARD_HEAD, rows, 'gradients')}</details>"
    )


_STEPS_HEAD = ("step", "loss", "scale", "optimizer step", "forward", "origin", "non-finite gradients", "rank")


def steps_rows(report: ReportData) -> list[Row]:
    """The training steps that ``ampdoctor.watch`` recorded, one row each."""
    rows = []
    for st in report.steps:
        bad = st.skipped or not st.forward_finite or not st.grads_finite
        origins = [o for o in (st.forward_origin, st.backward_origin) if o]
        params = st.nonfinite_params
        shown = ", ".join(params[:3]) + (f" and {len(params) - 3} more" if len(params) > 3 else "")
        cells = "".join(
            (
                _td(str(st.step), True),
                _td(fmt_num(st.loss), True),
                _td(f"{fmt_num(st.scale)}", True),
                _td("skipped" if st.skipped else "taken" if st.grads_finite else "taken, non-finite gradients"),
                _td("finite" if st.forward_finite else "non-finite"),
                _td(" / ".join(_code(o) for o in origins), raw=True),
                _td(shown),
                _td(str(st.rank), True),
            )
        )
        foldable = "" if origins else ("skipped" if bad else "fine")
        rows.append(Row("nonfinite" if bad else "fine", foldable, f"step {st.step}", cells))
    return rows


def steps_section(report: ReportData) -> str:
    steps = report.steps
    if not steps:
        return ""
    skipped = sum(1 for st in steps if st.skipped)
    scales = f"{fmt_num(steps[0].scale)} → {fmt_num(steps[-1].scale)}"
    unguarded = sum(1 for st in steps if st.unguarded)
    applied = f", {unguarded} with non-finite gradients that no GradScaler skipped" if unguarded else ""
    summary = f"Training steps: {len(steps)} ({skipped} skipped{applied}; scale {scales})"
    is_open = " open" if skipped or unguarded or not all(st.forward_finite for st in steps) else ""
    return (
        f"<details{is_open}><summary>{_e(summary)}</summary>"
        f"{_table(_STEPS_HEAD, steps_rows(report), 'steps')}</details>"
    )

