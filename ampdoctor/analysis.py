"""Pure analysis of recorded passes: origins, propagation, headroom, underflow, loss-scale overflow.

No torch here (a test checks it): everything works on a report loaded from JSON.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Optional

from .records import (
    BATCH,
    LOSS,
    Comparison,
    FormatLimits,
    GradEvent,
    ModuleCall,
    ModuleInfo,
    OpFinding,
    PassTrace,
    TensorRecord,
    TensorStats,
    call_label,
)
from .thresholds import HEADROOM_WARN_BITS, SCALE_WINDOW_LOSS_SHARE, UNDERFLOW_VERDICT_SHARE

VERDICTS = ("healthy", "overflow", "nan", "underflow", "scale_overflow")

# Ops whose non-finite result comes from a pole (log(0), 1/0), not from running out of range: "nan" verdict.
POLE_OPS = frozenset(
    {"aten::log", "aten::log2", "aten::log10", "aten::reciprocal", "aten::rsqrt", "aten::xlogy", "aten::digamma"}
)


@dataclass(frozen=True)
class Origin:
    """Where a non-finite value was first made: a module call, the loss function, or the batch itself."""

    direction: str  # "forward" or "backward"
    module: str  # qualified name; LOSS or BATCH outside the model
    call: int
    class_name: str
    tensor: str  # path of the first non-finite tensor it made
    bad: TensorStats  # that tensor's statistics
    input_abs_max: Optional[float]  # largest finite input (forward) or incoming gradient (backward) magnitude
    op: Optional[OpFinding] = None
    exact: bool = True  # False when the rule could not place it and the first non-finite call is named instead
    event_order: Optional[int] = None  # backward: ``order`` of the gradient event that proves it

    @property
    def label(self) -> str:
        return call_label(self.module, self.call) if self.module not in (LOSS, BATCH) else self.module


@dataclass(frozen=True)
class NearLimit:
    """A tensor within ``HEADROOM_WARN_BITS`` of the format's max (still finite)."""

    module: str
    call: int
    tensor: str  # "out", "param:weight", "grad:out" ...
    abs_max: float
    headroom_bits: float

    @property
    def label(self) -> str:
        return call_label(self.module, self.call)


@dataclass(frozen=True)
class UnderflowSpot:
    module: str
    lost: int  # gradient values nonzero in the reference, zero at the used scale
    reference_nonzero: int

    @property
    def share(self) -> float:
        return self.lost / self.reference_nonzero if self.reference_nonzero else 0.0


@dataclass(frozen=True)
class UnderflowFinding:
    """Parameter-gradient values lost to zero at the used scale, against a reference backward."""

    reference: str  # how the reference was made
    lost: int
    reference_nonzero: int
    spots: list[UnderflowSpot] = field(default_factory=list)

    @property
    def share(self) -> float:
        return self.lost / self.reference_nonzero if self.reference_nonzero else 0.0


@dataclass(frozen=True)
class ScaleProbe:
    scale: float
    gradients_finite: bool


@dataclass(frozen=True)
class ScaleFinding:
    """Gradients non-finite at the used scale: at which lower power-of-two scale do they become finite?"""

    used_scale: float
    probes: list[ScaleProbe]
    largest_finite_scale: Optional[float]  # None: non-finite even at scale 1
    lost_share_at_largest: Optional[float]  # share of gradient values lost to zero at that scale
    # The lowest scale seen non-finite: the backward origin is placed there, where the first gradient to
    # overflow is alone (at the used scale, the loss gradient itself may already be inf in float16).
    analysed_scale: Optional[float] = None

    @property
    def harmless(self) -> bool:
        return (
            self.largest_finite_scale is not None
            and self.lost_share_at_largest is not None
            and self.lost_share_at_largest < SCALE_WINDOW_LOSS_SHARE
        )


@dataclass(frozen=True)
class WindowProbe:
    scale: float
    gradients_finite: bool
    lost_share: Optional[float]  # share of reference-nonzero gradient values that are zero at this scale


@dataclass(frozen=True)
class ScaleWindow:
    """Loss scales that neither overflow (``<= max_safe``) nor lose >= 1 % of gradient values (``>= min_useful``)."""

    current: float
    max_safe: Optional[float]  # largest power of two with finite gradients (None: not even scale 1)
    min_useful: Optional[float]  # smallest power of two losing < 1 % (None: none does)
    probes: list[WindowProbe]
    module_min_useful: dict[str, float]  # per module with parameters: smallest probed scale losing < 1 %
    reference: str

    @property
    def empty(self) -> bool:
        """float16's range is too narrow for this model: no scale both avoids overflow and keeps gradients."""
        return self.max_safe is None or self.min_useful is None or self.min_useful > self.max_safe

    @property
    def contains_current(self) -> bool:
        return not self.empty and self.min_useful is not None and self.max_safe is not None and (
            self.min_useful <= self.current <= self.max_safe
        )


