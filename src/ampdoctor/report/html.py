"""HTML rendering of a Report: Jupyter's ``_repr_html_`` and a standalone page. Pure: records in, a string out.

Every user string (module and class names, tensor paths, source lines, snippets) goes through ``html.escape``.
No JavaScript: sections fold with ``<details>``. The stylesheet ships as package data and is read once. The
HTML part is marked ``hidden`` and shown by that stylesheet, so a viewer that strips ``<style>`` shows the
``<pre>`` text report instead (the idea of xarray's ``formatting_html``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from html import escape
from importlib import resources
from typing import TYPE_CHECKING, Optional

from ..analysis import Origin, forward_creators, headroom_bits, is_mask, origin_event
from ..records import BATCH, LOSS, FormatLimits, GradEvent, ModuleCall, PassTrace, TensorRecord, TensorStats
from ..thresholds import HEADROOM_TIGHT_BITS, HEADROOM_WARN_BITS
from .text import describe_bad, describe_origin, fmt_num, render_text

if TYPE_CHECKING:
    from ..records import Recommendation
    from .report import Report

# Tables longer than this fold runs of unremarkable rows into one summary row ...
FULL_TABLE_ROWS = 60
# ... when the run is at least this long.
COLLAPSE_MIN_RUN = 3
# Names listed inline (propagation, not captured) before "and N more".
INLINE_NAMES = 8

# Row levels, worst first; each is a CSS class ``ad-<level>``.
NONFINITE, WARN, TIGHT, FINE, NONE = "nonfinite", "warn", "tight", "fine", "none"
_LEVEL_RANK = {NONFINITE: 0, WARN: 1, TIGHT: 2, FINE: 3, NONE: 4}


@functools.cache
def stylesheet() -> str:
    """The package's ``static/report.css`` (read once per process)."""
    return resources.files("ampdoctor").joinpath("static/report.css").read_text(encoding="utf-8")


# -- classification ----------------------------------------------------------------------------------------


def level(stats: TensorStats, limits: FormatLimits, scale: float = 1.0) -> str:
    """Colour band of one tensor: non-finite, under 1 bit, under 4 bits of headroom, fine, or not measured.

    Headroom counts only for tensors held in the diagnosed format (``scale`` times the recorded values, for
    gradients); a wider tensor is flagged only when casting it would overflow.
    """
    if not stats.measured:
        return NONE
    if not stats.is_finite:
        return NONFINITE
    if stats.dtype != limits.dtype:
        return WARN if (stats.cast_overflow_count or 0) > 0 else FINE
    bits = headroom_bits(None if stats.abs_max is None else stats.abs_max * scale, limits)
    if bits is None:
        return NONE
    if bits < HEADROOM_WARN_BITS:
        return WARN
    if bits < HEADROOM_TIGHT_BITS:
        return TIGHT
    return FINE


def _low_bits(stats: Optional[TensorStats], limits: FormatLimits, scale: float = 1.0) -> Optional[float]:
    """Headroom of a finite tensor held in the diagnosed format (None for others: their headroom is no risk)."""
    if stats is None or not stats.measured or not stats.is_finite or stats.dtype != limits.dtype:
        return None
    return headroom_bits(None if stats.abs_max is None else stats.abs_max * scale, limits)


def _worst(records: Sequence[TensorRecord], limits: FormatLimits) -> Optional[TensorRecord]:
    """The measured record with the least headroom (non-finite first)."""

    def key(r: TensorRecord) -> tuple[int, float]:
        bits = headroom_bits(r.stats.abs_max, limits)
        return _LEVEL_RANK[level(r.stats, limits)], bits if bits is not None else math.inf

    measured = [r for r in records if r.stats.measured]
    return min(measured, key=key) if measured else None


# -- small pieces ------------------------------------------------------------------------------------------


def _e(value: object) -> str:
    return escape(str(value), quote=True)


def _code(value: object) -> str:
    return f"<code>{_e(value)}</code>"


def _shape(shape: Iterable[int]) -> str:
    dims = list(shape)
    return "×".join(str(d) for d in dims) if dims else "scalar"


