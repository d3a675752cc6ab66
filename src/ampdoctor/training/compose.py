"""The watch's :class:`Report` from one or several ranks' :class:`RankPayload` (the same code merges ranks).

A payload is everything one rank's watch knows, as frozen records: ``Watch.report()`` builds its own and, in a
distributed run, exchanges it with ``all_gather_object`` (it pickles), then :func:`compose_report` merges them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from .._version import __version__
from ..analysis import Findings, NearLimit, headroom_bits
from ..capture.dtypes import dtype_name
from ..capture.stats import format_limits
from ..numbers import fmt_scale
from ..records import ModuleInfo, PassTrace, RunInfo, StepRecord, Verdict
from ..report import Report
from ..thresholds import HEADROOM_TIGHT_BITS, HEADROOM_WARN_BITS
from .divergence import summary as divergence_summary
from .replay_step import SCALER_TEXT, Capture, ScalerKind
from .runs import HARMLESS, OPEN, PERSISTENT, Run, annotate, is_bad, merged_runs, scale_from_runs

# Headroom trend: warn when a layer's output headroom is under HEADROOM_TIGHT_BITS and fell at least this much
# across at least TREND_MIN_SAMPLES sampled steps.
TREND_DROP_BITS = 1.0
TREND_MIN_SAMPLES = 3
# Persistent runs and harmless runs named one by one in the summary notes (the rest are counted).
RUNS_NAMED = 3


@dataclass(frozen=True)
class RankPayload:
    """What one rank's watch recorded: the unit ranks exchange and :func:`compose_report` merges."""

    rank: int
    world_size: int
    steps: tuple[StepRecord, ...]  # the ring buffer, oldest first
    runs: tuple[Run, ...]
    failure: Optional[Capture]  # the capture of the first persistent failure
    first_capture: Optional[Capture]  # the first capture of all (the first run's first skip)
    first_local: Optional[int]  # the first step whose own forward or pre-reduction gradients went non-finite
    bundle: Optional[str]  # the failure bundle's path
    notes: tuple[str, ...]
    modules: tuple[ModuleInfo, ...]
    model_class: str
    device_type: str
    dtype: torch.dtype
    stats_every: int
    scale: Optional[float]  # after the last step
    total_steps: int  # steps seen, kept or not
    forecasts: tuple[str, ...] = ()  # the overflow forecasts the watch warned about (:mod:`.lookout`)
    scaler: ScalerKind = "enabled"  # the watched loop's GradScaler (disabled or none: scale 1)


