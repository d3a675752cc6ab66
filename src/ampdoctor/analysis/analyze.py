"""All findings of a diagnosis, from the detailed pass and the results of any re-runs."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Optional

from ..autocast_ops import cpu_policy_finding_note
from ..numbers import fmt_scale
from ..records import (
    Comparison,
    FormatLimits,
    ModuleInfo,
    PassTrace,
    Verdict,
)
from ..thresholds import HEADROOM_WARN_BITS, UNDERFLOW_VERDICT_SHARE
from .findings import Findings, NearLimit, Origin, ScaleFinding, ScaleWindow, UnderflowFinding
from .headroom import beyond_range_params, near_limit
from .hidden import hidden_overflows
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
    near: Optional[Sequence[NearLimit]] = None,
) -> Findings:
    """Findings of one (detailed) pass at the used scale, given the results of any re-runs.

    ``cpu_policy``: the passes ran under CPU autocast; an origin at an op CUDA runs in float32 then says so.
    ``near``: ``near_limit(trace, modules, limits)`` when the caller has it already (one walk per diagnosis).
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
                    f"gradients are finite only at scale <= {fmt_scale(scale.largest_finite_scale)}, where "
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
    hidden = hidden_overflows(trace)
    if hidden and verdict in ("healthy", "underflow"):
        # The only overflows are hidden: a finding, never healthy. It outranks underflow: its values are wrong
        # (an inf turned into 0 or 1 by a later op), and the gradients it zeroes look like underflow.
        verdict = "hidden_overflow"
    if near is None:
        near = near_limit(trace, modules, limits)
    if window is not None and window.empty:
        warnings.append(
            f"no loss scale fits: {limits.dtype}'s range is too narrow for this model's gradients "
            "(use bfloat16, or float32 islands for the modules that lose the most)"
        )
    elif window is not None and not window.contains_current:
        warnings.append(
            f"the loss scale {window.current:g} is outside the useful window "
            f"[{fmt_scale(window.min_useful)}, {fmt_scale(window.max_safe)}]"
        )
    if near:
        warnings.append(f"{len(near)} tensor(s) within {HEADROOM_WARN_BITS:g} bit of the {limits.dtype} max")
    beyond = beyond_range_params(modules, limits)
    if beyond:
        shown = ", ".join(f"{name} (|x| up to {value:.4g})" for name, value in beyond[:5])
        warnings.append(
            f"{len(beyond)} parameter(s) hold values beyond the {limits.dtype} range: {shown}; every {limits.dtype} "
            "op that autocast feeds them to gets inf"
        )
    if trace.unmeasured and verdict == "healthy":
        warnings.append(
            f"healthy as far as measured: {trace.unmeasured} module call(s) and op(s) ran inside a torch.func "
            "transform (vmap, grad), where their values cannot be read; an overflow a later op hid there is not seen"
        )
    frozen = untrained_under_no_grad(trace, modules)
    if frozen:
        warnings.append(
            f"{', '.join(frozen[:5])}{' ...' if len(frozen) > 5 else ''} require grad but got no gradient: "
            "their module ran under no_grad (a reentrant torch.utils.checkpoint whose inputs need no gradient, "
            "or an explicit torch.no_grad()), so these parameters never train; give the checkpoint an input that "
            "requires grad, or use use_reentrant=False"
        )
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
        hidden=hidden,
    )



def _with_policy_note(origin: Optional[Origin]) -> Optional[Origin]:
    """The origin with the CPU-policy note when CUDA would run its op in float32 (a finding CUDA may not have)."""
    if origin is None or origin.op is None:
        return origin
    kind = "overflow" if classify(origin.bad, origin.op) == "overflow" else "NaN"
    op = origin.op.op
    if origin.direction == "backward":
        # A backward kernel (the bias-gradient sum inside AddmmBackward0) is not an autocast-dispatched op: what
        # decides its dtype is the forward op whose backward it is, named by the autograd node.
        forward = _forward_op_of(origin.op.node)
        if forward is None:
            return origin
        op = forward
    note = cpu_policy_finding_note(op, kind, origin.direction)
    return dataclasses.replace(origin, policy_note=note) if note else origin


def untrained_under_no_grad(trace: PassTrace, modules: list[ModuleInfo]) -> list[str]:
    """Parameters that require grad, got no gradient, and whose module only ran under no_grad."""
    got = set(trace.param_grads())
    ran_without = {c.module for c in trace.calls if not c.grad_enabled}
    ran_with = {c.module for c in trace.calls if c.grad_enabled}
    return [
        p.name
        for info in modules
        if info.name in ran_without and info.name not in ran_with
        for p in info.params
        if p.requires_grad and p.name not in got
    ]


def _forward_op_of(node: Optional[str]) -> Optional[str]:
    """``"PowBackward0"`` -> ``"aten::pow"``; None without a node."""
    match = re.fullmatch(r"([A-Za-z0-9]+?)Backward\d*", node or "")
    if match is None:
        return None
    return "aten::" + re.sub(r"(?<!^)(?=[A-Z])", "_", match.group(1)).lower()
