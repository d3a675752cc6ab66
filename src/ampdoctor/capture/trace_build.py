"""A pass's records from its recorder and its one readback: module calls, gradient events, batch and output."""

from __future__ import annotations

from typing import Any, Optional

from ..records import GradEvent, ModuleCall, PassTrace, TensorRecord, TensorStats
from .hooks import Recorder
from .reductions import shared_float

# Records are built by the ten thousand on a model of many small modules: written slot by slot, without the
# generated ``__init__`` (its keyword handling and defaults), as ``records.survey_stats`` does. The records equal,
# hash and serialise as if built by their constructors (the slotted records have every field set).
_new = object.__new__
_put = object.__setattr__


def _tensor_record(
    path: str, stats: TensorStats, requires_grad: bool, producer: Optional[int], ref: int, producer_path: str = ""
) -> TensorRecord:
    r = _new(TensorRecord)
    _put(r, "path", path)
    _put(r, "stats", stats)
    _put(r, "requires_grad", requires_grad)
    _put(r, "producer", producer)
    _put(r, "ref", ref)
    _put(r, "producer_path", producer_path)
    return r


def _call(c: Any, stats: list[TensorStats]) -> ModuleCall:
    call = _new(ModuleCall)
    _put(call, "index", c.index)
    _put(call, "module", c.module)
    _put(call, "call", c.call)
    _put(call, "class_name", c.class_name)
    _put(call, "parent", c.parent)
    _put(call, "end_order", c.end_order)
    _put(call, "inputs", tuple([_tensor_record(p, stats[s], rg, prod, s, pp) for p, s, rg, prod, pp in c.inputs]))
    _put(call, "outputs", tuple([_tensor_record(p, stats[s], rg, None, s) for p, s, rg in c.outputs]))
    _put(call, "grad_enabled", c.grad_enabled)
    return call


def build_trace(
    recorder: Recorder,
    stats: list[TensorStats],
    scale: float,
    detailed: bool,
    batch_slots: list[tuple[str, int, bool]],
    output_slots: list[tuple[str, int, bool]],
    loss_slot: int,
    backward_ran: bool,
) -> PassTrace:
    return PassTrace(
        scale=scale,
        detailed=detailed,
        calls=tuple([_call(c, stats) for c in recorder.calls]),
        grad_events=grad_events(recorder, stats, scale),
        batch=tuple(TensorRecord(p, stats[s], rg) for p, s, rg in batch_slots),
        output=tuple(TensorRecord(p, stats[s], rg) for p, s, rg in output_slots),
        loss=stats[loss_slot],
        backward_ran=backward_ran,
        uncaptured=tuple(dict.fromkeys(recorder.uncaptured)),
        used_inside=tuple(recorder.used_inside),
    )


def grad_events(recorder: Recorder, stats: list[TensorStats], scale: float) -> tuple[GradEvent, ...]:
    """The gradients of one backward, in execution order, unscaled (the same gradient seen twice divided once)."""
    unscaled: dict[int, TensorStats] = {}
    floats: dict[float, float] = {}  # one object per distinct value (``shared_float``)
    events: list[GradEvent] = []
    append = events.append
    for g in sorted(recorder.grads):
        found = unscaled.get(g.slot)
        if found is None:
            seen = stats[g.slot]
            lo, hi = seen.min, seen.max
            if scale == 1.0 or seen.nan_count is not None or lo is None or hi is None:
                found = seen.scaled_down(scale)
            else:
                # Survey level: the record of this pass's gradient slot, made by this pass's readback and referenced
                # nowhere else, divided in place (``scaled_down`` without a second record per gradient: 40,000
                # records made only to be dropped on a model of 10,000 modules).
                found = seen
                _put(found, "min", shared_float(lo / scale, floats))
                _put(found, "max", shared_float(hi / scale, floats))
            unscaled[g.slot] = found
        e = _new(GradEvent)
        _put(e, "order", g.order)
        _put(e, "kind", g.kind)
        _put(e, "stats", found)
        _put(e, "call", g.call)
        _put(e, "path", g.path)
        _put(e, "param", g.param)
        _put(e, "via_base", g.via_base)
        append(e)
    return tuple(events)
