"""HTML rendering of a Report: Jupyter's ``_repr_html_`` and a standalone page. Pure: records in, a string out.

Every user string (module and class names, tensor paths, source lines, snippets) goes through ``html.escape``.
No JavaScript: sections fold with ``<details>``. The stylesheet ships as package data and is read once. The
HTML part is marked ``hidden`` and shown by that stylesheet, so a viewer that strips ``<style>`` shows the
``<pre>`` text report instead (the idea of xarray's ``formatting_html``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from importlib import resources
from typing import TYPE_CHECKING

from ..analysis import Origin
from ..records import BATCH, LOSS, FormatLimits
from ..thresholds import HEADROOM_WARN_BITS
from .document import (
    DIVERGENCE_TITLE,
    FROM_SAVED,
    alerts,
    describe_bad,
    describe_origin,
    discarded_text,
    divergence_lines,
    failed_passes,
    fmt_num,
    verdict_text,
)
from .hidden_rows import HIDDEN_HEADERS, HIDDEN_SHOWN, hidden_note, hidden_rows, hidden_title
from .html_parts import _code, _e, _names, _pre, _shape, _td
from .html_tables import COLLAPSE_MIN_RUN, FULL_TABLE_ROWS, backward_section, forward_section, steps_section
from .rows import left_out_line
from .text import render_text

if TYPE_CHECKING:
    from ..records import Recommendation
    from .data import ReportData

__all__ = ["COLLAPSE_MIN_RUN", "FULL_TABLE_ROWS", "render_html", "render_html_page", "stylesheet"]


@functools.cache
def stylesheet() -> str:
    """The package's ``static/report.css`` (read once per process)."""
    return resources.files("ampdoctor").joinpath("static/report.css").read_text(encoding="utf-8")


# -- banner and cards --------------------------------------------------------------------------------------


def _banner(report: ReportData) -> str:
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
        f"{run.limits.dtype} autocast on {run.device} · loss scale {fmt_num(run.scale)} ({run.scale_source}) · "
        f"loss from {run.loss_source} · {run.model_class} · {len(report.trace.calls)} module calls · "
        f"torch {run.torch_version}"
    )
    if not run.backward_checked:
        where += " (forward only: no gradient was checked)"
    if f.divergence is not None:
        where += f" · divergence from step {_e(f.divergence.began)}"
    notices = "".join(f'<div class="ad-alert">{_e(a)}</div>' for a in alerts(report))
    return (
        f'<div class="ad-banner ad-v-{_e(css)}"><span class="ad-verdict">{_e(verdict_text(report))}</span>{where}'
        f'<div class="ad-facts">{_e(facts)}</div>{notices}</div>'
    )


def _dl(items: Sequence[tuple[str, str]]) -> str:
    return "<dl>" + "".join(f"<dt>{_e(k)}</dt><dd>{v}</dd>" for k, v in items) + "</dl>"


def _origin_card(origin: Origin, limits: FormatLimits, scale: float) -> str:
    lines = describe_origin(origin, scale)
    title = "Forward origin" if origin.direction == "forward" else f"Backward origin (at scale {fmt_num(scale)})"
    items: list[tuple[str, str]] = []
    if origin.module in (BATCH, LOSS):
        head = _e(lines[0])
    else:
        head = f"{_e(title)}: {_code(origin.label)} <span class=\"ad-muted\">{_e(origin.class_name)}</span>"
        if not origin.exact:
            head += (
                ' <span class="ad-approx">(approximate: no call matched the origin rule; first non-finite call)</span>'
            )
        items.append(("module", f"{_code(origin.module or '<root>')} (call {_e(origin.call)})"))
        items.append(("class", _e(origin.class_name or "-")))
        received = "inputs" if origin.direction == "forward" else "incoming gradient"
        if origin.input_abs_max is not None:
            proof = f"finite, largest magnitude {_e(fmt_num(origin.input_abs_max))}"
            if origin.direction == "backward" and scale != 1.0:
                proof += f" (× scale {fmt_num(scale)} = {_e(fmt_num(origin.input_abs_max * scale))} as held)"
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
            f"{_e(n)} {label}"
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
                (where, f"{_code(f'{loc.file}:{loc.line}')} in {_code(loc.function)}<pre>{_pre(loc.code)}</pre>")
            )
    if op is not None and op.from_saved:
        items.append(("saved value", _e(FROM_SAVED)))
    if op is not None and op.discarded:
        items.append(("made and discarded", _e(f"{discarded_text(op)} (not the cause)")))
    if origin.policy_note:
        items.append(("CPU policy", _e(origin.policy_note)))
    items.append(
        (
            "format",
            f"{_e(limits.dtype)}: max {fmt_num(limits.max)}, |x| ≥ {fmt_num(limits.overflow_threshold)} becomes inf, "
            f"smallest normal {fmt_num(limits.tiny)}",
        )
    )
    return f'<div class="ad-card"><h4>{head}</h4>{_dl(items)}</div>'