@dataclass(frozen=True)
class PrecisionFinding:
    """Each compared call against its own float32 re-run (``diagnose(..., reference=True)``)."""

    comparisons: list[Comparison]
    jump: Optional[str]  # the call whose relative error stands out (>= JUMP_FACTOR x the median), if any
    underflow_calls: list[str]  # calls with outputs nonzero in float32 but zero in the low precision


# A call's relative error "jumps" when it is at least this many times the median over compared calls.
JUMP_FACTOR = 10.0


def precision_finding(comparisons: list[Comparison]) -> Optional[PrecisionFinding]:
    if not comparisons:
        return None
    errors = sorted(c.relative_error for c in comparisons if math.isfinite(c.relative_error))
    median = errors[len(errors) // 2] if errors else 0.0
    worst = max(comparisons, key=lambda c: c.relative_error if math.isfinite(c.relative_error) else math.inf)
    jump = None
    if not math.isfinite(worst.relative_error) or worst.relative_error >= JUMP_FACTOR * max(median, 1e-12):
        jump = worst.label
    return PrecisionFinding(comparisons, jump, [c.label for c in comparisons if c.underflow_count])


@dataclass(frozen=True)
class Findings:
    verdict: str
    forward_origin: Optional[Origin]
    backward_origin: Optional[Origin]
    propagation: list[str]  # labels of calls after the origin with non-finite outputs, in completion order
    near_limit: list[NearLimit]
    underflow: Optional[UnderflowFinding]
    scale: Optional[ScaleFinding]
    not_captured: list[str]  # calls whose output gradient was expected but never observed
    warnings: list[str] = field(default_factory=list)
    window: Optional[ScaleWindow] = None
    precision: Optional[PrecisionFinding] = None


# -- small helpers -----------------------------------------------------------------------------------------


def headroom_bits(abs_max: Optional[float], limits: FormatLimits) -> Optional[float]:
    """``log2(max / abs_max)``: how many doublings a tensor can take before it overflows the format."""
    if abs_max is None or not math.isfinite(abs_max):
        return None
    if abs_max == 0:
        return math.inf
    return math.log2(limits.max / abs_max)


def _bad(stats: TensorStats) -> bool:
    return stats.measured and not stats.is_finite


# Largest finite value of each floating dtype, by the name records store (analysis imports no torch).
_DTYPE_MAX = {
    "float16": 65504.0,
    "bfloat16": 3.3895313892515355e38,
    "float32": 3.4028234663852886e38,
    "float64": 1.7976931348623157e308,
}


def is_mask(record: TensorRecord) -> bool:
    """An input whose only non-finite values are ``-inf`` and that no earlier call of the pass produced."""
    return record.stats.measured and record.stats.only_neginf and record.producer is None


def is_fill_mask(record: TensorRecord) -> bool:
    """A mask by value: ``-inf`` only, or filled with ``finfo.min`` (Hugging Face) and nothing positive.

    Its huge magnitude is a constant, not data: it says nothing about how close the inputs are to overflow.
    """
    if is_mask(record):
        return True
    stats = record.stats
    dtype_max = _DTYPE_MAX.get(stats.dtype)
    return (
        record.producer is None
        and dtype_max is not None
        and stats.min is not None
        and stats.max is not None
        and stats.min == -dtype_max
        and stats.max <= 0
    )


def _inputs_finite(call: ModuleCall) -> bool:
    return not any(_bad(r.stats) and not is_mask(r) for r in call.inputs)


def _first_bad(records: Iterable[TensorRecord]) -> Optional[TensorRecord]:
    return next((r for r in records if _bad(r.stats)), None)


def _max_abs(records: Iterable[TensorRecord]) -> Optional[float]:
    values = [r.stats.abs_max for r in records if r.stats.abs_max is not None and not is_fill_mask(r)]
    return max(values) if values else None


def _children(calls: list[ModuleCall]) -> dict[int, list[ModuleCall]]:
    out: dict[int, list[ModuleCall]] = defaultdict(list)
    for c in calls:
        if c.parent is not None:
            out[c.parent].append(c)
    return out


def classify(bad: TensorStats, op: Optional[OpFinding]) -> str:
    """``overflow`` when an inf was made by running out of range (NaN that follows counts), else ``nan``."""
    if op is not None:
        if op.op.split(".")[0] in POLE_OPS:
            return "nan"
        return "overflow" if op.output_posinf_count or op.output_neginf_count else "nan"
    return "overflow" if bad.has_posinf or bad.has_neginf else "nan"


# -- forward -----------------------------------------------------------------------------------------------


def forward_creators(trace: PassTrace) -> list[ModuleCall]:
    """Calls whose floating inputs were all finite (masks aside) and some floating output was not."""
    return [
        c
        for c in trace.calls
        if c.end_order >= 0 and _inputs_finite(c) and any(_bad(r.stats) for r in c.outputs)
    ]


def forward_origin(trace: PassTrace) -> Optional[Origin]:
    """The first creator call, in completion order, none of whose direct child calls is itself a creator."""
    bad_batch = [r for r in trace.batch if _bad(r.stats) and not r.stats.only_neginf]
    if bad_batch:
        r = bad_batch[0]
        return Origin("forward", BATCH, 0, "batch", r.path, r.stats, None)
    creators = forward_creators(trace)
    creator_ids = {c.index for c in creators}
    children = _children(trace.calls)
    op = trace.op_finding
    for c in sorted(creators, key=lambda c: c.end_order):
        if any(d.index in creator_ids for d in children.get(c.index, [])):
            continue
        bad = _first_bad(c.outputs)
        assert bad is not None
        zoom = op if op is not None and (op.module, op.call) == (c.module, c.call) else None
        return Origin("forward", c.module, c.call, c.class_name, bad.path, bad.stats, _max_abs(c.inputs), zoom)
    outputs_finite = not any(_bad(r.stats) for r in trace.output)
    if trace.loss is not None and _bad(trace.loss) and outputs_finite:
        zoom = op if op is not None and op.module == LOSS else None
        return Origin("forward", LOSS, 0, "loss", "loss", trace.loss, _max_abs(trace.output), zoom)
    # Something is non-finite but the rule placed nothing (e.g. the batch's -inf reached an op that made NaN).
    first = next((c for c in sorted(trace.calls, key=lambda c: c.end_order) if _first_bad(c.outputs)), None)
    if first is not None:
        bad = _first_bad(first.outputs)
        assert bad is not None
        return Origin(
            "forward", first.module, first.call, first.class_name, bad.path, bad.stats, _max_abs(first.inputs),
            exact=False,
        )
    return None


def propagation(trace: PassTrace, origin: Optional[Origin]) -> list[str]:
    """Every other call with a non-finite output, in completion order: where the bad value flowed.

    This includes the origin's own children that received the bad value and its ancestors that returned it.
    """
    if origin is None:
        return []
    own = (origin.module, origin.call)
    later = [c for c in trace.calls if (c.module, c.call) != own and _first_bad(c.outputs)]
    return [c.label for c in sorted(later, key=lambda c: c.end_order)]


# -- backward ----------------------------------------------------------------------------------------------


def _param_owners(modules: Iterable[ModuleInfo]) -> dict[str, str]:
    owners: dict[str, str] = {}
    for info in modules:
        for p in info.params:
            owners.setdefault(p.name, info.name)
    return owners


def _attribute_params(trace: PassTrace, owners: Mapping[str, str]) -> dict[int, list[GradEvent]]:
    """Give each parameter-gradient event to the call of its owner whose output gradient arrived last before it."""
    calls_of: dict[str, list[int]] = defaultdict(list)
    for c in trace.calls:
        calls_of[c.module].append(c.index)
    last_out: dict[int, int] = {}
    for e in trace.grad_events:
        if e.kind == "output" and e.call is not None:
            last_out[e.call] = max(last_out.get(e.call, -1), e.order)
    out: dict[int, list[GradEvent]] = defaultdict(list)
    for e in trace.grad_events:
        if e.kind != "param" or e.param is None:
            continue
        candidates = calls_of.get(owners.get(e.param, ""), [])
        if not candidates:
            continue
        before = [i for i in candidates if last_out.get(i, math.inf) < e.order]
        chosen = max(before, key=lambda i: last_out[i]) if before else candidates[0]
        out[chosen].append(e)
    return out


def _attributable_inputs(trace: PassTrace) -> set[tuple[int, str]]:
    """Input gradients that belong to one call: its tensor fed no other call except the call's ancestors.

    A tensor hook sees the *sum* of the gradients of all consumers; with two sibling consumers it cannot tell
    whose contribution was bad, so such inputs are left to the common parent.
    """
    ancestors: dict[int, set[int]] = {}
    by_index = {c.index: c for c in trace.calls}
    for c in trace.calls:
        chain, p = set(), c.parent
        while p is not None:
            chain.add(p)
            p = by_index[p].parent
        ancestors[c.index] = chain
    consumers: dict[int, list[int]] = defaultdict(list)
    for c in trace.calls:
        for r in c.inputs:
            consumers[r.ref].append(c.index)
    result = set()
    for c in trace.calls:
        for r in c.inputs:
            others = [i for i in consumers[r.ref] if i != c.index]
            if all(i in ancestors[c.index] for i in others):
                result.add((c.index, r.path))
    return result


def backward_origin(trace: PassTrace, modules: Iterable[ModuleInfo]) -> Optional[Origin]:
    """The first call, in backward order, whose output gradient was finite while a gradient it made was not."""
    if not trace.backward_ran or trace.gradients_finite():
        return None
    events = sorted(trace.grad_events, key=lambda e: e.order)
    by_index = {c.index: c for c in trace.calls}
    out_events: dict[int, list[GradEvent]] = defaultdict(list)
    in_events: dict[int, list[GradEvent]] = defaultdict(list)
    for e in events:
        if e.call is None:
            continue
        (out_events if e.kind == "output" else in_events)[e.call].append(e)
    # An input that an earlier call returned has no hook of its own: its gradient is that call's output event.
    for c in trace.calls:
        for r in c.inputs:
            if r.producer is not None:
                in_events[c.index] += [
                    dataclasses.replace(e, call=c.index, kind="input", path=r.path)
                    for e in out_events.get(r.producer, [])
                    if e.path == r.producer_path
                ]
    roots = [c for c in trace.calls if c.parent is None]
    for root in roots:
        bad = [e for e in out_events.get(root.index, []) if _bad(e.stats)]
        if bad:  # the very first gradient reaching the model is already non-finite
            return Origin(
                "backward", LOSS, 0, "loss", bad[0].path, bad[0].stats, None, trace.backward_op_finding,
                event_order=bad[0].order,
            )
    params = _attribute_params(trace, _param_owners(modules))
    attributable = _attributable_inputs(trace)
    children = _children(trace.calls)
    first_bad: dict[int, GradEvent] = {}
    for c in trace.calls:
        outs = out_events.get(c.index, [])
        if not outs or any(_bad(e.stats) for e in outs):
            continue
        produced = [e for e in in_events.get(c.index, []) if (c.index, e.path) in attributable]
        produced += params.get(c.index, [])
        for d in children.get(c.index, []):
            produced += out_events.get(d.index, [])
        bad = [e for e in produced if _bad(e.stats)]
        if bad:
            first_bad[c.index] = min(bad, key=lambda e: e.order)
    leaves = [i for i in first_bad if not any(d.index in first_bad for d in children.get(i, []))]
    if leaves:
        index = min(leaves, key=lambda i: first_bad[i].order)
        c, e = by_index[index], first_bad[index]
        incoming = max((x.stats.abs_max or 0.0 for x in out_events[index]), default=None)
        where = f"grad:{e.param}" if e.kind == "param" else f"grad:{e.path}"
        return Origin(
            "backward", c.module, c.call, c.class_name, where, e.stats, incoming, trace.backward_op_finding,
            event_order=e.order,
        )
    first = next(e for e in events if _bad(e.stats))
    owner = _param_owners(modules).get(first.param or "", "")
    found = by_index.get(first.call) if first.call is not None else None
    module, number, cls = (found.module, found.call, found.class_name) if found else (owner, 0, "")
    return Origin(
        "backward", module, number, cls, f"grad:{first.param or first.path}", first.stats, None, exact=False,
        event_order=first.order,
    )


def origin_event(trace: PassTrace, origin: Optional[Origin]) -> Optional[GradEvent]:
    """The recorded gradient event that a backward origin names (an input gradient read from the producer's
    output hook is that output event)."""
    if origin is None or origin.direction != "backward" or origin.event_order is None:
        return None
    return next((e for e in trace.grad_events if e.order == origin.event_order), None)


# -- headroom, underflow, scale ----------------------------------------------------------------------------


def near_limit(trace: PassTrace, modules: Iterable[ModuleInfo], limits: FormatLimits) -> list[NearLimit]:
    """Finite outputs, parameters and (scaled) gradients within HEADROOM_WARN_BITS of the format's max."""
    found: list[NearLimit] = []

    def check(module: str, call: int, tensor: str, stats: TensorStats, factor: float = 1.0) -> None:
        if stats.abs_max is None:
            return
        bits = headroom_bits(stats.abs_max * factor, limits)
        if bits is not None and bits < HEADROOM_WARN_BITS:
            found.append(NearLimit(module, call, tensor, stats.abs_max * factor, bits))

    for c in trace.calls:
        for r in c.outputs:
            if r.stats.dtype == limits.dtype:
                check(c.module, c.call, r.path, r.stats)
    for info in modules:
        for p in info.params:
            check(info.name, 0, "param:" + p.name.rsplit(".", 1)[-1], p.stats)
    for e in trace.grad_events:
        if e.kind == "output" and e.call is not None and e.stats.dtype == limits.dtype:
            c = trace.calls[e.call]
            check(c.module, c.call, "grad:" + e.path, e.stats, trace.scale)  # what the scaled backward held
    found.sort(key=lambda n: n.headroom_bits)
    return found


def lost_gradients(
    at_scale: PassTrace, references: Iterable[PassTrace], modules: Iterable[ModuleInfo], reference: str
) -> Optional[UnderflowFinding]:
    """Parameter-gradient values nonzero in a reference backward and zero at the used scale.

    Underflowed values are already zero in the run itself, so the reference is another backward: per
    parameter, the largest nonzero count seen in any pass where that gradient was finite.
    """
    best: dict[str, int] = {}
    for trace in (at_scale, *references):
        for name, stats in trace.param_grads().items():
            if stats.is_finite and stats.nonzero_count is not None:
                best[name] = max(best.get(name, 0), stats.nonzero_count)
    owners = _param_owners(modules)
    lost_by_module: dict[str, int] = defaultdict(int)
    ref_by_module: dict[str, int] = defaultdict(int)
    for name, stats in at_scale.param_grads().items():
        if name not in best or not stats.is_finite or stats.nonzero_count is None:
            continue
        module = owners.get(name, name)
        lost_by_module[module] += max(0, best[name] - stats.nonzero_count)
        ref_by_module[module] += best[name]
    if not ref_by_module:
        return None
    spots = [UnderflowSpot(m, lost_by_module[m], ref_by_module[m]) for m in ref_by_module if lost_by_module[m]]
    spots.sort(key=lambda s: (-s.share, -s.lost))
    return UnderflowFinding(reference, sum(lost_by_module.values()), sum(ref_by_module.values()), spots)


def not_captured(trace: PassTrace) -> list[str]:
    """Calls with an output that required grad but whose output gradient was never observed."""
    if not trace.backward_ran:
        return []
    seen = {e.call for e in trace.grad_events if e.kind == "output"}
    return [c.label for c in trace.calls if any(r.requires_grad for r in c.outputs) and c.index not in seen]


def reference_extra_bits(trace: PassTrace, limits: FormatLimits, max_extra: int, margin_bits: float = 1.0) -> int:
    """How many doublings of the scale the largest scaled gradient of ``trace`` can take, with a margin."""
    # Only gradients held in the low-precision format can overflow it.
    low = [e.stats.abs_max or 0.0 for e in trace.grad_events if e.stats.dtype == limits.dtype]
    largest = max(low, default=0.0) * trace.scale
    if largest == 0:
        return max_extra
    bits = math.floor(math.log2(limits.max / largest) - margin_bits)
    return max(0, min(max_extra, bits))


# -- everything together -----------------------------------------------------------------------------------


def analyze(
    trace: PassTrace,
    modules: list[ModuleInfo],
    limits: FormatLimits,
    underflow: Optional[UnderflowFinding] = None,
    scale: Optional[ScaleFinding] = None,
    window: Optional[ScaleWindow] = None,
    comparisons: Optional[list[Comparison]] = None,
) -> Findings:
    """Findings of one (detailed) pass at the used scale, given the results of any re-runs."""
    fwd = forward_origin(trace)
    bwd = backward_origin(trace, modules) if fwd is None else None
    warnings = []
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
        propagation=propagation(trace, fwd),
        near_limit=near,
        underflow=underflow,
        scale=scale,
        not_captured=not_captured(trace),
        warnings=warnings,
        window=window,
        precision=precision_finding(comparisons or []),
    )
