"""Where the first non-finite value was made: forward and backward origins, masks, propagation."""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Optional

from ..records import (
    BATCH,
    LOSS,
    GradEvent,
    ModuleCall,
    ModuleInfo,
    OpFinding,
    PassTrace,
    TensorRecord,
    TensorStats,
    Verdict,
)
from .findings import POLE_OPS, Origin


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


def _inputs_finite(
    call: ModuleCall, made_above: Callable[[ModuleCall, TensorRecord], bool] = lambda call, record: False
) -> bool:
    """No non-finite input but masks (``-inf`` from no earlier call, unless an ancestor's own code made it)."""
    return not any(_bad(r.stats) and (not is_mask(r) or made_above(call, r)) for r in call.inputs)


def _first_bad(records: Iterable[TensorRecord]) -> Optional[TensorRecord]:
    return next((r for r in records if _bad(r.stats)), None)


def _max_abs(records: Iterable[TensorRecord]) -> Optional[float]:
    values = [r.stats.abs_max for r in records if r.stats.abs_max is not None and not is_fill_mask(r)]
    return max(values) if values else None


def _children(calls: Iterable[ModuleCall]) -> dict[int, list[ModuleCall]]:
    out: dict[int, list[ModuleCall]] = defaultdict(list)
    for c in calls:
        if c.parent is not None:
            out[c.parent].append(c)
    return out


def classify(bad: TensorStats, op: Optional[OpFinding]) -> Verdict:
    """``overflow`` when an inf was made by running out of range (NaN that follows counts), else ``nan``."""
    if op is not None:
        if op.op.split(".")[0] in POLE_OPS:
            return "nan"
        return "overflow" if op.output_posinf_count or op.output_neginf_count else "nan"
    return "overflow" if bad.has_posinf or bad.has_neginf else "nan"


# -- forward -----------------------------------------------------------------------------------------------


def forward_creators(trace: PassTrace) -> list[ModuleCall]:
    """Calls whose floating inputs were all finite (masks aside) and some floating output was not."""
    made_above = _made_by_ancestors(trace)
    return [c for c in _bad_output_calls(trace) if c.end_order >= 0 and _inputs_finite(c, made_above)]


def _made_by_ancestors(trace: PassTrace) -> Callable[[ModuleCall, TensorRecord], bool]:
    """Whether the ancestor whose own code handed a mask-like input to a call made inf/NaN from finite values
    (an op the hidden-overflow watch flagged in it, not a sentinel): the ``-inf`` is then that overflow (``log``
    of an underflowed softmax, ``x * -1e5``), not a mask. The ancestor is the first one up that did not receive
    the same values itself (a mask the root builds and hands down through blocks is the root's)."""
    makers = {o.call_index for o in trace.op_overflows if o.call_index is not None and o.count != 0}
    if not makers:
        return lambda call, record: False
    by_index = {c.index: c for c in trace.calls}

    def made(call: ModuleCall, record: TensorRecord) -> bool:
        owner = by_index.get(call.parent) if call.parent is not None else None
        while owner is not None and any(r.stats == record.stats for r in owner.inputs):
            owner = by_index.get(owner.parent) if owner.parent is not None else None
        return owner is not None and owner.index in makers

    return made


def _bad_output_calls(trace: PassTrace) -> list[ModuleCall]:
    """Calls with a non-finite floating output, in start order (none in a healthy pass: one look at each output,
    once per trace)."""
    return list(trace.bad_output_calls())


