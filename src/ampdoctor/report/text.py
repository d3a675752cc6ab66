"""Plain-text rendering of a Report (tabulate). Pure: small functions from records to strings."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

from tabulate import tabulate

from ..analysis import Origin, headroom_bits
from ..records import BATCH, LOSS, OpFinding, TensorStats

if TYPE_CHECKING:
    from .report import Report


def fmt_num(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if value != value:
        return "nan"
    if value in (float("inf"), float("-inf")):
        return "inf" if value > 0 else "-inf"
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.3e}"


def describe_bad(stats: TensorStats) -> str:
    """'3 NaN, 12 +inf of 4096 values' when counted; else what the survey saw."""
    if stats.detailed:
        parts = [
            f"{n} {label}"
            for n, label in ((stats.nan_count, "NaN"), (stats.posinf_count, "+inf"), (stats.neginf_count, "-inf"))
            if n
        ]
        return f"{', '.join(parts)} of {stats.numel} values"
    seen = ((stats.has_nan, "NaN"), (stats.has_posinf, "+inf"), (stats.has_neginf, "-inf"))
    flags = [label for flag, label in seen if flag]
    return "holds " + "/".join(flags)


def describe_op(op: OpFinding) -> str:
    inputs = ", ".join(f"{d} |x|max {fmt_num(a)}" for d, a in zip(op.input_dtypes, op.input_abs_max))
    text = f"op {op.op} ({inputs}) -> {op.output_dtype}"
    if op.node:
        text += f" in autograd node {op.node}"
    if op.location is not None:
        loc = op.location
        where = "created in the forward at" if op.direction == "backward" else "at"
        text += f"\n    {where} {os.path.basename(loc.file)}:{loc.line} in {loc.function}: {loc.code}"
    return text


def describe_origin(origin: Origin, origin_scale: float = 1.0) -> list[str]:
    title = "Forward origin" if origin.direction == "forward" else f"Backward origin (at scale {origin_scale:g})"
    if origin.module == BATCH:
        return [f"{title}: the batch itself ({origin.tensor} {describe_bad(origin.bad)}); nothing in the model ran yet"]
    if origin.module == LOSS:
        head = (
            f"{title}: the loss function (model output finite, |x|max {fmt_num(origin.input_abs_max)}; "
            f"loss {describe_bad(origin.bad)})"
            if origin.direction == "forward"
            else f"{title}: outside the model: the gradient of the loss reaching the model is already non-finite"
        )
        lines = [head]
    else:
        exact = "" if origin.exact else " (approximate: no call matched the origin rule; first non-finite call)"
        lines = [f"{title}: {origin.label} ({origin.class_name}){exact}"]
        received = "inputs" if origin.direction == "forward" else "incoming gradient"
        lines.append(
            f"  {received} finite (|x|max {fmt_num(origin.input_abs_max)}); "
            f"its own code made {origin.tensor} non-finite: {describe_bad(origin.bad)}"
        )
    if origin.op is not None:
        lines.append("  " + describe_op(origin.op))
    return lines


def _section(title: str, body: list[str]) -> list[str]:
    return ["", title, *body] if body else []


def render_text(report: Report, max_rows: int = 20) -> str:
    f, run = report.findings, report.run
    origin = f.forward_origin or f.backward_origin
    head = f"ampdoctor: {f.verdict.upper()}"
    if origin is not None:
        head += f" - {origin.direction} origin: {origin.label}"
    lines = [
        head,
        f"  {run.limits.dtype} autocast on {run.device}, loss scale {run.scale:g} ({run.scale_source}), "
        f"loss from {run.loss_source}, torch {run.torch_version}, {len(report.trace.calls)} module calls",
    ]
    for origin_ in (f.forward_origin, f.backward_origin):
        if origin_ is not None:
            lines += ["", *describe_origin(origin_, report.trace.scale)]
    if f.propagation:
        shown = ", ".join(f.propagation[:8]) + (" ..." if len(f.propagation) > 8 else "")
        lines += _section(f"Propagation: {len(f.propagation)} other call(s) carry the bad values", ["  " + shown])
    if f.scale is not None:
        probes = ", ".join(f"{p.scale:g}:{'ok' if p.gradients_finite else 'inf'}" for p in f.scale.probes)
        body = [f"  gradients non-finite at scale {f.scale.used_scale:g}; re-run at {probes}"]
        if f.scale.largest_finite_scale is None:
            body.append("  non-finite even at scale 1: a real defect, not a loss-scale problem")
        else:
            share = f.scale.lost_share_at_largest
            body.append(
                f"  largest finite scale {f.scale.largest_finite_scale:g}; gradient values lost to zero there: "
                + (f"{share:.2%}" if share is not None else "unknown")
                + (" (harmless)" if f.scale.harmless else "")
            )
        lines += _section("Loss scale", body)
    if f.window is not None:
        w = f.window
        if w.empty:
            body = [f"  empty: no power-of-two scale avoids overflow and keeps 99% of gradient values ({w.reference})"]
        else:
            where = "inside" if w.contains_current else "OUTSIDE"
            body = [
                f"  useful scales [{fmt_num(w.min_useful)}, {fmt_num(w.max_safe)}]; "
                f"current {w.current:g} is {where} ({w.reference})"
            ]
        probes = ", ".join(
            f"{p.scale:g}:" + (f"{p.lost_share:.1%} lost" if p.lost_share is not None else "inf") for p in w.probes
        )
        body.append(f"  measured at {probes}")
        lines += _section("Loss-scale window", body)
    if f.precision is not None:
        prec = f.precision
        rows = [
            [c.label, c.path, fmt_num(c.relative_error), fmt_num(c.sqnr_db), c.underflow_count, c.reference_nonzero]
            for c in sorted(prec.comparisons, key=lambda c: -c.relative_error)[:max_rows]
        ]
        body = [f"  error jumps at {prec.jump}" if prec.jump else "  no call stands out"]
        if prec.underflow_calls:
            shown = ", ".join(prec.underflow_calls[:8])
            body.append(f"  forward underflow (nonzero in float32, zero here) in: {shown}")
        body.append(
            tabulate(
                rows,
                headers=["call", "tensor", "rel. error", "SQNR dB", "underflowed", "fp32 nonzero"],
                tablefmt="simple",
            )
        )
        lines += _section("Against a float32 re-run of each call", body)
    if f.underflow is not None:
        u = f.underflow
        body = [
            f"  {u.lost} of {u.reference_nonzero} nonzero gradient values ({u.share:.2%}) became zero; "
            f"reference: {u.reference}"
        ]
        rows = [[s.module or "<root>", s.lost, s.reference_nonzero, f"{s.share:.1%}"] for s in u.spots[:max_rows]]
        if rows:
            body.append(tabulate(rows, headers=["module", "lost", "ref nonzero", "share"], tablefmt="simple"))
        lines += _section("Gradient underflow", body)
    if f.near_limit:
        rows = [[n.label, n.tensor, fmt_num(n.abs_max), f"{n.headroom_bits:.2f}"] for n in f.near_limit[:max_rows]]
        lines += _section(
            f"Near the {run.limits.dtype} max (< 1 bit of headroom)",
            [tabulate(rows, headers=["call", "tensor", "|x|max", "headroom bits"], tablefmt="simple")],
        )
    if f.not_captured:
        shown = ", ".join(f.not_captured[:10]) + (" ..." if len(f.not_captured) > 10 else "")
        lines += _section(
            f"Gradient not observed for {len(f.not_captured)} call(s) (output unused by the loss, or not capturable)",
            ["  " + shown],
        )
    lines += _section("Warnings", ["  " + w for w in f.warnings])
    rec_lines: list[str] = []
    for i, rec in enumerate(report.recommendations, 1):
        status = " [verified]" if rec.verified else ""
        rec_lines.append(f"  {i}. {rec.title}{status}")
        if rec.evidence:
            rec_lines.append(f"       evidence: {rec.evidence}")
        if rec.cost is not None:
            cost = rec.cost
            rec_lines.append(
                f"       cost: +{cost.extra_activation_bytes / 1024:.1f} KiB of activations, "
                f"{cost.fp32_matmul_flop_share:.1%} of Linear/Conv FLOPs in float32"
                + (f" ({cost.note})" if cost.note else "")
            )
        rec_lines += ["       " + line for line in rec.snippet.splitlines()]
    lines += _section("Recommendations", rec_lines)
    lines += _section("Training steps", _steps(report, max_rows))
    if report.trace.calls:
        lines += _section("Layers by headroom", [_headroom_table(report, max_rows)])
    lines += _section("Notes", ["  " + n for n in [run.autocast_note, *run.notes] if n])
    return "\n".join(lines)


def _steps(report: Report, max_rows: int) -> list[str]:
    """For ``ampdoctor.watch`` reports: the scale history and every skipped step with its explanation."""
    steps = report.steps
    if not steps:
        return []
    skipped = [s for s in steps if s.skipped]
    scales = [steps[0].scale] + [s.scale for a, s in zip(steps, steps[1:]) if s.scale != a.scale]
    history = " -> ".join(f"{v:g}" for v in scales[:12]) + (" ..." if len(scales) > 12 else "")
    body = [f"  {len(steps)} step(s) recorded, {len(skipped)} skipped; scale {history}"]
    rows = [
        [
            s.step,
            s.rank,
            f"{s.scale:g}",
            s.run or "-",
            "finite" if s.forward_finite else "non-finite",
            s.forward_origin or "-",
            s.backward_origin or "-",
        ]
        for s in skipped[:max_rows]
    ]
    if rows:
        headers = ["skipped step", "rank", "scale", "run", "forward", "forward origin", "backward origin"]
        body.append(tabulate(rows, headers=headers, tablefmt="simple"))
    return body


def _headroom_table(report: Report, max_rows: int) -> str:
    """The calls with the least headroom in their outputs, smallest first."""
    limits = report.run.limits
    rows = []
    for c in report.trace.calls:
        for r in c.outputs:
            if not r.stats.measured:
                continue
            bits = headroom_bits(r.stats.abs_max, limits) if r.stats.is_finite else None
            rows.append((bits if bits is not None else -1.0, c.label, c.class_name, r.path, r.stats))
    rows.sort(key=lambda row: row[0])
    table = [
        [label, cls, path, s.dtype, fmt_num(s.abs_max), "non-finite" if bits < 0 else f"{bits:.2f}"]
        for bits, label, cls, path, s in rows[:max_rows]
    ]
    return tabulate(table, headers=["call", "class", "tensor", "dtype", "|x|max", "headroom bits"], tablefmt="simple")


def render_markdown(report: Report, max_rows: int = 20) -> str:
    """The text report inside a fenced block, with the verdict as a heading (for issues and PRs)."""
    text = render_text(report, max_rows=max_rows)
    return f"## ampdoctor: {report.verdict}\n\n```text\n{text}\n```\n"