def _bits(stats: TensorStats, limits: FormatLimits, scale: float = 1.0) -> str:
    if not stats.measured:
        return ""
    if not stats.is_finite:
        return "non-finite"
    bits = headroom_bits(None if stats.abs_max is None else stats.abs_max * scale, limits)
    if bits is None:
        return "-"
    return "∞" if math.isinf(bits) else f"{bits:.2f}"


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
        (NONFINITE, "inf/NaN"),
        (WARN, f"< {HEADROOM_WARN_BITS:g} bit"),
        (TIGHT, f"< {HEADROOM_TIGHT_BITS:g} bits"),
        (FINE, "fine"),
    )
    return (
        '<span class="ad-legend">'
        + "".join(f'<span class="ad-key ad-{k}"></span>{_e(label)}' for k, label in keys)
        + "</span>"
    )


# -- banner and cards --------------------------------------------------------------------------------------


def _banner(report: Report) -> str:
    f, run = report.findings, report.run
    origin = f.forward_origin or f.backward_origin
    verdict = f.verdict
    css = verdict if verdict != "healthy" or not f.warnings else "warning"
    where = ""
    if origin is not None:
        where = f"{_e(origin.direction)} origin: {_code(origin.label)}"
    elif verdict == "healthy" and f.warnings:
        where = "with warnings"
    facts = (
        f"{run.limits.dtype} autocast on {run.device} · loss scale {run.scale:g} ({run.scale_source}) · "
        f"loss from {run.loss_source} · {run.model_class} · {len(report.trace.calls)} module calls · "
        f"torch {run.torch_version}"
    )
    return (
        f'<div class="ad-banner ad-v-{_e(css)}"><span class="ad-verdict">{_e(verdict.upper())}</span>{where}'
        f'<div class="ad-facts">{_e(facts)}</div></div>'
    )


def _dl(items: Sequence[tuple[str, str]]) -> str:
    return "<dl>" + "".join(f"<dt>{_e(k)}</dt><dd>{v}</dd>" for k, v in items) + "</dl>"


def _origin_card(origin: Origin, limits: FormatLimits, scale: float) -> str:
    lines = describe_origin(origin, scale)
    title = "Forward origin" if origin.direction == "forward" else f"Backward origin (at scale {scale:g})"
    items: list[tuple[str, str]] = []
    if origin.module in (BATCH, LOSS):
        head = _e(lines[0])
    else:
        head = f"{_e(title)}: {_code(origin.label)} <span class=\"ad-muted\">{_e(origin.class_name)}</span>"
        if not origin.exact:
            head += (
                ' <span class="ad-approx">(approximate: no call matched the origin rule; first non-finite call)</span>'
            )
        items.append(("module", f"{_code(origin.module or '<root>')} (call {origin.call})"))
        items.append(("class", _e(origin.class_name or "-")))
        received = "inputs" if origin.direction == "forward" else "incoming gradient"
        if origin.input_abs_max is not None:
            proof = f"finite, largest magnitude {_e(fmt_num(origin.input_abs_max))}"
            if origin.direction == "backward" and scale != 1.0:
                proof += f" (× scale {scale:g} = {_e(fmt_num(origin.input_abs_max * scale))} as held)"
            items.append((received, proof))
        bad = origin.bad
        items.append(
            (
                "made non-finite",
                f"{_code(origin.tensor)}: {_e(describe_bad(bad))} ({_e(bad.dtype)}, {_e(_shape(bad.shape))})",
            )
        )
    op = origin.op
    if op is not None:
        inputs = ", ".join(f"{_e(d)} |x|max {_e(fmt_num(a))}" for d, a in zip(op.input_dtypes, op.input_abs_max))
        made = ", ".join(
            f"{n} {label}"
            for n, label in (
                (op.output_nan_count, "NaN"),
                (op.output_posinf_count, "+inf"),
                (op.output_neginf_count, "-inf"),
            )
            if n
        )
        text = f"{_code(op.op)}({inputs}) → {_e(op.output_dtype)}" + (f": {_e(made)}" if made else "")
        if op.node:
            text += f" in autograd node {_code(op.node)}"
        items.append(("op", text))
        if op.scalar_args:
            items.append(("scalar arguments", _e(", ".join(fmt_num(a) for a in op.scalar_args))))
        if op.location is not None:
            loc = op.location
            where = "created in the forward at" if op.direction == "backward" else "source"
            items.append(
                (where, f"{_code(f'{loc.file}:{loc.line}')} in {_code(loc.function)}<pre>{_e(loc.code)}</pre>")
            )
    items.append(
        (
            "format",
            f"{_e(limits.dtype)}: max {limits.max:g}, |x| ≥ {limits.overflow_threshold:g} becomes inf, "
            f"smallest normal {limits.tiny:g}",
        )
    )
    return f'<div class="ad-card"><h4>{head}</h4>{_dl(items)}</div>'