def compose_report(payloads: Sequence[RankPayload], me: int = 0) -> Report:
    """The watch's Report from one or several ranks' payloads, as seen from rank ``me``."""
    if not payloads:
        raise ValueError("compose_report needs at least one payload")
    payloads = sorted(payloads, key=lambda p: p.rank)
    merged = len(payloads) > 1
    own = next((p for p in payloads if p.rank == me), payloads[0])
    runs = [r for p in payloads for r in p.runs]
    own_steps = (s for p in payloads for s in explained_later(p.steps, p.runs))
    steps = annotate(sorted(own_steps, key=lambda s: (s.step, s.rank)), runs)
    first_local = _first_local(payloads)
    base, failure_rank = _base_capture(payloads, runs, first_local)
    warnings: list[str] = []
    findings = _findings(base, steps, runs, own.dtype, warnings)
    diverged = min((r.divergence for r in runs if r.divergence is not None), key=lambda d: d.began, default=None)
    if diverged is not None:
        warnings.insert(0, divergence_summary(diverged))
    findings = dataclasses.replace(
        findings,
        warnings=(*findings.warnings, *warnings, *_forecasts(payloads, merged), *trend_warnings(steps, own.dtype)),
        divergence=diverged,
    )
    notes = _summary(own, steps, runs)
    if merged:
        notes.append(_rank_note(payloads, steps, first_local, me))
    elif failure_rank is not None and own.world_size > 1:
        notes.append(f"rank {failure_rank} of {own.world_size} (ranks not merged)")
    notes += [f"failure bundle{f' (rank {p.rank})' if merged else ''}: {p.bundle}" for p in payloads if p.bundle]
    notes += _rank_notes(payloads)

    if base is not None:
        run_info = dataclasses.replace(base.run, notes=(*base.run.notes, *notes))
        recommendations = base.recommendations
        if diverged is not None:  # "GradScaler's back-off handles it" is untrue of a divergence
            recommendations = tuple(r for r in recommendations if r.action != "loss_scale")
        return Report(run_info, base.modules, base.trace, findings, recommendations, steps=tuple(steps))
    scale = own.scale or 1.0
    run_info = RunInfo(
        torch_version=torch.__version__,
        ampdoctor_version=__version__,
        device=own.device_type,
        device_type=own.device_type,
        limits=format_limits(own.dtype),
        scale=scale,
        scale_source=SCALER_TEXT[own.scaler] + (", after the last step" if own.scaler == "enabled" else ""),
        loss_source="scaler.scale(loss)" if own.scaler != "none" else "doctor.see_loss(loss) or the output's loss",
        model_class=own.model_class,
        autocast_note="",
        notes=tuple(notes),
    )
    trace = PassTrace(
        scale=scale, detailed=False, calls=(), grad_events=(), batch=(), output=(), loss=None, backward_ran=False
    )
    return Report(run_info, own.modules, trace, findings, (), steps=tuple(steps))


def explained_later(steps: Sequence[StepRecord], runs: Sequence[Run]) -> list[StepRecord]:
    """Bad steps before their run's capture (the scaler's first back-off is captured only once it turns
    persistent) are explained by that capture, like the skips after it."""
    captured = {s.step: s for s in steps if s.captured}
    out = []
    for s in steps:
        run = next((r for r in runs if r.start <= s.step and (r.end is None or s.step <= r.end)), None)
        source = captured.get(run.capture_step) if run is not None and run.capture_step is not None else None
        if source is not None and is_bad(s) and not s.captured and s.explained_by is None and s.step < source.step:
            s = dataclasses.replace(
                s, forward_origin=source.forward_origin, backward_origin=source.backward_origin,
                nonfinite_params=s.checked_params or source.nonfinite_params, explained_by=source.step,
            )
        out.append(s)
    return out


def _forecasts(payloads: Sequence[RankPayload], merged: bool) -> list[str]:
    """Each rank's forecast warnings (prefixed with the rank when merged)."""
    return [f"rank {p.rank}: {t}" if merged else t for p in payloads for t in p.forecasts]


def _first_local(payloads: Sequence[RankPayload]) -> Optional[tuple[int, int]]:
    """(step, rank) where a rank's own forward or pre-reduction gradients first went non-finite."""
    found = [(p.first_local, p.rank) for p in payloads if p.first_local is not None]
    return min(found) if found else None


def _base_capture(
    payloads: Sequence[RankPayload], runs: list[Run], first_local: Optional[tuple[int, int]]
) -> tuple[Optional[Report], Optional[int]]:
    """The capture the report is built on, and its rank: the first persistent failure's (on the rank that went
    non-finite first, else one that found an origin), else the first capture of a run of skipped steps."""
    if any(r.status == PERSISTENT for r in runs):
        failures = [(p.rank, p.failure) for p in payloads if p.failure is not None]
        if first_local is not None:
            failures.sort(key=lambda f: (f[0] != first_local[1], not f[1].local_nonfinite, f[1].step))
        else:
            failures.sort(key=lambda f: (not f[1].local_nonfinite, f[1].step, f[0]))
        return (failures[0][1].report, failures[0][0]) if failures else (None, None)
    if runs:
        captures = [(p.rank, p.first_capture) for p in payloads if p.first_capture is not None]
        if first_local is not None:
            captures.sort(key=lambda c: c[0] != first_local[1])
        return (captures[0][1].report, captures[0][0]) if captures else (None, None)
    return None, None


