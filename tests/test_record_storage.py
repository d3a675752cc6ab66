"""How a pass stores its records (issue 22's memory): one shape tuple per distinct shape, the collector's slot
bookkeeping gone after its readback, and gradient records divided by the loss scale in place, equal to the
``scaled_down`` copies they replace."""

from __future__ import annotations

import math

import torch

from ampdoctor.capture.hooks import GradSeen
from ampdoctor.capture.reductions import shared_float
from ampdoctor.capture.stats import StatsCollector
from ampdoctor.capture.trace_build import grad_events


class _Grads:
    """What grad_events reads of a Recorder: the gradients seen, in any order."""

    def __init__(self, grads: list[GradSeen]) -> None:
        self.grads = grads


def test_gradient_records_are_unscaled_once_and_equal_scaled_down() -> None:
    torch.manual_seed(0)
    grads = [
        torch.randn(4, 4).half() * 512,  # staged (small, CPU)
        torch.randn(70000) * 2.0**10,  # measured alone
        torch.tensor([1.0, math.nan, math.inf], dtype=torch.float16),  # NaN hides the inf: the nansum says
        torch.zeros(3, dtype=torch.float16),
        torch.arange(3),  # not measured
    ]
    collector = StatsCollector(torch.float16, False)
    slots = [collector.add_fresh(g) for g in grads]
    stats = collector.read()
    scale = 1024.0
    expected = [s.scaled_down(scale) for s in stats]  # copies, taken before grad_events divides
    seen = [GradSeen(order, "output", slot, order, "out", None, False) for order, slot in enumerate(slots)]
    seen.append(GradSeen(len(seen), "input", slots[0], 9, "args[0]", None, False))  # the same gradient twice
    events = grad_events(_Grads(list(reversed(seen))), stats, scale)  # type: ignore[arg-type]
    assert [e.order for e in events] == list(range(len(seen)))  # execution order
    assert [e.stats for e in events[: len(grads)]] == expected
    assert events[-1].stats is events[0].stats and events[0].stats.max == expected[0].max  # divided once
    assert events[2].stats.max == math.inf and math.isnan(events[2].stats.min)
    assert events[1].stats.max == stats[1].max  # the slot's record is the unscaled one now (no second record)
    assert not events[4].stats.measured
    one = StatsCollector(torch.float16, False)
    one.add_fresh(grads[0])
    at_one = one.read()
    assert grad_events(_Grads(seen[:1]), at_one, 1.0)[0].stats is at_one[0]  # scale 1: nothing to divide


def test_one_shape_tuple_per_shape_and_no_slot_bookkeeping_after_the_readback() -> None:
    collector = StatsCollector(torch.float16, False)
    tensors = [torch.randn(16, 4).half() for _ in range(5)] + [torch.randn(70000), torch.randn(16, 4)]
    slots = [collector.add(t) for t in tensors]
    largest = collector.nbytes(slots[5])
    records = collector.read()
    assert largest == 70000 * 4
    assert len({id(records[s].shape) for s in slots if records[s].shape == (16, 4)}) == 1
    assert [records[s].shape for s in slots] == [tuple(t.shape) for t in tensors]
    assert len(collector) == len(records) == 7  # still answers
    assert len(collector._slots) == 0 and not collector._slots.shapes  # the bookkeeping went with the readback


def test_extremes_are_one_float_object_per_value_and_zeros_keep_their_sign() -> None:
    table: dict[float, float] = {}
    a, b = shared_float(float("1.5"), table), shared_float(float.fromhex("0x1.8p0"), table)
    assert a is b and a == 1.5
    assert math.copysign(1.0, shared_float(-0.0, table)) == -1.0 and math.copysign(1.0, shared_float(0.0, table)) == 1.0
    assert math.isnan(shared_float(math.nan, table)) and shared_float(math.inf, table) == math.inf
    collector = StatsCollector(torch.float16, False)
    tensors = [torch.tensor([0.0, 2.0]), torch.tensor([0.0, 2.0]), torch.tensor([-0.0, -3.0]).half()]
    slots = [collector.add(t) for t in tensors]
    records = collector.read()
    first, second, third = (records[s] for s in slots)
    assert first.min is second.min and first.max is second.max  # equal values, one object
    assert (first.min, first.max, third.min) == (0.0, 2.0, -3.0) and math.copysign(1.0, third.max) == -1.0