def _section(title: str, body: str) -> str:
    return f'<div class="ad-section"><h4>{_e(title)}</h4>{body}</div>' if body else ""


def _findings_sections(report: Report) -> str:
    f, run = report.findings, report.run
    parts: list[str] = []
    if f.propagation:
        parts.append(
            _section(
                "Propagation",
                f"<p>{len(f.propagation)} later call(s) carry the bad values: {_names(f.propagation)}</p>",
            )
        )
    if f.scale is not None:
        s = f.scale
        probes = ", ".join(f"{p.scale:g}: {'finite' if p.gradients_finite else 'non-finite'}" for p in s.probes)
        items = [f"<li>gradients non-finite at scale {s.used_scale:g}; re-runs at {_e(probes)}</li>"]
        if s.largest_finite_scale is None:
            items.append("<li>non-finite even at scale 1: a real defect, not a loss-scale problem</li>")
        else:
            share = "unknown" if s.lost_share_at_largest is None else f"{s.lost_share_at_largest:.2%}"
            harmless = " (harmless: GradScaler's skip-and-back-off handles it)" if s.harmless else ""
            items.append(
                f"<li>largest finite scale {s.largest_finite_scale:g}; gradient values lost to zero there: "
                f"{_e(share)}{_e(harmless)}</li>"
            )
        parts.append(_section("Loss scale", "<ul>" + "".join(items) + "</ul>"))
    if f.underflow is not None:
        u = f.underflow
        rows = "".join(
            f"<tr>{_td(_code(s.module or '<root>'), raw=True)}{_td(str(s.lost), True)}"
            f"{_td(str(s.reference_nonzero), True)}{_td(f'{s.share:.1%}', True)}</tr>"
            for s in u.spots[:20]
        )
        table = (
            '<table class="ad-calls"><tr><th>module</th><th>lost</th><th>ref nonzero</th><th>share</th></tr>'
            f"{rows}</table>"
            if rows
            else ""
        )
        parts.append(
            _section(
                "Gradient underflow",
                f"<p>{u.lost} of {u.reference_nonzero} nonzero gradient values ({u.share:.2%}) became zero; "
                f"reference: {_e(u.reference)}</p>{table}",
            )
        )
    if f.near_limit:
        rows = "".join(
            f'<tr class="ad-warn">{_td(_code(n.label), raw=True)}{_td(_code(n.tensor), raw=True)}'
            f"{_td(fmt_num(n.abs_max), True)}{_td(f'{n.headroom_bits:.2f}', True)}</tr>"
            for n in f.near_limit[:20]
        )
        parts.append(
            _section(
                f"Near the {run.limits.dtype} max (< {HEADROOM_WARN_BITS:g} bit of headroom)",
                '<table class="ad-calls"><tr><th>call</th><th>tensor</th><th>|x|max</th><th>headroom bits</th></tr>'
                f"{rows}</table>",
            )
        )
    if f.not_captured:
        parts.append(
            _section(
                "Gradient not observed",
                f"<p>{len(f.not_captured)} call(s) (output unused by the loss, or not capturable): "
                f"{_names(f.not_captured)}</p>",
            )
        )
    if f.warnings:
        parts.append(_section("Warnings", "<ul>" + "".join(f"<li>{_e(w)}</li>" for w in f.warnings) + "</ul>"))
    return "".join(parts)