def _findings(
    base: Optional[Report], steps: list[StepRecord], runs: list[Run], dtype: torch.dtype, warnings: list[str]
) -> Findings:
    """Findings of the first persistent failure; ``scale_overflow`` when only harmless (or open) runs happened."""
    persistent = [r for r in runs if r.status == PERSISTENT]
    if persistent:
        first = min(persistent, key=lambda r: (r.persistent_step or 0))
        if base is not None and (base.forward_origin is not None or base.backward_origin is not None):
            return base.findings
        failing = next((s for s in steps if s.step == first.persistent_step), None)
        nan_loss = failing is not None and failing.loss is not None and math.isnan(failing.loss)
        nan_grads = failing is not None and failing.forward_finite and failing.grads_nan  # NaN, and no inf
        verdict: Verdict = "nan" if nan_loss or nan_grads else "overflow"
        why = (
            "the capture did not reproduce it"
            if base is not None
            else "it was not captured (the capture budget was spent, or the replay failed: see the notes)"
        )
        warnings.append(f"persistent failure from step {first.persistent_step}: {first.reason}; {why}")
        if base is not None:
            return dataclasses.replace(base.findings, verdict=verdict)
        return Findings(verdict, None, None, (), (), None, None, ())
    if runs:
        for r in runs:
            if r.status == OPEN:
                warnings.append(
                    f"a run of skipped steps from step {r.start} was still going at report time ({r.skips} skipped): "
                    "not yet harmless (no good step at a scale >= 1 since)"
                )
        if base is not None:
            scale = base.findings.scale or scale_from_runs(runs)
            return dataclasses.replace(base.findings, verdict="scale_overflow", scale=scale)
        return Findings("scale_overflow", None, None, (), (), None, scale_from_runs(runs), ())
    return Findings("healthy", None, None, (), _near_limit(steps, dtype), None, None, ())


def _near_limit(steps: list[StepRecord], dtype: torch.dtype) -> tuple[NearLimit, ...]:
    """Module outputs of the last sampled step with less than HEADROOM_WARN_BITS of headroom, tightest first."""
    sampled = [s for s in steps if s.sampled]
    if not sampled:
        return ()
    last = max(s.step for s in sampled)
    limits = format_limits(dtype)
    near = []
    for s in sampled:
        if s.step != last:
            continue
        for module, value in s.out_abs_max.items():
            bits = headroom_bits(value, limits)
            if bits is not None and bits < HEADROOM_WARN_BITS:
                near.append(NearLimit(module, 0, "out", value, bits))
    return tuple(sorted(near, key=lambda n: n.headroom_bits))


def _summary(own: RankPayload, steps: list[StepRecord], runs: list[Run]) -> list[str]:
    own_steps = [s for s in steps if s.rank == own.rank]
    skipped = sum(1 for s in own_steps if s.skipped)
    unguarded = sum(1 for s in own_steps if s.unguarded)
    merged = merged_runs(runs)
    count = {status: sum(1 for r in merged if r.status == status) for status in (HARMLESS, PERSISTENT, OPEN)}
    every = own.stats_every
    lines = [
        f"watch: {own.total_steps} step(s), {len(own_steps)} kept"
        + (f", module statistics every {every} step(s)" if every else ", no module statistics")
        + (f", {unguarded} with non-finite gradients that no GradScaler skipped" if unguarded else "")
        + f"; {skipped} skipped in {len(merged)} run(s) of {'bad' if unguarded else 'skipped'} steps: "
        f"{count[HARMLESS]} harmless, "
        f"{count[PERSISTENT]} persistent" + (f", {count[OPEN]} still open" if count[OPEN] else "")
    ]
    if own_steps:
        first, last = own_steps[0], own_steps[-1]
        lines.append(
            f"loss scale: {fmt_scale(first.scale)} at step {first.step} -> "
            f"{fmt_scale(last.new_scale or last.scale)} after step {last.step} "
            f"(lowest used {fmt_scale(min(s.scale for s in own_steps))})"
        )
    for r in [r for r in merged if r.status == PERSISTENT][:RUNS_NAMED]:
        lines.append(f"persistent failure from step {r.persistent_step}: {r.reason}")
    for r in [r for r in merged if r.status == HARMLESS][:RUNS_NAMED]:
        lines.append(
            f"harmless run of skipped steps: steps {r.start}-{r.end}, good again at scale {fmt_scale(r.harmless_scale)}"
        )
    return lines


