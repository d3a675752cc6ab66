"""The report's document, one function per section: each takes the report and returns the sections it adds
(none when it has nothing to say). :data:`SECTIONS` is their order; a new finding adds a function there."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Optional

from .document import (
    DIVERGENCE_TITLE,
    Block,
    Document,
    Item,
    Para,
    Section,
    alerts,
    cost_text,
    divergence_lines,
    failed_passes,
    fmt_num,
    inline_names,
    make_table,
    origin_section,
    verdict_text,
)
from .hidden_rows import HIDDEN_HEADERS, HIDDEN_SHOWN, hidden_note, hidden_rows, hidden_title
from .rows import CallRow, ReportRows, bits_text, op_peak_text

if TYPE_CHECKING:
    from .data import ReportData


def _head(report: ReportData) -> str:
    f, run = report.findings, report.run
    origin = f.forward_origin or f.backward_origin
    head = verdict_text(report) + (f" - {origin.direction} origin: {origin.label}" if origin is not None else "")
    if not run.backward_checked:
        head += " (forward only: no gradient was checked)"
    if f.divergence is not None:
        head += f" - divergence from step {f.divergence.began}"
    return head


def _facts(report: ReportData) -> str:
    run = report.run
    backward = (
        f"loss scale {fmt_num(run.scale)} ({run.scale_source}), loss from {run.loss_source}"
        if run.backward_checked
        else "forward only"
    )
    return (
        f"{run.limits.dtype} autocast on {run.device}, {backward}, torch {run.torch_version}, "
        f"{len(report.trace.calls)} module calls"
    )


# Each section: the report in, zero or more sections out (in the order the document shows them).
SectionFn = Callable[["ReportData", int], list[Section]]


def divergence_section(report: ReportData, max_rows: int) -> list[Section]:
    d = report.findings.divergence
    if d is None:
        return []
    said = [Para(line) for line in divergence_lines(d)]
    said += [Para(f"try: {advice}", 2) for advice in d.advice]
    return [Section(DIVERGENCE_TITLE, tuple(said))]


def origin_sections(report: ReportData, max_rows: int) -> list[Section]:
    f = report.findings
    return [origin_section(o, report.trace.scale) for o in (f.forward_origin, f.backward_origin) if o is not None]


def propagation_section(report: ReportData, max_rows: int) -> list[Section]:
    labels = report.findings.propagation
    if not labels:
        return []
    return [Section(f"Propagation: {len(labels)} other call(s) carry the bad values", (Para(inline_names(labels)),))]


def hidden_section(report: ReportData, max_rows: int) -> list[Section]:
    hidden = report.findings.hidden
    if not hidden:
        return []
    rows: list[list[object]] = [list(r) for r in hidden_rows(hidden, max_rows)]
    table = make_table(HIDDEN_HEADERS, rows, total=len(hidden), shown_as=HIDDEN_SHOWN)
    return [Section(hidden_title(hidden), (Para(hidden_note(hidden)), table))]


def loss_scale_section(report: ReportData, max_rows: int) -> list[Section]:
    s = report.findings.scale
    if s is None:
        return []
    probes = ", ".join(f"{fmt_num(p.scale)}:{'ok' if p.gradients_finite else 'inf'}" for p in s.probes)
    rerun = f"; re-run at {probes}" if probes else ""  # at scale 1 there is no lower scale to re-run at
    body: list[Block] = [Para(f"gradients non-finite at scale {fmt_num(s.used_scale)}{rerun}")]
    if s.largest_finite_scale is None:
        body.append(Para("non-finite even at scale 1: a real defect, not a loss-scale problem"))
    else:
        share = s.lost_share_at_largest
        body.append(
            Para(
                f"largest finite scale {fmt_num(s.largest_finite_scale)}; gradient values lost to zero there: "
                + (f"{share:.2%}" if share is not None else "unknown")
                + (" (harmless)" if s.harmless else "")
            )
        )
    return [Section("Loss scale", tuple(body))]


def window_section(report: ReportData, max_rows: int) -> list[Section]:
    w = report.findings.window
    if w is None:
        return []
    if w.empty:
        first = f"empty: no power-of-two scale avoids overflow and keeps 99% of gradient values ({w.reference})"
    else:
        where = "inside" if w.contains_current else "OUTSIDE"
        first = (
            f"useful scales [{fmt_num(w.min_useful)}, {fmt_num(w.max_safe)}]; "
            f"current {fmt_num(w.current)} is {where} ({w.reference})"
        )
    probes = ", ".join(
        f"{fmt_num(p.scale)}:" + (f"{p.lost_share:.1%} lost" if p.lost_share is not None else "inf")
        for p in w.probes
    )
    probed = f"measured at {probes}" if w.measured else f"by arithmetic on the survey's records, not re-run: {probes}"
    return [Section("Loss-scale window", (Para(first), Para(probed)))]


def precision_section(report: ReportData, max_rows: int) -> list[Section]:
    prec = report.findings.precision
    if prec is None:
        return []
    body: list[Block] = [Para(f"error jumps at {prec.jump}" if prec.jump else "no call stands out")]
    if prec.underflow_calls:
        body.append(Para(f"forward underflow (nonzero in float32, zero here) in: {inline_names(prec.underflow_calls)}"))
    rows: list[list[object]] = [
        [c.label, c.path, fmt_num(c.relative_error), fmt_num(c.sqnr_db), c.underflow_count, c.reference_nonzero]
        for c in sorted(prec.comparisons, key=lambda c: -c.relative_error)[:max_rows]
    ]
    headers = ("call", "tensor", "rel. error", "SQNR dB", "underflowed", "fp32 nonzero")
    body.append(make_table(headers, rows, len(prec.comparisons)))
    return [Section("Against a float32 re-run of each call", tuple(body))]


def underflow_section(report: ReportData, max_rows: int) -> list[Section]:
    u = report.findings.underflow
    if u is None:
        return []
    body: list[Block] = [
        Para(
            f"{u.lost} of {u.reference_nonzero} nonzero gradient values ({u.share:.2%}) became zero; "
            f"reference: {u.reference}"
        )
    ]
    rows: list[list[object]] = [
        [s.module or "<root>", s.lost, s.reference_nonzero, f"{s.share:.1%}"] for s in u.spots[:max_rows]
    ]
    if rows:
        body.append(make_table(("module", "lost", "ref nonzero", "share"), rows, len(u.spots)))
    return [Section("Gradient underflow", tuple(body))]


def near_limit_section(report: ReportData, max_rows: int) -> list[Section]:
    near = report.findings.near_limit
    if not near:
        return []
    rows: list[list[object]] = [
        [n.label, n.tensor, fmt_num(n.abs_max), f"{n.headroom_bits:.2f}"] for n in near[:max_rows]
    ]
    title = f"Near the {report.run.limits.dtype} max (< 1 bit of headroom)"
    return [Section(title, (make_table(("call", "tensor", "|x|max", "headroom bits"), rows, len(near)),))]


def not_captured_section(report: ReportData, max_rows: int) -> list[Section]:
    missed = report.findings.not_captured
    if not missed:
        return []
    title = f"Gradient not observed for {len(missed)} call(s) (output unused by the loss, or not capturable)"
    return [Section(title, (Para(inline_names(missed, 10)),))]


def warnings_section(report: ReportData, max_rows: int) -> list[Section]:
    warnings = report.findings.warnings
    return [Section("Warnings", tuple(Para(w) for w in warnings))] if warnings else []


def recommendations_section(report: ReportData, max_rows: int) -> list[Section]:
    items = []
    for i, rec in enumerate(report.recommendations, 1):
        details = [f"evidence: {rec.evidence}"] if rec.evidence else []
        cost = cost_text(rec)
        if cost is not None:
            details.append(f"cost: {cost}")
        items.append(Item(i, rec.title, rec.verified, tuple(details), rec.snippet))
    return [Section("Recommendations", tuple(items))] if items else []


def steps_section(report: ReportData, max_rows: int) -> list[Section]:
    steps = _steps(report, max_rows)
    return [Section("Training steps", tuple(steps))] if steps else []


def headroom_section(report: ReportData, max_rows: int) -> list[Section]:
    if not report.trace.calls:
        return []
    rows = ReportRows.of(report)
    inside = {c.call.index: c for c in rows.calls if c.op_peak is not None}
    ranked = rows.by_headroom()
    if inside:  # a call whose own ops peak above its outputs ranks by that peak (the scores inside an attention)
        ranked.sort(key=lambda r: _least(r.headroom_bits, inside.get(-1 if r.call_index is None else r.call_index)))
    headers: tuple[str, ...] = ("call", "class", "tensor", "dtype", "|x|max", "headroom bits")
    table_rows: list[list[object]] = [
        [r.label, r.class_name, r.tensor, r.stats.dtype, fmt_num(r.stats.abs_max), bits_text(r.headroom_bits)]
        for r in ranked[:max_rows]
    ]
    if inside:
        headers += ("inside: op peak",)
        for cells, r in zip(table_rows, ranked):
            call = inside.get(-1 if r.call_index is None else r.call_index)
            cells.append(op_peak_text(call) if call is not None else "")
    return [Section("Layers by headroom", (make_table(headers, table_rows, len(ranked)),))]


def _least(bits: Optional[float], call: Optional[CallRow]) -> float:
    """The sort key of a headroom row: its own bits, or its call's op peak's when that is less."""
    own = bits if bits is not None else math.inf
    if call is not None and call.op_headroom_bits is not None:
        return min(own, call.op_headroom_bits)
    return own


def failed_passes_section(report: ReportData, max_rows: int) -> list[Section]:
    failed = failed_passes(report)
    if not failed:
        return []
    title = f"{len(failed)} optional pass(es) failed or skipped; the findings stand on the others"
    return [Section(title, tuple(Para(line) for line in failed))]


def notes_section(report: ReportData, max_rows: int) -> list[Section]:
    run = report.run
    notes = [n for n in (run.autocast_note, *run.notes) if n]
    return [Section("Notes", tuple(Para(n) for n in notes))] if notes else []


SECTIONS: tuple[SectionFn, ...] = (
    divergence_section,
    origin_sections,
    propagation_section,
    hidden_section,
    loss_scale_section,
    window_section,
    precision_section,
    underflow_section,
    near_limit_section,
    not_captured_section,
    warnings_section,
    recommendations_section,
    steps_section,
    headroom_section,
    failed_passes_section,
    notes_section,
)


def build_document(report: ReportData, max_rows: int = 20) -> Document:
    """Everything the text and markdown reports say, in order: each of :data:`SECTIONS` in turn."""
    sections = [section for make in SECTIONS for section in make(report, max_rows)]
    return Document(report.findings.verdict, _head(report), _facts(report), tuple(sections), alerts(report))


def _steps(report: ReportData, max_rows: int) -> list[Block]:
    """For ``ampdoctor.watch`` reports: the scale history and every skipped step with its explanation."""
    steps = report.steps
    if not steps:
        return []
    skipped = [s for s in steps if s.skipped]
    unguarded = [s for s in steps if s.unguarded]
    listed = [s for s in steps if s.skipped or not s.grads_finite]
    scales = [steps[0].scale] + [s.scale for a, s in zip(steps, steps[1:]) if s.scale != a.scale]
    history = " -> ".join(fmt_num(v) for v in scales[:12]) + (" ..." if len(scales) > 12 else "")
    applied = f", {len(unguarded)} with non-finite gradients that no GradScaler skipped" if unguarded else ""
    body: list[Block] = [Para(f"{len(steps)} step(s) recorded, {len(skipped)} skipped{applied}; scale {history}")]
    rows: list[list[object]] = [
        [
            s.step,
            s.rank,
            fmt_num(s.scale),
            s.run or "-",
            "finite" if s.forward_finite else "non-finite",
            s.forward_origin or "-",
            s.backward_origin or "-",
        ]
        for s in listed[:max_rows]
    ]
    if rows:
        first = "bad step" if unguarded else "skipped step"
        headers = (first, "rank", "scale", "run", "forward", "forward origin", "backward origin")
        body.append(make_table(headers, rows, len(listed)))
    return body
