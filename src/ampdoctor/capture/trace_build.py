"""A pass's records from its recorder and its one readback: module calls, gradient events, batch and output."""

from __future__ import annotations

from ..records import GradEvent, ModuleCall, PassTrace, TensorRecord, TensorStats, survey_stats
from .hooks import Recorder


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
    calls = [
        ModuleCall(
            index=c.index,
            module=c.module,
            call=c.call,
            class_name=c.class_name,
            parent=c.parent,
            end_order=c.end_order,
            grad_enabled=c.grad_enabled,
            inputs=tuple(TensorRecord(p, stats[s], rg, prod, s, prod_path) for p, s, rg, prod, prod_path in c.inputs),
            outputs=tuple(TensorRecord(p, stats[s], rg, None, s) for p, s, rg in c.outputs),
        )
        for c in recorder.calls
    ]
    return PassTrace(
        scale=scale,
        detailed=detailed,
        calls=tuple(calls),
        grad_events=grad_events(recorder, stats, scale),
        batch=tuple(TensorRecord(p, stats[s], rg) for p, s, rg in batch_slots),
        output=tuple(TensorRecord(p, stats[s], rg) for p, s, rg in output_slots),
        loss=stats[loss_slot],
        backward_ran=backward_ran,
        uncaptured=tuple(dict.fromkeys(recorder.uncaptured)),
    )


def grad_events(recorder: Recorder, stats: list[TensorStats], scale: float) -> tuple[GradEvent, ...]:
    """The gradients of one backward, in execution order, unscaled (the same gradient seen twice divided once)."""
    unscaled: dict[int, TensorStats] = {}
    events = []
    for g in sorted(recorder.grads):
        found = unscaled.get(g.slot)
        if found is None:
            found = unscaled[g.slot] = _unscaled(stats[g.slot], scale)
        events.append(GradEvent(g.order, g.kind, found, g.call, g.path, g.param, g.via_base))
    return tuple(events)


def _unscaled(stats: TensorStats, scale: float) -> TensorStats:
    """``stats.scaled_down(scale)``, built directly for survey-level statistics (a few per module call)."""
    if stats.detailed or stats.min is None or stats.max is None or scale == 1.0:
        return stats.scaled_down(scale)
    return survey_stats(stats.dtype, stats.shape, stats.min / scale, stats.max / scale, stats.zero_count)
