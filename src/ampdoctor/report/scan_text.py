"""Words and tables of a checkpoint scan (pure: records in, strings out); the plain-text rendering.

The analysis hands over data (:class:`~ampdoctor.records.scan.ScanFinding`); this module writes every
sentence about it (``finding_title`` / ``finding_message``, also used by the markdown renderer and the JSON) and
builds the tables both renderers show (``module_table``, ``tensor_table``, ``file_table``).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable, Optional

from tabulate import tabulate

from ..analysis.scan import FLOAT8_SATURATED_SHARE, LOW_SCALER_SCALE
from ..records.scan import SECOND_MOMENT_KEYS, ModuleSummary, ScanFinding, ScannedTensor
from ..thresholds import DEFAULT_FP16_SCALE, HEADROOM_WARN_BITS, UNDERFLOW_VERDICT_SHARE
from .inert import inert_names
from .text import describe_bad, fmt_num

if TYPE_CHECKING:
    from .scan_data import ScanReportData

_TEXT_WIDTH = 116  # finding details are wrapped to this width in the text report
_SHOWN = 3  # tensors named in a finding's sentence before "and N more"
FP16_SMALLEST_SUBNORMAL = 2.0**-24
Table = tuple[list[str], list[list[str]]]  # headers, rows


def bits_text(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.2f}"


def scale_text(scale: float) -> str:
    """``65536 (2**16)`` for powers of two, else four significant digits."""
    if scale > 0 and math.isfinite(scale) and math.log2(scale).is_integer():
        return f"{fmt_num(scale)} (2**{int(math.log2(scale))})"
    return f"{fmt_num(scale)}"


def _share(part: int, whole: Optional[int]) -> str:
    return f"{part} ({part / whole:.1%})" if part and whole else str(part)


def _first(names: Sequence[str], n: int = _SHOWN) -> str:
    shown = ", ".join(names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def _where(path: str) -> str:
    return path or "<root>"


# -- findings: one function per kind, each returning (title, message) ------------------------------------------


def _nonfinite(f: ScanFinding, r: ScanReportData) -> tuple[str, str]:
    what = "GradScaler" if f.role == "scaler" else "weight"
    advice = (
        "restore an earlier checkpoint"
        if f.role == "scaler"
        else "training had already broken when this was saved: restore an earlier checkpoint and run ampdoctor "
        "diagnose on it to find where the first inf/NaN is made"
    )
    tensors = [r.tensor(n) for n in f.tensors]

    def named(t: ScannedTensor) -> str:
        return f"{t.name} ({t.stats.dtype})" if r.storage_format(t.stats.dtype) else t.name

    details = "; ".join(f"{named(t)}: {describe_bad(t.stats)}" for t in tensors[:_SHOWN])
    more = f" (and {len(tensors) - _SHOWN} more tensors)" if len(tensors) > _SHOWN else ""
    no_inf = [
        f"{fmt.dtype} has no inf, so values too large for it became NaN when quantized (or were clipped to "
        f"{fmt_num(fmt.max)})"
        for fmt in r.storage_formats
        if not fmt.has_inf and any(t.stats.dtype == fmt.dtype and t.stats.has_nan for t in tensors)
    ]
    why = "".join(f"; {line}" for line in no_inf)
    return f"{len(tensors)} {what} tensor(s) hold inf/NaN", f"{details}{more}{why}; {advice}"


def _beyond_range(f: ScanFinding, r: ScanReportData) -> tuple[str, str]:
    lim = r.limits
    return (
        f"{f.count} weight value(s) beyond the {r.dtype} range (|x| >= {fmt_num(lim.overflow_threshold)})",
        f"they become inf when autocast casts them: {_first(f.tensors)} (largest |x| {fmt_num(f.worst_value)} in "
        f"{f.worst}); run the layers that use them in float32 (ampdoctor.fp32_fallback) or train in bfloat16",
    )


def _flush_to_zero(f: ScanFinding, r: ScanReportData) -> tuple[str, str]:
    if f.severity == "error":
        return (
            f"{len(f.tensors)} tensor(s) lose at least {UNDERFLOW_VERDICT_SHARE:.0%} of their nonzero values to "
            f"zero in {r.dtype}",
            f"|x| <= {fmt_num(r.limits.flush_threshold)} rounds to 0 when cast: {_first(f.tensors)} (worst "
            f"{f.worst}: {f.worst_value or 0.0:.1%}); rescale these weights, run their layers in float32 "
            "(ampdoctor.fp32_fallback), or use bfloat16 (float32's range)",
        )
    return (
        f"{f.count} nonzero weight value(s) flush to zero in {r.dtype}",
        f"in {len(f.tensors)} tensor(s), under {UNDERFLOW_VERDICT_SHARE:.0%} of each tensor's nonzero values: "
        f"{_first(f.tensors)}",
    )


def _thin_headroom(f: ScanFinding, r: ScanReportData) -> tuple[str, str]:
    return (
        f"{len(f.tensors)} tensor(s) within {fmt_num(HEADROOM_WARN_BITS)} bit of the {r.dtype} max "
        f"({fmt_num(r.limits.max)})",
        f"one more doubling overflows: {_first(f.tensors)} (largest |x| {fmt_num(f.worst_value)} in {f.worst})",
    )


def _float8_saturated(f: ScanFinding, r: ScanReportData) -> tuple[str, str]:
    formats = sorted({r.tensor(n).stats.dtype for n in f.tensors})
    limits = ", ".join(f"{d} max {fmt_num(fmt.max)}" for d in formats if (fmt := r.storage_format(d)))
    return (
        f"{f.count} float8 value(s) sit at their format's max ({limits})",
        f"in {_first(f.tensors)} (worst {f.worst}: {f.worst_value or 0.0:.1%} of its values, from "
        f"{FLOAT8_SATURATED_SHARE:.0%}): they were clipped when quantized, so their true magnitudes are lost; "
        "quantize these tensors with a smaller scale",
    )


def _optimizer_nonfinite(f: ScanFinding, r: ScanReportData) -> tuple[str, str]:
    tensors = [r.tensor(n) for n in f.tensors]
    second = [t for t in tensors if t.key in SECOND_MOMENT_KEYS]
    title = (
        f"Adam's second moment (exp_avg_sq) is non-finite for {len(second)} parameter(s)"
        if second
        else f"{len(tensors)} optimizer state tensor(s) hold inf/NaN"
    )
    named = [f"{t.name} ({t.param})" if t.param else t.name for t in tensors]
    return title, (
        f"{_first(named)}: the updates of these parameters are inf/NaN and stay so at every later step; restore an "
        "earlier checkpoint (or reset the optimizer state of these parameters) and find the first non-finite "
        "gradient with ampdoctor diagnose"
    )


def _optimizer_fp16_state(f: ScanFinding, r: ScanReportData) -> tuple[str, str]:
    tensors = [r.tensor(n) for n in f.tensors]
    zeros = sum(t.stats.zero_count or 0 for t in tensors)
    subnormal = sum(t.stats.subnormal_count or 0 for t in tensors)
    return (
        f"{len(tensors)} optimizer moment tensor(s) are stored in float16",
        f"{zeros} zeros, {subnormal} subnormal values: moments below {fmt_num(FP16_SMALLEST_SUBNORMAL)} are lost; "
        "keep the optimizer state and master weights in float32 (torch.autocast does; model.half() does not)",
    )


def _eps_zero(f: ScanFinding, r: ScanReportData) -> tuple[str, str]:
    eps = ", ".join(f"{fmt_num(e)}" for e in f.eps)
    return (
        f"optimizer eps {eps} is 0 in float16, and its state is float16",
        f"{_where(f.tensors[0] if f.tensors else '')}: sqrt(v) + eps can be 0, and the update divides by it "
        f"(inf/NaN); use eps >= {fmt_num(r.limits.tiny)} (float16's smallest normal) or keep the optimizer in "
        "float32",
    )


def _scaler(f: ScanFinding, r: ScanReportData) -> tuple[str, str]:
    scale = scale_text(f.scale if f.scale is not None else math.nan)
    where = _where(f.tensors[0] if f.tensors else "")
    tracker = "" if f.growth_tracker is None else f", growth tracker {f.growth_tracker}"
    if f.kind == "scaler_collapsed":
        return (
            f"GradScaler scale collapsed to {scale}: persistent overflow",
            f"{where}{tracker}: each backoff halves the scale after a step with inf/NaN gradients, so below 1 the "
            "gradients were non-finite even unscaled, step after step: the forward or the unscaled backward "
            "overflows, and no loss-scale setting fixes it; find the origin with ampdoctor diagnose",
        )
    return (
        f"GradScaler scale {scale} is far below its {fmt_num(DEFAULT_FP16_SCALE)} default",
        f"{where}{tracker}: steps overflowed often, and small gradient values underflow at this scale; ampdoctor "
        "diagnose reports the largest finite scale and the share of gradients lost there",
    )


def _refused(f: ScanFinding, r: ScanReportData) -> tuple[str, str]:
    needs = "; ".join(
        f"{file.name} needs {', '.join(file.refused)}" for file in r.files if file.name in f.tensors and file.refused
    )
    title = f"{len(f.tensors)} file(s) not scanned: torch.load(weights_only=True) refused them"
    if f.kind == "refused_file":
        return title, (
            f"{needs}; these are harmless data types: to scan these files too, allow them with --allow-global "
            f"{','.join(f.globals)} if you trust the files"
        )
    them = "it" if len(f.globals) == 1 else "them"
    return title, (
        f"{needs}; ampdoctor does not know {', '.join(f.globals)} and cannot tell whether loading {them} runs "
        "code, so these files were left out"
    )


def _unread_reasons(f: ScanFinding, r: ScanReportData) -> str:
    why = {file.name: file.skipped for file in r.files}
    return "; ".join(f"{name}: {why.get(name) or 'not read'}" for name in f.tensors)


def _unread(f: ScanFinding, r: ScanReportData) -> tuple[str, str]:
    return f"{len(f.tensors)} checkpoint file(s) could not be read: this scan is incomplete", (
        f"{_unread_reasons(f, r)}; the findings cover only the files that were read: finish the download or copy "
        "(or restore the missing files) and scan again"
    )


def _skipped_unread(f: ScanFinding, r: ScanReportData) -> tuple[str, str]:
    return f"{len(f.tensors)} file(s) skipped", f"{_unread_reasons(f, r)}: left out of this scan"


def _no_tensors(f: ScanFinding, r: ScanReportData) -> tuple[str, str]:
    return f"{len(f.tensors)} file(s) hold no tensors", f"{_first(f.tensors)}: left out of this scan"


_WORDS: dict[str, Callable[[ScanFinding, ScanReportData], tuple[str, str]]] = {
    "nonfinite": _nonfinite,
    "beyond_range": _beyond_range,
    "flush_to_zero": _flush_to_zero,
    "thin_headroom": _thin_headroom,
    "float8_saturated": _float8_saturated,
    "optimizer_nonfinite": _optimizer_nonfinite,
    "optimizer_fp16_state": _optimizer_fp16_state,
    "eps_zero": _eps_zero,
    "scaler_collapsed": _scaler,
    "scaler_low": _scaler,
    "refused_file": _refused,
    "refused_unknown": _refused,
    "no_tensors": _no_tensors,
    "unread": _unread,
    "skipped_unread": _skipped_unread,
}


def finding_title(finding: ScanFinding, report: ScanReportData) -> str:
    """One short line (the verdict line shows the first error's)."""
    return _WORDS[finding.kind](finding, report)[0]


def finding_message(finding: ScanFinding, report: ScanReportData) -> str:
    """The details and what to do."""
    return _WORDS[finding.kind](finding, report)[1]


def verdict_line(report: ScanReportData) -> str:
    errors = report.errors()
    head = f"ampdoctor scan: {report.verdict.upper()}"
    if errors:
        more = f" (+{len(errors) - 1} more finding(s))" if len(errors) > 1 else ""
        return f"{head} - {finding_title(errors[0], report)}{more}"
    warnings_ = [f for f in report.findings if f.severity == "warning"]
    return head + (f" - {len(warnings_)} warning(s)" if warnings_ else " - no inf/NaN, nothing out of range")


def summary_lines(report: ScanReportData) -> list[str]:
    """What was read and what it was checked against (own limits of float8 formats included)."""
    measured = [t for t in report.tensors if t.stats.measured]
    values = sum(t.stats.numel for t in measured)
    lim = report.limits
    unread = sum(1 for f in report.files if f.unread)
    not_read = f" ({unread} not read)" if unread else ""
    lines = [
        f"{report.path}: {len(report.files)} file(s){not_read}, {len(measured)} floating tensor(s), {values} values; "
        f"torch {report.torch_version}",
        f"checked against {report.dtype}: max {fmt_num(lim.max)}, inf from |x| >= {fmt_num(lim.overflow_threshold)}, "
        f"zero for 0 < |x| <= {fmt_num(lim.flush_threshold)}",
    ]
    for fmt in report.storage_formats:
        count = sum(1 for t in measured if t.stats.dtype == fmt.dtype)
        inf = "has inf" if fmt.has_inf else "no inf: overflow becomes NaN or is clipped to the max"
        lines.append(f"{count} tensor(s) stored in {fmt.dtype}: judged against its own max {fmt_num(fmt.max)} ({inf})")
    return lines


def scaler_rows(report: ScanReportData) -> list[list[str]]:
    def state(collapsed: bool, scale: float) -> str:
        return "collapsed (persistent overflow)" if collapsed else ("low" if scale < LOW_SCALER_SCALE else "ok")

    return [
        [
            _where(s.path),
            scale_text(s.scale),
            "-" if s.growth_tracker is None else str(s.growth_tracker),
            state(s.collapsed, s.scale),
        ]
        for s in report.scalers
    ]


def optimizer_rows(report: ScanReportData) -> list[list[str]]:
    return [
        [
            _where(o.path),
            str(o.states),
            str(o.param_groups),
            ", ".join(f"{fmt_num(e)}" for e in sorted(set(o.eps))) or "-",
            ", ".join(o.state_dtypes) or "-",
        ]
        for o in report.optimizers
    ]


def module_table(report: ScanReportData, max_rows: int, name: Callable[[str], str] = str) -> Table:
    """Modules, worst first: non-finite values, then values beyond the range, flushed share, headroom."""

    def badness(m: ModuleSummary) -> tuple[int, int, float, float]:
        share = m.flush_count / m.numel if m.numel else 0.0
        return (-(m.nan_count + m.inf_count), -m.overflow_count, -share, m.headroom_bits or math.inf)

    summaries = sorted(report.by_module(), key=badness)
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
    rows = [
        [
            name(m.module or "<root>"),
            str(m.tensors),
            str(m.numel),
            str(m.nan_count),
            str(m.inf_count),
            str(m.overflow_count),
            str(m.fp16_flush_count),
            str(m.bf16_flush_count),
            fmt_num(m.abs_max),
            bits_text(m.headroom_bits),
        ]
        for m in summaries[:max_rows]
    ]
    return headers, rows


def _flagged(report: ScanReportData, t: ScannedTensor) -> bool:
    own = report.storage_format(t.stats.dtype)
    saturated = own is not None and (t.at_max_count or 0) > 1
    # What a cast would do matters for weights only: autocast never casts an optimizer's or a scaler's state.
    cast = t.role == "weights" and bool(t.overflow_count(report.dtype) or t.flush_count(report.dtype))
    return not t.stats.is_finite or cast or saturated


def tensor_table(report: ScanReportData, max_rows: int, name: Callable[[str], str] = str) -> Table:
    """Tensors with inf/NaN, values the target format cannot hold, or float8 values at their own max."""
    dtype = report.dtype
    flagged = [t for t in report.tensors if t.stats.measured and _flagged(report, t)]
    headers = [
        "tensor",
        "dtype",
        "shape",
        "NaN",
        "inf",
        f">{dtype} max",
        f"flush {dtype}",
        "at own max",
        "|x|max",
        "headroom bits",
    ]
    rows = [
        [
            name(t.name),
            t.stats.dtype,
            "x".join(map(str, t.stats.shape)) or "scalar",
            str(t.stats.nan_count or 0),
            str((t.stats.posinf_count or 0) + (t.stats.neginf_count or 0)),
            str(t.overflow_count(dtype)),
            _share(t.flush_count(dtype), t.stats.nonzero_count),
            "-" if t.at_max_count is None else _share(t.at_max_count, t.stats.numel),
            fmt_num(t.stats.abs_max),
            bits_text(report.headroom(t)),
        ]
        for t in flagged[:max_rows]
    ]
    if not any(t.at_max_count is not None for t in flagged[:max_rows]):
        for row in rows:
            del row[7]
        del headers[7]
    return headers, rows


def file_table(report: ScanReportData, max_rows: int, name: Callable[[str], str] = str) -> Optional[Table]:
    """Files of a directory scan (None for one file scanned whole)."""
    if len(report.files) <= 1 and not any(f.skipped for f in report.files):
        return None
    rows = [
        [
            name(f.name),
            f.format,
            str(f.size_bytes),
            str(f.tensors),
            ", ".join(f"{d} ({n})" for d, n in sorted(f.saved_on.items())) or "-",
            f.skipped or "scanned",
        ]
        for f in report.files[:max_rows]
    ]
    return ["file", "format", "bytes", "tensors", "saved on", "status"], rows


def notes(report: ScanReportData) -> list[str]:
    """Note findings, worded, then what the scan could not do and library warnings."""
    worded = [
        f"{finding_title(f, report)}: {finding_message(f, report)}" for f in report.findings if f.severity == "note"
    ]
    return [*worded, *report.notes]


def _table(table: Table) -> str:
    return tabulate(table[1], headers=table[0], tablefmt="simple", disable_numparse=True)


def render_scan_text(report: ScanReportData, max_rows: int = 20) -> str:
    """The verdict line, the findings, the scaler and optimizer state, then per-module and per-tensor tables.
    Names from the files are shown inert (:func:`~.inert.inert_names`)."""
    report = inert_names(report)
    lines = [verdict_line(report), *("  " + line for line in summary_lines(report))]
    for severity, title in (("error", "Findings"), ("warning", "Warnings")):
        chosen = [f for f in report.findings if f.severity == severity]
        if chosen:
            lines += ["", title]
            for i, f in enumerate(chosen, 1):
                lines.append(f"  {i}. {finding_title(f, report)}")
                lines += textwrap.wrap(
                    finding_message(f, report), _TEXT_WIDTH, initial_indent="     ", subsequent_indent="     "
                )
    if notes(report):
        lines += ["", "Notes"]
        for note in notes(report):
            lines += textwrap.wrap(note, _TEXT_WIDTH, initial_indent="  - ", subsequent_indent="    ")
    if report.scalers:
        lines += ["", "GradScaler state"]
        lines += [f"  {p}: scale {s}, growth tracker {g}: {state}" for p, s, g, state in scaler_rows(report)]
    if report.optimizers:
        lines += ["", "Optimizer state"]
        lines += [
            f"  {p}: {n} parameter state(s), {g} param group(s), eps {eps}, moments in {dt}"
            for p, n, g, eps, dt in optimizer_rows(report)
        ]
    modules = module_table(report, max_rows)
    if modules[1]:
        lines += ["", f"Modules (worst first, {len(modules[1])} shown)", _table(modules)]
    tensors = tensor_table(report, max_rows)
    if tensors[1]:
        lines += ["", "Tensors with inf/NaN or values the format cannot hold", _table(tensors)]
    files = file_table(report, max_rows)
    if files is not None:
        lines += ["", "Files", _table(files)]
    elif report.saved_on:
        lines += ["", "Saved on: " + ", ".join(f"{d} ({n} tensors)" for d, n in sorted(report.saved_on.items()))]
    return "\n".join(lines)