def _recommendation(rec: Recommendation) -> str:
    badge = (
        '<span class="ad-badge ad-verified">verified</span>'
        if rec.verified
        else '<span class="ad-badge ad-unverified">not verified</span>'
    )
    extra = ""
    if rec.evidence:
        extra += f'<div class="ad-evidence">evidence: {_e(rec.evidence)}</div>'
    if rec.cost is not None:
        cost = rec.cost
        text = (
            f"+{cost.extra_activation_bytes / 1024:.1f} KiB of activations, "
            f"{cost.fp32_matmul_flop_share:.1%} of Linear/Conv FLOPs in float32"
        ) + (f" ({cost.note})" if cost.note else "")
        extra += f'<div class="ad-cost">cost: {_e(text)}</div>'
    snippet = f"<pre><code>{_e(rec.snippet)}</code></pre>" if rec.snippet else ""
    return f"<li>{_e(rec.title)}{badge}{extra}{snippet}</li>"


def _recommendations(report: Report) -> str:
    if not report.recommendations:
        return ""
    items = "".join(_recommendation(r) for r in report.recommendations)
    return f'<div class="ad-section ad-recs"><h4>Recommendations</h4><ol>{items}</ol></div>'


# -- tables ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One table row: its colour level, whether it may fold into a run, a label for run summaries, the cells."""

    level: str
    foldable: str  # "" (always shown), "fine", "carried" (non-finite, passed on) or "skipped" (a training step)
    label: str
    cells: str
    origin: bool = False
    bits: Optional[float] = None


def _fold(rows: Sequence[Row], columns: int, noun: str) -> str:
    """Rows as ``<tr>``s; in a long table, runs of fine (or carried non-finite) rows become one summary row."""
    out: list[str] = []
    fold = len(rows) > FULL_TABLE_ROWS
    i = 0
    while i < len(rows):
        row = rows[i]
        j = i + 1
        if fold and row.foldable:
            while j < len(rows) and rows[j].foldable == row.foldable:
                j += 1
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
            out.append(f'<tr class="{classes}">{r.cells}</tr>')
        i = j
    return "".join(out)


def _depths(calls: Sequence[ModuleCall]) -> dict[int, int]:
    by_index = {c.index: c for c in calls}
    depth: dict[int, int] = {}
    for c in calls:
        d, p = 0, c.parent
        while p is not None and p in by_index:
            d, p = d + 1, by_index[p].parent
        depth[c.index] = d
    return depth


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


def forward_rows(report: Report) -> list[Row]:
    """The forward table: one row per call in completion order, showing its worst output."""
    trace, limits = report.trace, report.run.limits
    origin = report.forward_origin
    creators = {c.index for c in forward_creators(trace)}
    depth = _depths(trace.calls)
    done = sorted((c for c in trace.calls if c.end_order >= 0), key=lambda c: c.end_order)
    unfinished = [c for c in trace.calls if c.end_order < 0]
    rows = []
    for c in [*done, *unfinished]:
        worst = _worst(c.outputs, limits)
        stats = worst.stats if worst is not None else None
        lvl = level(stats, limits) if stats is not None else NONE
        is_origin = origin is not None and (origin.module, origin.call) == (c.module, c.call)
        inputs = [r for r in c.inputs if r.stats.measured]
        in_max = [r.stats.abs_max for r in inputs if r.stats.abs_max is not None]
        in_text = fmt_num(max(in_max)) if in_max else ("-" if not inputs else "")
        if any(not r.stats.is_finite and not is_mask(r) for r in inputs):
            in_text += " + inf/NaN"
        note = ""
        if c.end_order < 0:
            note = "did not complete"
        elif is_origin:
            note = "◀ origin"
        elif c.index in creators:
            note = "made inf/NaN (contains the origin)" if origin is not None else "made inf/NaN"
        elif lvl == NONFINITE:
            note = "carries it"
        if any(is_mask(r) for r in c.inputs):
            note = (note + "; " if note else "") + "mask input"
        more = len([r for r in c.outputs if r.stats.measured]) - 1
        out_name = (worst.path if worst is not None else "-") + (f" (+{more})" if more > 0 else "")
        bits = _low_bits(stats, limits)
        order = str(c.end_order) if c.end_order >= 0 else "-"
        cells = "".join(
            (
                _td(order, True),
                _td(_code(c.label), raw=True, attrs=f' style="padding-left:{0.5 + 0.8 * depth[c.index]:.1f}em"'),
                _td(c.class_name),
                _td(in_text, True),
                _td(out_name),
                _td(stats.dtype if stats else ""),
                _td(_shape(stats.shape) if stats else ""),
                _td(fmt_num(stats.abs_max) if stats else "", True),
                _td(fmt_num(stats.min_abs_nonzero) if stats and stats.min_abs_nonzero is not None else "", True),
                _td(_bits(stats, limits) if stats else "", True),
                _td(_nonfinite(stats) if stats else ""),
                _td(note),
            )
        )
        foldable = ""
        if not note:
            foldable = "fine" if lvl in (FINE, NONE) else ("carried" if lvl == NONFINITE else "")
        elif note == "carries it":
            foldable = "carried"
        rows.append(Row(lvl, foldable, c.label, cells, is_origin, bits))
    return rows


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


