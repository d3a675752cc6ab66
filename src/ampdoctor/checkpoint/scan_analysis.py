"""Findings of a checkpoint scan (pure: records in, findings out; no torch)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..analysis.headroom import headroom_bits
from ..records import FormatLimits
from ..report.text import describe_bad, fmt_num
from ..thresholds import HEADROOM_WARN_BITS, UNDERFLOW_VERDICT_SHARE
from .scan_records import (
    _SEVERITIES,
    _VERDICT_ORDER,
    OptimizerInfo,
    ScalerInfo,
    ScanFinding,
    ScannedFile,
    ScannedTensor,
)

# A GradScaler scale at or above 1 but below this has backed off a long way from its 2**16 default: warning.
LOW_SCALER_SCALE = 2.0**8
# Adam-style moment names checked for fp16 underflow (and exp_avg_sq for non-finite values).
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _names(tensors: Iterable[ScannedTensor]) -> list[str]:
    return [t.name for t in tensors]


def _first(names: Sequence[str], n: int = 3) -> str:
    shown = ", ".join(names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def _flush_share(t: ScannedTensor, dtype: str) -> float:
    nonzero = t.stats.nonzero_count or 0
    return t.flush_count(dtype) / nonzero if nonzero else 0.0


def analyse_scan(
    tensors: Sequence[ScannedTensor],
    optimizers: Sequence[OptimizerInfo],
    scalers: Sequence[ScalerInfo],
    files: Sequence[ScannedFile],
    limits: FormatLimits,
) -> list[ScanFinding]:
    """Findings of a scan, errors first. No torch: works on a report loaded from JSON."""
    out: list[ScanFinding] = []
    out += _nonfinite_findings(tensors)
    out += _range_findings([t for t in tensors if t.role == "weights" and t.stats.measured], limits)
    out += _optimizer_findings(tensors, optimizers, limits)
    out += _scaler_findings(scalers)
    out += _file_findings(files, limits)
    # Errors first, the verdict's own finding leading; otherwise in the order found.
    severity = {s: i for i, s in enumerate(_SEVERITIES)}
    verdict = {v: i for i, v in enumerate(_VERDICT_ORDER)}
    return sorted(out, key=lambda f: (severity.get(f.severity, len(severity)), verdict.get(f.verdict, len(verdict))))


def _file_findings(files: Sequence[ScannedFile], limits: FormatLimits) -> list[ScanFinding]:
    out = []
    refused = [f for f in files if f.refused]
    if refused:
        out.append(
            ScanFinding(
                "warning",
                "refused_file",
                f"{len(refused)} file(s) not scanned: torch.load(weights_only=True) refused them",
                "; ".join(f"{f.name} needs {', '.join(f.refused)}" for f in refused)
                + "; to scan them too, allow those globals with --allow-global if you trust the files",
                tensors=[f.name for f in refused],
            )
        )
    empty = [f.name for f in files if f.skipped and not f.refused]
    if empty:
        out.append(ScanFinding("note", "no_tensors", f"{len(empty)} file(s) hold no tensors", _first(empty)))
    devices = sorted({d for f in files for d in f.saved_on if d.startswith("cuda")})
    if devices:
        out.append(
            ScanFinding(
                "note",
                "saved_from_cuda",
                f"tensors were saved from {', '.join(devices)}",
                f"they were read here on the CPU; the values (and this scan) are the same on any device, but a "
                f"{limits.dtype} diagnosis on the CPU can differ from CUDA, where autocast runs exp, pow, sum, "
                "softmax and layer_norm in float32",
            )
        )
    return out


def _nonfinite_findings(tensors: Sequence[ScannedTensor]) -> list[ScanFinding]:
    out = []
    for role, what, advice in (
        (
            "weights",
            "weight",
            "training had already broken when this was saved: restore an earlier checkpoint and run ampdoctor "
            "diagnose on it to find where the first inf/NaN is made",
        ),
        ("scaler", "GradScaler", "restore an earlier checkpoint"),
    ):
        bad = [t for t in tensors if t.role == role and t.stats.measured and not t.stats.is_finite]
        if not bad:
            continue
        has_inf = any(t.stats.has_posinf or t.stats.has_neginf for t in bad)
        details = "; ".join(f"{t.name}: {describe_bad(t.stats)}" for t in bad[:3])
        more = f" (and {len(bad) - 3} more tensors)" if len(bad) > 3 else ""
        out.append(
            ScanFinding(
                "error",
                "nonfinite",
                f"{len(bad)} {what} tensor(s) hold inf/NaN",
                f"{details}{more}; {advice}",
                "overflow" if has_inf else "nan",
                _names(bad),
            )
        )
    return out


def _range_findings(weights: Sequence[ScannedTensor], limits: FormatLimits) -> list[ScanFinding]:
    dtype = limits.dtype
    out = []
    over = [t for t in weights if t.overflow_count(dtype)]
    if over:
        total = sum(t.overflow_count(dtype) for t in over)
        worst = max(over, key=lambda t: t.stats.abs_max or 0.0)
        out.append(
            ScanFinding(
                "error",
                "beyond_range",
                f"{total} weight value(s) beyond the {dtype} range (|x| >= {limits.overflow_threshold:g})",
                f"they become inf when autocast casts them: {_first(_names(over))} (largest |x| "
                f"{fmt_num(worst.stats.abs_max)} in {worst.name}); run the layers that use them in float32 "
                "(ampdoctor.fp32_fallback) or train in bfloat16",
                "overflow",
                _names(over),
            )
        )
    flushed = [t for t in weights if t.flush_count(dtype)]
    heavy = [t for t in flushed if _flush_share(t, dtype) >= UNDERFLOW_VERDICT_SHARE]
    light = [t for t in flushed if t not in heavy]
    if heavy:
        worst = max(heavy, key=lambda t: _flush_share(t, dtype))
        out.append(
            ScanFinding(
                "error",
                "flush_to_zero",
                f"{len(heavy)} tensor(s) lose at least {UNDERFLOW_VERDICT_SHARE:.0%} of their nonzero values to zero "
                f"in {dtype}",
                f"|x| <= {fmt_num(limits.flush_threshold)} rounds to 0 when cast: {_first(_names(heavy))} (worst "
                f"{worst.name}: {_flush_share(worst, dtype):.1%}); rescale these weights, run their layers in float32 "
                "(ampdoctor.fp32_fallback), or use bfloat16 (float32's range)",
                "underflow",
                _names(heavy),
            )
        )
    if light:
        total = sum(t.flush_count(dtype) for t in light)
        out.append(
            ScanFinding(
                "warning",
                "flush_to_zero",
                f"{total} nonzero weight value(s) flush to zero in {dtype}",
                f"in {len(light)} tensor(s), under {UNDERFLOW_VERDICT_SHARE:.0%} of each tensor's nonzero values: "
                f"{_first(_names(light))}",
                tensors=_names(light),
            )
        )
    thin = [
        t
        for t in weights
        if t.stats.is_finite
        and not t.overflow_count(dtype)
        and (bits := headroom_bits(t.stats.abs_max, limits)) is not None
        and bits < HEADROOM_WARN_BITS
    ]
    if thin:
        out.append(
            ScanFinding(
                "warning",
                "thin_headroom",
                f"{len(thin)} tensor(s) within {HEADROOM_WARN_BITS:g} bit of the {dtype} max ({limits.max:g})",
                f"one more doubling overflows: {_first(_names(thin))}",
                tensors=_names(thin),
            )
        )
    return out


def _optimizer_findings(
    tensors: Sequence[ScannedTensor], optimizers: Sequence[OptimizerInfo], limits: FormatLimits
) -> list[ScanFinding]:
    out = []
    state = [t for t in tensors if t.role == "optimizer" and t.stats.measured]
    bad = [t for t in state if not t.stats.is_finite]
    if bad:
        sq = [t for t in bad if t.key in ("exp_avg_sq", "max_exp_avg_sq")]
        has_inf = any(t.stats.has_posinf or t.stats.has_neginf for t in bad)
        title = (
            f"Adam's second moment (exp_avg_sq) is non-finite for {len(sq)} parameter(s)"
            if sq
            else f"{len(bad)} optimizer state tensor(s) hold inf/NaN"
        )
        out.append(
            ScanFinding(
                "error",
                "optimizer_nonfinite",
                title,
                f"{_first([_with_param(t) for t in bad])}: the updates of these parameters are inf/NaN and stay so at "
                "every later step; restore an earlier checkpoint (or reset the optimizer state of these parameters) "
                "and find the first non-finite gradient with ampdoctor diagnose",
                "overflow" if has_inf else "nan",
                _names(bad),
            )
        )
    moments = [t for t in state if t.key in MOMENT_KEYS and t.stats.is_finite]
    in_fp16 = [t for t in moments if t.stats.dtype == "float16"]
    if in_fp16:
        zeros = sum(t.stats.zero_count or 0 for t in in_fp16)
        subnormal = sum(t.stats.subnormal_count or 0 for t in in_fp16)
        out.append(
            ScanFinding(
                "warning",
                "optimizer_fp16_state",
                f"{len(in_fp16)} optimizer moment tensor(s) are stored in float16",
                f"{zeros} zeros, {subnormal} subnormal values: moments below {fmt_num(limits.smallest_subnormal)} "
                "are lost; keep the optimizer state and master weights in float32 (torch.autocast does; "
                "model.half() does not)",
                tensors=_names(in_fp16),
            )
        )
    wide = [t for t in moments if t.stats.dtype != "float16" and t.flush_count("float16")]
    if wide:
        flushed = sum(t.flush_count("float16") for t in wide)
        nonzero = sum(t.stats.nonzero_count or 0 for t in wide)
        share = flushed / nonzero if nonzero else 0.0
        out.append(
            ScanFinding(
                "warning" if share >= UNDERFLOW_VERDICT_SHARE else "note",
                "optimizer_moment_underflow",
                f"{flushed} nonzero optimizer moment value(s) ({share:.1%}) would flush to zero in float16",
                f"in {_first(_names(wide))}: harmless while the optimizer state stays float32; keep it so",
                tensors=_names(wide),
            )
        )
    for opt in optimizers:
        zero_eps = [e for e in opt.eps if 0 < e <= limits.flush_threshold] if limits.dtype == "float16" else []
        if not zero_eps:
            continue
        eps_text = ", ".join(f"{e:g}" for e in sorted(set(zero_eps)))
        fix = f"use eps >= {fmt_num(limits.tiny)} (float16's smallest normal) or keep the optimizer in float32"
        where = opt.path or "<root>"
        if "float16" in opt.state_dtypes:
            out.append(
                ScanFinding(
                    "error",
                    "eps_zero",
                    f"optimizer eps {eps_text} is 0 in float16, and its state is float16",
                    f"{where}: sqrt(v) + eps can be 0, and the update divides by it (inf/NaN); {fix}",
                    "nan",
                    [opt.path],
                )
            )
        else:
            out.append(
                ScanFinding(
                    "note",
                    "eps_zero",
                    f"optimizer eps {eps_text} rounds to 0 in float16",
                    f"{where}: harmless while the optimizer runs in float32 (as with torch.autocast), a division by "
                    f"zero if it ever runs in float16; {fix}",
                    tensors=[opt.path],
                )
            )
    return out


def _with_param(t: ScannedTensor) -> str:
    return f"{t.name} ({t.param})" if t.param else t.name


def _scaler_findings(scalers: Sequence[ScalerInfo]) -> list[ScanFinding]:
    out = []
    for s in scalers:
        tracker = "" if s.growth_tracker is None else f", growth tracker {s.growth_tracker}"
        where = s.path or "<root>"
        if s.collapsed:
            out.append(
                ScanFinding(
                    "error",
                    "scaler_collapsed",
                    f"GradScaler scale collapsed to {s.scale_text}: persistent overflow",
                    f"{where}{tracker}: each backoff halves the scale after a step with inf/NaN gradients, so below 1 "
                    "the gradients were non-finite even unscaled, step after step: the forward or the unscaled "
                    "backward overflows, and no loss-scale setting fixes it; find the origin with ampdoctor diagnose",
                    "overflow",
                    [s.path],
                )
            )
        elif s.scale < LOW_SCALER_SCALE:
            out.append(
                ScanFinding(
                    "warning",
                    "scaler_low",
                    f"GradScaler scale {s.scale_text} is far below its 65536 default",
                    f"{where}{tracker}: steps overflowed often, and small gradient values underflow at this scale; "
                    "ampdoctor diagnose reports the largest finite scale and the share of gradients lost there",
                    tensors=[s.path],
                )
            )
    return out

