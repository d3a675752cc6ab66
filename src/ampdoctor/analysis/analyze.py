"""All findings of a diagnosis, from the detailed pass and the results of any re-runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Optional

from ..capture.policy import cpu_policy_finding_note
from ..records import (
    Comparison,
    FormatLimits,
    ModuleInfo,
    PassTrace,
    Verdict,
)
from ..thresholds import HEADROOM_WARN_BITS, UNDERFLOW_VERDICT_SHARE
from .findings import Findings, Origin, ScaleFinding, ScaleWindow, UnderflowFinding
from .headroom import near_limit
from .origin import backward_origin, classify, forward_origin, not_captured, propagation
from .precision import precision_finding


def analyze(
    trace: PassTrace,
    modules: list[ModuleInfo],
    limits: FormatLimits,
    underflow: Optional[UnderflowFinding] = None,
    scale: Optional[ScaleFinding] = None,
    window: Optional[ScaleWindow] = None,
    comparisons: Optional[Sequence[Comparison]] = None,
    cpu_policy: bool = False,
) -> Findings:
    """Findings of one (detailed) pass at the used scale, given the results of any re-runs.

    ``cpu_policy``: the passes ran under CPU autocast; an origin at an op CUDA runs in float32 then says so.
    """
    fwd = forward_origin(trace)
    verdict: Verdict
    bwd = backward_origin(trace, modules) if fwd is None else None
    if cpu_policy:
        fwd, bwd = _with_policy_note(fwd), _with_policy_note(bwd)
    warnings: list[str] = []
    if fwd is not None:
        verdict = classify(fwd.bad, fwd.op)
    elif bwd is not None:
        if scale is not None and scale.largest_finite_scale is not None:
            verdict = "scale_overflow"
            if not scale.harmless:
                warnings.append(
                    f"gradients are finite only at scale <= {scale.largest_finite_scale:g}, where "
                    + (
                        f"{scale.lost_share_at_largest:.1%} of gradient values underflow to zero"
                        if scale.lost_share_at_largest is not None
                        else "the share of underflowed gradients could not be measured"
                    )
                    + ": GradScaler would back off into a useless range"
                )
        else:
            verdict = classify(bwd.bad, None)
    elif underflow is not None and underflow.share >= UNDERFLOW_VERDICT_SHARE:
        verdict = "underflow"
    else:
        verdict = "healthy"
    near = near_limit(trace, modules, limits)
    if window is not None and window.empty:
        warnings.append(
            f"no loss scale fits: {limits.dtype}'s range is too narrow for this model's gradients "
            "(use bfloat16, or float32 islands for the modules that lose the most)"
        )
    elif window is not None and not window.contains_current:
        warnings.append(
            f"the loss scale {window.current:g} is outside the useful window "
            f"[{window.min_useful:g}, {window.max_safe:g}]"
        )
    if near:
        warnings.append(f"{len(near)} tensor(s) within {HEADROOM_WARN_BITS:g} bit of the {limits.dtype} max")
    return Findings(
        verdict=verdict,
        forward_origin=fwd,
        backward_origin=bwd,
        propagation=tuple(propagation(trace, fwd)),
        near_limit=tuple(near),
        underflow=underflow,
        scale=scale,
        not_captured=tuple(not_captured(trace)),
        warnings=tuple(warnings),
        window=window,
        precision=precision_finding(comparisons or ()),
    )



def _with_policy_note(origin: Optional[Origin]) -> Optional[Origin]:
    """The origin with the CPU-policy note when CUDA would run its op in float32 (a finding CUDA may not have)."""
    if origin is None or origin.op is None:
        return origin
    kind = "overflow" if classify(origin.bad, origin.op) == "overflow" else "NaN"
    note = cpu_policy_finding_note(origin.op.op, kind, origin.direction)
    return dataclasses.replace(origin, policy_note=note) if note else origin
