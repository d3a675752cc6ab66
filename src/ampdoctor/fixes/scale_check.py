"""Verify a recommended loss scale with the margin: finite at ``max_safe / 2**margin_bits`` (the scale recommended),
with under 1 % of gradient values lost to zero there, and the largest low-precision gradient at least
``margin_bits`` below the format's max. Otherwise the recommendation "holds at this step" and is not verified."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Optional

from ..analysis import Findings
from ..analysis.scale import gradient_headroom, margin_scale
from ..analysis.underflow import lost_gradients
from ..numbers import fmt_scale
from ..records import FormatLimits, ModuleInfo, OpOverflow, PassTrace, Recommendation
from ..thresholds import SCALE_WINDOW_LOSS_SHARE


def largest_finite(findings: Findings) -> Optional[float]:
    """The largest finite power-of-two scale measured (the scale probes', else the window's top)."""
    if findings.scale is not None and findings.scale.largest_finite_scale:
        return findings.scale.largest_finite_scale
    if findings.window is not None and findings.window.max_safe:
        return findings.window.max_safe
    return None


def proposed_scale(findings: Findings, margin_bits: float) -> Optional[float]:
    """The scale a loss-scale recommendation proposes: the largest finite one, ``margin_bits`` lower."""
    top = largest_finite(findings)
    return margin_scale(top, margin_bits) if top is not None else None


def _lost_share(
    run: Callable[[float], PassTrace], findings: Findings, at: PassTrace, modules: Sequence[ModuleInfo]
) -> tuple[Optional[float], str]:
    """The share of gradient values lost to zero at ``at.scale`` and against what: the window's measurement when
    it has one there; else what the largest finite scale lost (against its reference) plus what this scale loses
    beyond it (an upper bound: a value lost at both is counted twice)."""
    window = findings.window
    probe = next((p for p in window.probes if p.scale == at.scale), None) if window is not None else None
    if probe is not None and probe.lost_share is not None and window is not None:
        return probe.lost_share, window.reference
    top = largest_finite(findings)
    if top is None:
        return None, ""
    base = findings.scale.lost_share_at_largest if findings.scale is not None else None
    if base is None and window is not None:
        top_probe = next((p for p in window.probes if p.scale == top), None)
        base = top_probe.lost_share if top_probe is not None else None
    if at.scale == top:
        return base, f"the backward at scale {fmt_scale(top)}"
    beyond = lost_gradients(at, [run(top)], modules, "")
    extra = beyond.share if beyond is not None else 0.0
    return (base or 0.0) + extra, f"the backward at scale {fmt_scale(top)}" + (" and its own reference" if base else "")


def verify_loss_scale(
    run: Callable[[float], PassTrace],
    findings: Findings,
    rec: Recommendation,
    modules: Sequence[ModuleInfo],
    limits: Optional[FormatLimits],
    margin_bits: float,
    made: Optional[Callable[[PassTrace], Sequence[OpOverflow]]] = None,
) -> Recommendation:
    """Re-run the unchanged step at the proposed scale; verified when finite (no op making inf/NaN either), under
    1 % of gradient values lost and the margin kept. ``made``: the ops of a trace that made inf/NaN from finite
    inputs, known sentinels aside (default: every op the trace flagged or counted)."""
    scale = proposed_scale(findings, margin_bits)
    if scale is None:
        return rec
    at = run(scale)
    ok = at.healthy()
    evidence = f"re-ran the step at scale {fmt_scale(scale)}: " + ("finite" if ok else "still non-finite")
    if not ok:
        return dataclasses.replace(rec, verified=False, evidence=evidence)
    share, against = _lost_share(run, findings, at, modules)
    if share is not None:
        evidence += f", {share:.2%} of gradient values lost to zero ({against})"
        ok = share < SCALE_WINDOW_LOSS_SHARE
    left = made(at) if made is not None else [o for o in at.op_overflows if o.count != 0]
    if left:
        evidence += "; but an op still makes inf/NaN from finite inputs: " + ", ".join(
            dict.fromkeys(f"{o.label} ({o.op})" for o in left)
        )
        ok = False
    spare = gradient_headroom(at, limits, modules) if limits is not None else math.inf
    if math.isfinite(spare):
        evidence += f"; its largest low-precision gradient keeps {spare:.2f} bits below the {limits.dtype} max" \
            if limits is not None else ""
    if ok and spare < margin_bits:
        title = f"{rec.title} (holds at this step, with {spare:.2f} bits to spare)"
        return dataclasses.replace(rec, title=title, verified=False,
                                   evidence=evidence + f", inside the {margin_bits:g}-bit margin")
    return dataclasses.replace(rec, verified=ok, evidence=evidence)