def forward_origin(trace: PassTrace) -> Optional[Origin]:
    """The first creator call, in completion order, none of whose direct child calls is itself a creator."""
    bad_batch = [r for r in trace.batch if _bad(r.stats) and not r.stats.only_neginf]
    if bad_batch:
        r = bad_batch[0]
        return Origin("forward", BATCH, 0, "batch", r.path, r.stats, None)
    bad_calls = _bad_output_calls(trace)
    made_above = _made_by_ancestors(trace)
    creators = [c for c in bad_calls if c.end_order >= 0 and _inputs_finite(c, made_above)]  # forward_creators
    creator_ids = {c.index for c in creators}
    children = _children(trace.calls) if creators else {}
    op = trace.op_finding
    for c in sorted(creators, key=lambda c: c.end_order):
        if any(d.index in creator_ids for d in children.get(c.index, [])):
            continue
        data = _neginf_batch_data(c, trace, children)
        if data is not None:
            return Origin("forward", BATCH, 0, "batch", data.path, data.stats, None)
        bad = _first_bad(c.outputs)
        assert bad is not None
        zoom = op if op is not None and (op.module, op.call) == (c.module, c.call) else None
        return Origin("forward", c.module, c.call, c.class_name, bad.path, bad.stats, _max_abs(c.inputs), zoom)
    outputs_finite = not any(_bad(r.stats) for r in trace.output)
    if trace.loss is not None and _bad(trace.loss) and outputs_finite:
        zoom = op if op is not None and op.module == LOSS else None
        # An output of a type ampdoctor cannot walk was never measured: "the model output was finite" would be
        # a claim about nothing, so the loss is only where the value was first seen.
        seen = any(r.stats.measured for r in trace.output)
        return Origin(
            "forward", LOSS, 0, "loss", "loss", trace.loss, _max_abs(trace.output), zoom, exact=seen
        )
    # Something is non-finite but the rule placed nothing (e.g. the batch's -inf reached an op that made NaN).
    first = min(bad_calls, key=lambda c: c.end_order, default=None)
    if first is not None:
        bad = _first_bad(first.outputs)
        assert bad is not None
        return Origin(
            "forward", first.module, first.call, first.class_name, bad.path, bad.stats, _max_abs(first.inputs),
            exact=False,
        )
    return None


# Leaf modules that multiply or mix their input: a -inf reaching them is data, not an additive mask.
_MIXING_CLASSES = frozenset(
    {"Linear", "Bilinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
     "LSTM", "GRU", "RNN", "LSTMCell", "GRUCell", "RNNCell"}
)


def _neginf_batch_data(call: ModuleCall, trace: PassTrace, children: Mapping[int, list[ModuleCall]]) -> Optional[
    TensorRecord
]:
    """A batch tensor holding -inf that a mixing leaf (Linear, Conv, RNN) consumed: a log of zero in the data,
    not an attention mask (masks are added to scores, never multiplied into them)."""
    if call.class_name not in _MIXING_CLASSES or children.get(call.index):
        return None
    batch = [b for b in trace.batch if b.stats.measured and b.stats.only_neginf]
    for r in call.inputs:
        if r.producer is None and r.stats.only_neginf:
            match = next((b for b in batch if b.stats == r.stats), None)
            if match is not None:
                return match
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


def param_owners(modules: Iterable[ModuleInfo]) -> dict[str, str]:
    owners: dict[str, str] = {}
    for info in modules:
        for p in info.params:
            owners.setdefault(p.name, info.name)
    return owners


def _all_owners(modules: Iterable[ModuleInfo]) -> dict[str, list[str]]:
    owners: dict[str, list[str]] = defaultdict(list)
    for info in modules:
        for p in info.params:
            owners[p.name].append(info.name)
    return owners


def _attribute_params(trace: PassTrace, modules: Iterable[ModuleInfo]) -> dict[int, list[GradEvent]]:
    """Give each parameter-gradient event to the call of its owner whose output gradient arrived last before it.
    A parameter shared by several modules (tied embeddings: the input embedding and the output head) has one
    gradient, their contributions summed: where the backward op zoom found the op that made it non-finite in one
    of those modules' calls, that module made it."""
    calls_of: dict[str, list[int]] = defaultdict(list)
    for c in trace.calls:
        calls_of[c.module].append(c.index)
    zoomed = trace.backward_op_finding.module if trace.backward_op_finding is not None else None
    zoomed = None if zoomed == LOSS else zoomed
    owners: dict[str, str] = {}
    for name, held_by in _all_owners(modules).items():
        # the holder the zoomed call is, or sits in (a holder whose child does its matmul), the innermost
        within = [h for h in held_by if zoomed is not None and (zoomed == h or zoomed.startswith(h + ".") or not h)]
        owners[name] = max(within, key=len) if len(held_by) > 1 and within else held_by[0]
    last_out: dict[int, int] = {}
    for e in trace.grad_events:
        if e.kind == "output" and e.call is not None:
            last_out[e.call] = max(last_out.get(e.call, -1), e.order)
    out: dict[int, list[GradEvent]] = defaultdict(list)
    for e in trace.grad_events:
        if e.kind != "param" or e.param is None:
            continue
        candidates = calls_of.get(_ran(owners.get(e.param, ""), calls_of), [])
        if not candidates:
            continue
        before = [i for i in candidates if last_out.get(i, math.inf) < e.order]
        chosen = max(before, key=lambda i: last_out[i]) if before else candidates[0]
        out[chosen].append(e)
    return out


