"""Plain-text rendering of a checkpoint scan (pure: records in, a string out)."""

from __future__ import annotations

import math
import textwrap
from typing import Optional

from tabulate import tabulate

from ..analysis.headroom import headroom_bits
from ..checkpoint.scan_analysis import LOW_SCALER_SCALE
from ..checkpoint.scan_records import ModuleSummary, ScanReport
from .text import fmt_num

_TEXT_WIDTH = 116  # finding details are wrapped to this width in the text report


def _bits(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.2f}"


def _share(part: int, whole: Optional[int]) -> str:
    return f"{part} ({part / whole:.1%})" if part and whole else str(part)


def _verdict_line(report: ScanReport) -> str:
    errors = report.errors()
    head = f"ampdoctor scan: {report.verdict.upper()}"
    if errors:
        more = f" (+{len(errors) - 1} more finding(s))" if len(errors) > 1 else ""
        return f"{head} - {errors[0].title}{more}"
    warnings_ = [f for f in report.findings if f.severity == "warning"]
    return head + (f" - {len(warnings_)} warning(s)" if warnings_ else " - no inf/NaN, nothing out of range")


def _module_rows(report: ScanReport, max_rows: int) -> list[list[str]]:
    summaries = report.by_module()

    def badness(m: ModuleSummary) -> tuple[int, int, float, float]:
        share = m.flush_count / m.numel if m.numel else 0.0
        return (-(m.nan_count + m.inf_count), -m.overflow_count, -share, m.headroom_bits or math.inf)

    summaries.sort(key=badness)
    return [
        [
            m.module or "<root>",
            str(m.tensors),
            str(m.numel),
            str(m.nan_count),
            str(m.inf_count),
            str(m.overflow_count),
            str(m.fp16_flush_count),
            str(m.bf16_flush_count),
            fmt_num(m.abs_max),
            _bits(m.headroom_bits),
        ]
        for m in summaries[:max_rows]
    ]


def _tensor_rows(report: ScanReport, max_rows: int) -> list[list[str]]:
    dtype = report.dtype
    flagged = [
        t
        for t in report.tensors
        if t.stats.measured and (not t.stats.is_finite or t.overflow_count(dtype) or t.flush_count(dtype))
    ]
    return [
        [
            t.name,
            t.stats.dtype,
            "x".join(map(str, t.stats.shape)) or "scalar",
            str(t.stats.nan_count or 0),
            str((t.stats.posinf_count or 0) + (t.stats.neginf_count or 0)),
            str(t.overflow_count(dtype)),
            _share(t.flush_count(dtype), t.stats.nonzero_count),
            fmt_num(t.stats.abs_max),
            _bits(headroom_bits(t.stats.abs_max, report.limits)),
        ]
        for t in flagged[:max_rows]
    ]


def render_scan_text(report: ScanReport, max_rows: int = 20) -> str:
    """The verdict line, the findings, the scaler and optimizer state, then per-module and per-tensor tables."""
    measured = [t for t in report.tensors if t.stats.measured]
    values = sum(t.stats.numel for t in measured)
    lim = report.limits
    lines = [
        _verdict_line(report),
        f"  {report.path}: {len(report.files)} file(s), {len(measured)} floating tensor(s), {values} values; "
        f"torch {report.torch_version}",
        f"  checked against {report.dtype}: max {lim.max:g}, inf from |x| >= {lim.overflow_threshold:g}, "
        f"zero for 0 < |x| <= {fmt_num(lim.flush_threshold)}",
    ]
    for severity, title in (("error", "Findings"), ("warning", "Warnings"), ("note", "Notes")):
        chosen = [f for f in report.findings if f.severity == severity]
        if chosen:
            lines += ["", title]
            for i, f in enumerate(chosen, 1):
                lines.append(f"  {i}. {f.title}")
                lines += textwrap.wrap(f.message, _TEXT_WIDTH, initial_indent="     ", subsequent_indent="     ")
    if report.scalers:
        lines += ["", "GradScaler state"]
        for s in report.scalers:
            tracker = "-" if s.growth_tracker is None else str(s.growth_tracker)
            state = (
                "collapsed (persistent overflow)" if s.collapsed else ("low" if s.scale < LOW_SCALER_SCALE else "ok")
            )
            lines.append(f"  {s.path or '<root>'}: scale {s.scale_text}, growth tracker {tracker}: {state}")
    if report.optimizers:
        lines += ["", "Optimizer state"]
        for o in report.optimizers:
            eps = ", ".join(f"{e:g}" for e in sorted(set(o.eps))) or "-"
            lines.append(
                f"  {o.path or '<root>'}: {o.states} parameter state(s), {o.param_groups} param group(s), eps {eps}, "
                f"moments in {', '.join(o.state_dtypes) or '-'}"
            )
    module_rows = _module_rows(report, max_rows)
    if module_rows:
        headers = [
            "module",
            "tensors",
            "values",
            "NaN",
            "inf",
            f">{report.dtype} max",
            "flush fp16",
            "flush bf16",
            "|x|max",
            "headroom bits",
        ]
        lines += [
            "",
            f"Modules (worst first, {min(max_rows, len(module_rows))} shown)",
            tabulate(module_rows, headers=headers, tablefmt="simple", disable_numparse=True),
        ]
    tensor_rows = _tensor_rows(report, max_rows)
    if tensor_rows:
        headers = [
            "tensor",
            "dtype",
            "shape",
            "NaN",
            "inf",
            f">{report.dtype} max",
            f"flush {report.dtype}",
            "|x|max",
            "headroom bits",
        ]
        lines += [
            "",
            "Tensors with inf/NaN or values the format cannot hold",
            tabulate(tensor_rows, headers=headers, tablefmt="simple", disable_numparse=True),
        ]
    if len(report.files) > 1 or any(f.skipped for f in report.files):
        rows = [
            [
                f.name,
                f.format,
                str(f.size_bytes),
                str(f.tensors),
                ", ".join(f"{d} ({n})" for d, n in sorted(f.saved_on.items())) or "-",
                f.skipped or "scanned",
            ]
            for f in report.files[:max_rows]
        ]
        lines += [
            "",
            "Files",
            tabulate(
                rows,
                headers=["file", "format", "bytes", "tensors", "saved on", "status"],
                tablefmt="simple",
                disable_numparse=True,
            ),
        ]
    elif report.saved_on:
        lines += ["", "Saved on: " + ", ".join(f"{d} ({n} tensors)" for d, n in sorted(report.saved_on.items()))]
    return "\n".join(lines)