def _section(title: str, body: str) -> str:
    return f'<div class="ad-section"><h4>{_e(title)}</h4>{body}</div>' if body else ""


def _findings_sections(report: ReportData) -> str:
    f, run = report.findings, report.run
    parts: list[str] = []
    if f.divergence is not None:
        items = [f"<li>{_e(line)}</li>" for line in divergence_lines(f.divergence)]
        advice = "".join(f"<li>{_e(a)}</li>" for a in f.divergence.advice)
        parts.append(_section(DIVERGENCE_TITLE, f"<ul>{''.join(items)}</ul><p>Try:</p><ul>{advice}</ul>"))
    if f.propagation:
        parts.append(
            _section(
                "Propagation",
                f"<p>{len(f.propagation)} later call(s) carry the bad values: {_names(f.propagation)}</p>",
            )
        )
    if f.hidden:
        head = "".join(f"<th>{_e(h)}</th>" for h in HIDDEN_HEADERS)
        shown = hidden_rows(f.hidden)
        body = "".join('<tr class="ad-warn">' + "".join(_td(cell) for cell in row) + "</tr>" for row in shown)
        more = len(f.hidden) - len(shown)
        cut = f'<p class="ad-muted">{_e(left_out_line(more, len(shown), HIDDEN_SHOWN))}</p>' if more > 0 else ""
        parts.append(_section(hidden_title(f.hidden), f"<p>{_e(hidden_note(f.hidden))}</p>"
                              f'<table class="ad-calls"><tr>{head}</tr>{body}</table>{cut}'))
    if f.scale is not None:
        s = f.scale
        probes = ", ".join(f"{fmt_num(p.scale)}: {'finite' if p.gradients_finite else 'non-finite'}" for p in s.probes)
        items = [f"<li>gradients non-finite at scale {fmt_num(s.used_scale)}; re-runs at {_e(probes)}</li>"]
        if s.largest_finite_scale is None:
            items.append("<li>non-finite even at scale 1: a real defect, not a loss-scale problem</li>")
        else:
            share = "unknown" if s.lost_share_at_largest is None else f"{s.lost_share_at_largest:.2%}"
            harmless = " (harmless: GradScaler's skip-and-back-off handles it)" if s.harmless else ""
            items.append(
                f"<li>largest finite scale {fmt_num(s.largest_finite_scale)}; gradient values lost to zero there: "
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
                f"<p>{_e(u.lost)} of {_e(u.reference_nonzero)} nonzero gradient values ({u.share:.2%}) became zero; "
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
                f"Near the {run.limits.dtype} max (< {fmt_num(HEADROOM_WARN_BITS)} bit of headroom)",
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
    failed = failed_passes(report)
    if failed:
        title = f"{len(failed)} optional pass(es) failed or skipped; the findings stand on the others"
        parts.append(_section(title, "<ul>" + "".join(f"<li>{_e(line)}</li>" for line in failed) + "</ul>"))
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
    snippet = f"<pre><code>{_pre(rec.snippet)}</code></pre>" if rec.snippet else ""
    return f"<li>{_e(rec.title)}{badge}{extra}{snippet}</li>"


def _recommendations(report: ReportData) -> str:
    if not report.recommendations:
        return ""
    items = "".join(_recommendation(r) for r in report.recommendations)
    return f'<div class="ad-section ad-recs"><h4>Recommendations</h4><ol>{items}</ol></div>'


def _run_section(report: ReportData) -> str:
    run = report.run
    items = [
        ("device", _e(run.device)),
        ("format", _e(run.limits.dtype)),
        ("loss scale", _e(f"{fmt_num(run.scale)} ({run.scale_source})")),
        ("loss", _e(run.loss_source)),
        ("model", _code(run.model_class)),
        ("versions", _e(f"torch {run.torch_version}, ampdoctor {run.ampdoctor_version}, "
                        f"report schema {report.schema_version}")),
    ]
    notes = [n for n in (run.autocast_note, *run.notes) if n]
    body = _dl(items) + ("<ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>" if notes else "")
    return f"<details><summary>Run details and notes</summary>{body}</details>"


# -- entry points ------------------------------------------------------------------------------------------


def render_html(report: ReportData) -> str:
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
            steps_section(report),
            forward_section(report),
            backward_section(report),
            _run_section(report),
        )
    )
    return (
        f"<style>{stylesheet()}</style>"
        '<div class="ampdoctor">'
        f'<pre class="ad-text-fallback">{_pre(render_text(report))}</pre>'
        f'<div class="ad-wrap" hidden>{body}</div>'
        "</div>"
    )


def render_html_page(report: ReportData) -> str:
    """A standalone HTML document (``--format html``): the same report, viewable in any browser."""
    origin = report.forward_origin or report.backward_origin
    title = f"ampdoctor: {report.verdict}" + (" on random input" if report.run.random_input else "")
    title += f" at {origin.label}" if origin is not None else ""
    title += f" ({report.run.model_class})"
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title></head>"
        f'<body class="ad-page">{render_html(report)}</body></html>\n'
    )