def _ran(holder: str, calls_of: Mapping[str, list[int]]) -> str:
    """The holder itself when it ran, else its closest ancestor that did: a module that only holds parameters
    (``self.gate.gain`` read by its parent's forward, an ``nn.ParameterList``) is never called; the module whose
    forward reads the parameter is one of its ancestors."""
    while holder not in calls_of and holder:
        holder = holder.rpartition(".")[0]
    return holder


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
    # A returned tensor that the model also used inside (an intermediate, a KV cache) gets gradient from inside:
    # its root-output gradient is not "the gradient of the loss reaching the model".
    consumed = {r.ref for c in trace.calls for r in c.inputs if r.ref >= 0}
    consumed_by_ops = set(trace.used_inside)  # by the forward's own ops, not a module call (outputs_inside)
    inside = {(root.index, r.path) for root in roots for r in root.outputs
              if r.ref in consumed or (root.index, r.path) in consumed_by_ops}
    # What reaches each call from outside it (a root's: the loss's gradient, not what it returned and used)
    incoming = {i: [e for e in es if (i, e.path) not in inside] for i, es in out_events.items()}
    finding = trace.backward_op_finding
    made_by = finding.module if finding is not None else ""  # the call that made the zoomed op's node, if known
    for root in roots:
        # The loss's own backward made it (the op zoom says so), whichever returned tensor it reached; else, where
        # the zoom placed it in no call, what reached the model from outside already non-finite.
        reached = out_events.get(root.index, []) if made_by == LOSS else incoming.get(root.index, [])
        bad = [e for e in reached if _bad(e.stats)] if made_by in ("", LOSS) else []
        if bad:  # the very first gradient reaching the model is already non-finite
            return Origin(
                "backward", LOSS, 0, "loss", bad[0].path, bad[0].stats, None, trace.backward_op_finding,
                event_order=bad[0].order,
            )
    params = _attribute_params(trace, modules)
    attributable = _attributable_inputs(trace)
    children = _children(trace.calls)
    first_bad: dict[int, GradEvent] = {}
    for c in trace.calls:
        outs = incoming.get(c.index, [])
        if not outs or any(_bad(e.stats) for e in outs):
            continue
        produced = [e for e in in_events.get(c.index, []) if (c.index, e.path) in attributable]
        produced += params.get(c.index, [])
        produced += [e for e in out_events.get(c.index, []) if (c.index, e.path) in inside]  # made inside it
        for d in children.get(c.index, []):
            produced += out_events.get(d.index, [])
        bad = [e for e in produced if _bad(e.stats)]
        if bad:
            first_bad[c.index] = min(bad, key=lambda e: e.order)
    leaves = [i for i in first_bad if not any(d.index in first_bad for d in children.get(i, []))]
    if leaves:
        # One gradient can be blamed on two calls: a parent (through its child's output) and the deeper call
        # whose own input gradient it is. The deeper call made it.
        index = min(leaves, key=lambda i: (first_bad[i].order, -_depth(i, by_index)))
        c, e = by_index[index], first_bad[index]
        largest = max((x.stats.abs_max or 0.0 for x in incoming[index]), default=None)
        where = f"grad:{e.param}" if e.kind == "param" else f"grad:{e.path}"
        return Origin(
            "backward", c.module, c.call, c.class_name, where, e.stats, largest, trace.backward_op_finding,
            event_order=e.order,
        )
    first = next(e for e in events if _bad(e.stats))
    owner = param_owners(modules).get(first.param or "", "")
    found = by_index.get(first.call) if first.call is not None else None
    module, number, cls = (found.module, found.call, found.class_name) if found else (owner, 0, "")
    return Origin(
        "backward", module, number, cls, f"grad:{first.param or first.path}", first.stats, None, exact=False,
        event_order=first.order,
    )


def _depth(index: int, by_index: Mapping[int, ModuleCall]) -> int:
    depth, parent = 0, by_index[index].parent
    while parent is not None and parent in by_index:
        depth, parent = depth + 1, by_index[parent].parent
    return depth


def origin_event(trace: PassTrace, origin: Optional[Origin]) -> Optional[GradEvent]:
    """The recorded gradient event that a backward origin names (an input gradient read from the producer's
    output hook is that output event)."""
    if origin is None or origin.direction != "backward" or origin.event_order is None:
        return None
    return next((e for e in trace.grad_events if e.order == origin.event_order), None)



def not_captured(trace: PassTrace) -> list[str]:
    """Calls with an output that required grad but whose output gradient was never observed."""
    if not trace.backward_ran:
        return []
    seen = {e.call for e in trace.grad_events if e.kind == "output"}
    return [
        c.label
        for c in trace.calls
        if c.index not in seen and any(r.requires_grad for r in c.outputs)  # the cheap test first: most are seen
    ]