def _event_where(e: GradEvent, trace: PassTrace) -> str:
    """The label of the call a gradient event belongs to; a parameter's gradient names the parameter."""
    if e.call is not None and 0 <= e.call < len(trace.calls):
        return trace.calls[e.call].label
    return e.param or "?"


def backward_rows(report: Report) -> list[Row]:
    """The backward table: one row per gradient event in execution order (statistics unscaled)."""
    trace, limits = report.trace, report.run.limits
    scale = trace.scale
    marked = origin_event(trace, report.backward_origin)
    rows = []
    for e in sorted(trace.grad_events, key=lambda e: e.order):
        label = _event_where(e, trace)
        lvl = level(e.stats, limits, scale)
        is_origin = marked is not None and e.order == marked.order
        note = "◀ origin" if is_origin else ("carries it" if lvl == NONFINITE else "")
        if e.via_base:
            note = (note + "; " if note else "") + "via view base"
        s = e.stats
        held = None if s.abs_max is None else s.abs_max * scale
        bits = _low_bits(s, limits, scale)
        cells = "".join(
            (
                _td(str(e.order), True),
                _td(_KIND.get(e.kind, e.kind)),
                _td(_code(label), raw=True),
                _td("" if e.kind == "param" else e.path),
                _td(s.dtype),
                _td(_shape(s.shape)),
                _td(fmt_num(s.abs_max), True),
                _td(fmt_num(held), True),
                _td(fmt_num(s.min_abs_nonzero) if s.min_abs_nonzero is not None else "", True),
                _td(_bits(s, limits, scale), True),
                _td(_nonfinite(s)),
                _td(note),
            )
        )
        foldable = "" if is_origin else {NONFINITE: "carried", FINE: "fine", NONE: "fine"}.get(lvl, "")
        rows.append(Row(lvl, foldable, label, cells, is_origin, bits))
    return rows


def _table(head: Sequence[str], rows: Sequence[Row], noun: str) -> str:
    header = "".join(f"<th>{_e(h)}</th>" for h in head)
    return f'<table class="ad-calls"><tr>{header}</tr>{_fold(rows, len(head), noun)}</table>'


def _counts(rows: Sequence[Row]) -> str:
    n = {k: sum(1 for r in rows if r.level == k) for k in (NONFINITE, WARN, TIGHT)}
    parts = [
        f"{n[NONFINITE]} non-finite",
        f"{n[WARN]} under {HEADROOM_WARN_BITS:g} bit",
        f"{n[TIGHT]} under {HEADROOM_TIGHT_BITS:g} bits",
    ]
    return ", ".join(parts)


def _forward_section(report: Report) -> str:
    rows = forward_rows(report)
    if not rows:
        return ""
    limits = report.run.limits
    summary = (
        f"Forward: {len(rows)} module calls ({_counts(rows)}); headroom = log2({limits.max:g} / |x|max)"
    )
    return (
        f"<details open><summary>{_e(summary)} {_legend()}</summary>"
        f"{_table(_FORWARD_HEAD, rows, 'calls')}</details>"
    )


