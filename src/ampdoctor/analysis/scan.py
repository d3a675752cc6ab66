"""Findings of a checkpoint scan (pure: records in, findings out; no torch, no prose).

Each finding holds the data a renderer needs (the tensors concerned, the counts, the worst tensor); the words
are written by :mod:`ampdoctor.report.scan_text`. Works on a report loaded from JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from ..records import FormatLimits
from ..records.scan import (
    MOMENT_KEYS,
    SEVERITIES,
    VERDICT_ORDER,
    OptimizerInfo,
    Role,
    ScalerInfo,
    ScanFinding,
    ScannedFile,
    ScannedTensor,
    StorageFormat,
)
from ..thresholds import HEADROOM_WARN_BITS, UNDERFLOW_VERDICT_SHARE
from .headroom import headroom_bits

# A GradScaler scale at or above 1 but below this has backed off a long way from its 2**16 default: warning.
LOW_SCALER_SCALE = 2.0**8
# A float8 tensor with at least this share of its values at its format's max was clipped when quantized.
FLOAT8_SATURATED_SHARE = 0.01


def _names(tensors: Sequence[ScannedTensor]) -> tuple[str, ...]:
    return tuple(t.name for t in tensors)


def analyse_scan(
    tensors: Sequence[ScannedTensor],
    optimizers: Sequence[OptimizerInfo],
    scalers: Sequence[ScalerInfo],
    files: Sequence[ScannedFile],
    limits: FormatLimits,
    storage_formats: Sequence[StorageFormat] = (),
) -> tuple[ScanFinding, ...]:
    """Findings of a scan, errors first (the verdict's own finding leading), otherwise in the order found."""
    narrow = {f.dtype for f in storage_formats}
    weights = [t for t in tensors if t.role == "weights" and t.stats.measured]
    out: list[ScanFinding] = []
    out += _nonfinite_findings(tensors)
    out += _range_findings([t for t in weights if t.stats.dtype not in narrow], limits)
    out += _float8_findings([t for t in weights if t.stats.dtype in narrow])
    out += _optimizer_findings(tensors, optimizers, limits)
    out += _scaler_findings(scalers)
    out += _file_findings(files)
    severity = {s: i for i, s in enumerate(SEVERITIES)}
    verdict: dict[Optional[str], int] = {v: i for i, v in enumerate(VERDICT_ORDER)}
    return tuple(sorted(out, key=lambda f: (severity[f.severity], verdict.get(f.verdict, len(verdict)))))


def _file_findings(files: Sequence[ScannedFile]) -> list[ScanFinding]:
    """Files a directory scan skipped. Files refused for globals that can run code never get here: the scan
    refuses the whole directory (see :func:`ampdoctor.checkpoint.scan.scan`)."""
    out = []
    refused = [f for f in files if f.refused]
    unknown = [f for f in refused if f.refused_unknown]
    harmless = [f for f in refused if f not in unknown]
    if harmless:
        needed = dict.fromkeys(g for f in harmless for g in f.refused)
        out.append(ScanFinding("warning", "refused_file", tuple(f.name for f in harmless), globals=tuple(needed)))
    if unknown:
        needed = dict.fromkeys(g for f in unknown for g in f.refused_unknown)
        out.append(ScanFinding("warning", "refused_unknown", tuple(f.name for f in unknown), globals=tuple(needed)))
    empty = tuple(f.name for f in files if f.skipped and not f.refused and not f.unread)
    if empty:
        out.append(ScanFinding("note", "no_tensors", empty))
    missed = tuple(f.name for f in files if f.missed)
    if missed:  # no verdict of its own: the report's verdict says "incomplete" when nothing else is wrong
        out.append(ScanFinding("error", "unread", missed))
    skipped = tuple(f.name for f in files if f.unread and not f.missed)
    if skipped:
        out.append(ScanFinding("note", "skipped_unread", skipped))
    return out


def _nonfinite_findings(tensors: Sequence[ScannedTensor]) -> list[ScanFinding]:
    out = []
    roles: tuple[Role, ...] = ("weights", "scaler")
    for role in roles:
        bad = [t for t in tensors if t.role == role and t.stats.measured and not t.stats.is_finite]
        if bad:
            has_inf = any(t.stats.has_posinf or t.stats.has_neginf for t in bad)
            out.append(ScanFinding("error", "nonfinite", _names(bad), "overflow" if has_inf else "nan", role=role))
    return out


def _range_findings(weights: Sequence[ScannedTensor], limits: FormatLimits) -> list[ScanFinding]:
    dtype = limits.dtype
    out = []
    over = [t for t in weights if t.overflow_count(dtype)]
    if over:
        worst = max(over, key=lambda t: t.stats.abs_max or 0.0)
        total = sum(t.overflow_count(dtype) for t in over)
        out.append(
            ScanFinding(
                "error", "beyond_range", _names(over), "overflow", total, worst.name, worst_value=worst.stats.abs_max
            )
        )
    flushed = [t for t in weights if t.flush_count(dtype)]
    heavy = [t for t in flushed if t.flush_share(dtype) >= UNDERFLOW_VERDICT_SHARE]
    light = [t for t in flushed if t not in heavy]
    if heavy:
        worst = max(heavy, key=lambda t: t.flush_share(dtype))
        total = sum(t.flush_count(dtype) for t in heavy)
        out.append(
            ScanFinding(
                "error", "flush_to_zero", _names(heavy), "underflow", total, worst.name, worst.flush_share(dtype)
            )
        )
    if light:
        total = sum(t.flush_count(dtype) for t in light)
        out.append(ScanFinding("warning", "flush_to_zero", _names(light), count=total))
    thin = [
        t
        for t in weights
        if t.stats.is_finite
        and not t.overflow_count(dtype)
        and (bits := headroom_bits(t.stats.abs_max, limits)) is not None
        and bits < HEADROOM_WARN_BITS
    ]
    if thin:
        worst = max(thin, key=lambda t: t.stats.abs_max or 0.0)
        out.append(
            ScanFinding("warning", "thin_headroom", _names(thin), worst=worst.name, worst_value=worst.stats.abs_max)
        )
    return out


def _float8_findings(stored: Sequence[ScannedTensor]) -> list[ScanFinding]:
    """float8 tensors against their own format: many values at its max were clipped when quantized."""

    def share(t: ScannedTensor) -> float:
        return (t.at_max_count or 0) / t.stats.numel if t.stats.numel else 0.0

    saturated = [t for t in stored if share(t) >= FLOAT8_SATURATED_SHARE and (t.at_max_count or 0) > 1]
    if not saturated:
        return []
    worst = max(saturated, key=share)
    total = sum(t.at_max_count or 0 for t in saturated)
    return [ScanFinding("warning", "float8_saturated", _names(saturated), None, total, worst.name, share(worst))]


def _optimizer_findings(
    tensors: Sequence[ScannedTensor], optimizers: Sequence[OptimizerInfo], limits: FormatLimits
) -> list[ScanFinding]:
    """Non-finite moments, moments stored in float16, and an eps that is 0 in float16 with float16 state.

    Moments of a float32 optimizer that *would* flush in float16, and a float32 optimizer's eps below float16's
    smallest subnormal, are not findings: under torch.autocast the optimizer never runs in float16.
    """
    out = []
    state = [t for t in tensors if t.role == "optimizer" and t.stats.measured]
    bad = [t for t in state if not t.stats.is_finite]
    if bad:
        has_inf = any(t.stats.has_posinf or t.stats.has_neginf for t in bad)
        out.append(ScanFinding("error", "optimizer_nonfinite", _names(bad), "overflow" if has_inf else "nan"))
    in_fp16 = [t for t in state if t.key in MOMENT_KEYS and t.stats.is_finite and t.stats.dtype == "float16"]
    if in_fp16:
        out.append(ScanFinding("warning", "optimizer_fp16_state", _names(in_fp16)))
    if limits.dtype == "float16":
        for opt in optimizers:
            zero_eps = tuple(sorted({e for e in opt.eps if 0 < e <= limits.flush_threshold}))
            if zero_eps and "float16" in opt.state_dtypes:
                out.append(ScanFinding("error", "eps_zero", (opt.path,), "nan", eps=zero_eps))
    return out



def _scaler_findings(scalers: Sequence[ScalerInfo]) -> list[ScanFinding]:
    out = []
    for s in scalers:
        if s.collapsed:
            out.append(
                ScanFinding(
                    "error", "scaler_collapsed", (s.path,), "overflow", scale=s.scale, growth_tracker=s.growth_tracker
                )
            )
        elif s.scale < LOW_SCALER_SCALE:
            out.append(ScanFinding("warning", "scaler_low", (s.path,), scale=s.scale, growth_tracker=s.growth_tracker))
    return out