def _rank_note(
    payloads: Sequence[RankPayload], steps: list[StepRecord], first_local: Optional[tuple[int, int]], me: int
) -> str:
    head = f"distributed run: {len(payloads)} ranks merged on rank {me}"
    if not any(is_bad(s) for s in steps):
        return head
    if first_local is None:
        return head + (
            "; no rank's own forward or pre-reduction gradients were seen non-finite (the skips or non-finite "
            "gradients come from the reduced gradients, or were not captured)"
        )
    step, rank = first_local
    record = next((s for s in steps if s.step == step and s.rank == rank), None)
    how = "its own gradients (before the all-reduce) were non-finite"
    if record is not None and not record.forward_finite:
        how = "its own forward was non-finite"
    if record is not None and (record.forward_origin or record.backward_origin):
        how += f" (origin {record.forward_origin or record.backward_origin})"
    return f"{head}; rank {rank} first went non-finite, at step {step}: {how}"


def _rank_notes(payloads: Sequence[RankPayload]) -> list[str]:
    """Each rank's notes once; merged, a note only some ranks made says which."""
    ranks_of: dict[str, list[int]] = {}
    for p in payloads:
        for n in p.notes:
            ranks_of.setdefault(n, []).append(p.rank)
    out = []
    for text, ranks in ranks_of.items():
        if len(payloads) > 1 and len(ranks) < len(payloads):
            text = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}"
        out.append(text)
    return out


# -- headroom trends (pure, on step records) ------------------------------------------------------------------


def trends(steps: Sequence[StepRecord], format_max: float) -> dict[str, list[tuple[int, float]]]:
    """Per module, (step, output headroom bits) on sampled steps; several ranks: the smallest headroom."""
    worst: dict[str, dict[int, float]] = {}
    for s in steps:
        for module, value in s.out_abs_max.items():
            per_step = worst.setdefault(module, {})
            per_step[s.step] = max(per_step.get(s.step, 0.0), value)
    out: dict[str, list[tuple[int, float]]] = {}
    for module, per_step in worst.items():
        series = []
        for step in sorted(per_step):
            value = per_step[step]
            bits = math.log2(format_max / value) if 0 < value < math.inf else math.inf  # an all -inf mask
            if math.isfinite(bits):
                series.append((step, bits))
        if series:
            out[module] = series
    return out


def trend_warnings(steps: Sequence[StepRecord], dtype: torch.dtype) -> list[str]:
    """Layers whose output headroom is under HEADROOM_TIGHT_BITS and fell by TREND_DROP_BITS or more."""
    warnings = []
    name = dtype_name(dtype)
    for module, series in trends(steps, format_limits(dtype).max).items():
        if len(series) < TREND_MIN_SAMPLES:
            continue
        (s0, b0), (s1, b1) = series[0], series[-1]
        if b1 >= HEADROOM_TIGHT_BITS or b0 - b1 < TREND_DROP_BITS or s1 <= s0:
            continue
        rate = (b0 - b1) / (s1 - s0)
        eta = f"; at this rate it overflows in about {b1 / rate:.0f} steps" if rate > 0 else ""
        warnings.append(
            f"{module or '<root>'} is losing headroom: its output went from {b0:.1f} to {b1:.1f} bits below the "
            f"{name} max between steps {s0} and {s1}{eta}"
        )
    return warnings