def _backward_section(report: Report) -> str:
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
        f"{trace.scale:g}"
    )
    return (
        f"<details{is_open}><summary>{_e(summary)} {_legend()}</summary>"
        f"{_table(_BACKWARD_HEAD, rows, 'gradients')}</details>"
    )


_STEPS_HEAD = ("step", "loss", "scale", "optimizer step", "forward", "origin", "non-finite gradients", "rank")


def steps_rows(report: Report) -> list[Row]:
    """The training steps that ``ampdoctor.watch`` recorded, one row each."""
    rows = []
    for st in report.steps:
        bad = st.skipped or not st.forward_finite
        origins = [o for o in (st.forward_origin, st.backward_origin) if o]
        params = st.nonfinite_params
        shown = ", ".join(params[:3]) + (f" and {len(params) - 3} more" if len(params) > 3 else "")
        cells = "".join(
            (
                _td(str(st.step), True),
                _td(fmt_num(st.loss), True),
                _td(f"{st.scale:g}", True),
                _td("skipped" if st.skipped else "taken"),
                _td("finite" if st.forward_finite else "non-finite"),
                _td(" / ".join(_code(o) for o in origins), raw=True),
                _td(shown),
                _td(str(st.rank), True),
            )
        )
        foldable = "" if origins else ("skipped" if bad else "fine")
        rows.append(Row(NONFINITE if bad else FINE, foldable, f"step {st.step}", cells))
    return rows


def _steps_section(report: Report) -> str:
    steps = report.steps
    if not steps:
        return ""
    skipped = sum(1 for st in steps if st.skipped)
    summary = f"Training steps: {len(steps)} ({skipped} skipped; scale {steps[0].scale:g} → {steps[-1].scale:g})"
    is_open = " open" if skipped or not all(st.forward_finite for st in steps) else ""
    return (
        f"<details{is_open}><summary>{_e(summary)}</summary>"
        f"{_table(_STEPS_HEAD, steps_rows(report), 'steps')}</details>"
    )


def _run_section(report: Report) -> str:
    run = report.run
    items = [
        ("device", _e(run.device)),
        ("format", _e(run.limits.dtype)),
        ("loss scale", _e(f"{run.scale:g} ({run.scale_source})")),
        ("loss", _e(run.loss_source)),
        ("model", _code(run.model_class)),
        ("versions", _e(f"torch {run.torch_version}, ampdoctor {run.ampdoctor_version}, "
                        f"report schema {report.schema_version}")),
    ]
    notes = [n for n in (run.autocast_note, *run.notes) if n]
    body = _dl(items) + ("<ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>" if notes else "")
    return f"<details><summary>Run details and notes</summary>{body}</details>"


# -- entry points ------------------------------------------------------------------------------------------


def render_html(report: Report) -> str:
    """An HTML fragment (Jupyter's ``_repr_html_``): the stylesheet, the report, and a ``<pre>`` text fallback."""
    f, run = report.findings, report.run
    cards = "".join(
        _origin_card(o, run.limits, report.trace.scale) for o in (f.forward_origin, f.backward_origin) if o
    )
    body = "".join(
        (
            _banner(report),
            cards,
            _findings_sections(report),
            _recommendations(report),
            _steps_section(report),
            _forward_section(report),
            _backward_section(report),
            _run_section(report),
        )
    )
    return (
        f"<style>{stylesheet()}</style>"
        '<div class="ampdoctor">'
        f'<pre class="ad-text-fallback">{_e(render_text(report))}</pre>'
        f'<div class="ad-wrap" hidden>{body}</div>'
        "</div>"
    )


def render_html_page(report: Report) -> str:
    """A standalone HTML document (``--format html``): the same report, viewable in any browser."""
    origin = report.forward_origin or report.backward_origin
    title = f"ampdoctor: {report.verdict}" + (f" at {origin.label}" if origin is not None else "")
    title += f" ({report.run.model_class})"
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title></head>"
        f'<body class="ad-page">{render_html(report)}</body></html>\n'
    )
