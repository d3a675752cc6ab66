"""The analysis's fast paths on many records give the per-record definitions' answers (issue 22: a model of ten
thousand modules asks them for every output, parameter and gradient).

Each reference below is the definition as it was written before the fast path, applied record by record."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from ampdoctor.analysis import near_limit
from ampdoctor.analysis.findings import NearLimit
from ampdoctor.analysis.headroom import beyond_range_params, headroom_bits
from ampdoctor.analysis.origin import forward_origin, not_captured
from ampdoctor.analysis.prediction import _Grouped
from ampdoctor.analysis.scale import low_precision_modules, predicted_top
from ampdoctor.capture.stats import format_limits
from ampdoctor.records import (
    FormatLimits,
    GradEvent,
    ModuleCall,
    ModuleInfo,
    ParamRecord,
    PassTrace,
    TensorRecord,
    TensorStats,
)
from ampdoctor.records.histograms import HistogramRows
from ampdoctor.thresholds import HEADROOM_WARN_BITS

F16 = format_limits(torch.float16)
BF16 = format_limits(torch.bfloat16)
INF, NAN = math.inf, math.nan


def _value_pool(limits: FormatLimits) -> list[float]:
    top = limits.max
    return [
        0.0, -0.0, 1.0, -1.0, limits.smallest_subnormal, limits.tiny / 2, limits.tiny, top, -top, top * 0.99,
        top * 0.51, top * 0.49, top * 0.26, top * 0.25, top * 0.2499, top / 2**20, INF, -INF, NAN,
        limits.overflow_threshold, math.nextafter(limits.overflow_threshold, 0.0), 3e38, -3e38, 70000.0, 65519.0,
        65520.0, 1e-30, 2.0**-14, 2.0**-24,
    ]


def _stats(rng: random.Random, limits: FormatLimits) -> TensorStats:
    """Survey-level, detailed, unmeasured and mixed records, in the low format and in float32."""
    pool = _value_pool(limits)
    dtype = rng.choice([limits.dtype, limits.dtype, "float32"])
    kind = rng.randrange(6)
    if kind == 0:
        return TensorStats(dtype, (3,))  # not measured
    a, b = rng.choice(pool), rng.choice(pool)
    lo, hi = (a, b) if not (a > b) else (b, a)
    if kind <= 3:
        return TensorStats(dtype, (4, 4), lo, hi, rng.randrange(17))
    finite = [v for v in pool if math.isfinite(v)]
    f1, f2 = sorted((rng.choice(finite), rng.choice(finite)))
    if kind == 4:  # detailed
        return TensorStats(dtype, (4,), lo, hi, 1, rng.randrange(2), rng.randrange(2), rng.randrange(2), f1, f2,
                           1e-3, 0, 0, 0)
    return TensorStats(dtype, (4,), lo, hi, finite_min=f1, finite_max=f2)  # finite extremes only


def _trace(rng: random.Random, limits: FormatLimits, n: int = 300) -> tuple[PassTrace, list[ModuleInfo]]:
    calls, events, modules = [], [], []
    for i in range(n):
        count = rng.randrange(3)
        outs = tuple(TensorRecord(f"out[{k}]", _stats(rng, limits), rng.random() < 0.8) for k in range(count))
        calls.append(ModuleCall(i, f"m{i}", 0, "Linear", None, i, outputs=outs))
        params = tuple(ParamRecord(f"m{i}.{p}", _stats(rng, limits)) for p in ("weight", "bias")[: rng.randrange(3)])
        modules.append(ModuleInfo(f"m{i}", "Linear", params))
        if rng.random() < 0.9:
            events.append(GradEvent(len(events), "output", _stats(rng, limits), i, "out[0]"))
        for p in params:
            events.append(GradEvent(len(events), "param", _stats(rng, limits), param=p.name))
    scale = rng.choice([1.0, 2.0**16, 3.0, 2.0**-3])
    trace = PassTrace(scale, False, tuple(calls), tuple(events), (), (), TensorStats("float32", ()), True)
    return trace, modules


def _near_limit_reference(trace: PassTrace, modules: list[ModuleInfo], limits: FormatLimits) -> list[NearLimit]:
    found = []

    def check(module: str, call: int, tensor: str, stats: TensorStats, factor: float = 1.0) -> None:
        abs_max = stats.abs_max
        if abs_max is None:
            return
        abs_max *= factor
        bits = headroom_bits(abs_max, limits)
        if bits is not None and 0 <= bits < HEADROOM_WARN_BITS:
            found.append(NearLimit(module, call, tensor, abs_max, bits))

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
            check(c.module, c.call, "grad:" + e.path, e.stats, trace.scale)
    found.sort(key=lambda n: n.headroom_bits)
    return found


@pytest.mark.parametrize("limits", [F16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("seed", range(6))
def test_near_limit_and_beyond_range_match_the_per_record_definitions(limits: FormatLimits, seed: int) -> None:
    trace, modules = _trace(random.Random(seed), limits)
    expected = _near_limit_reference(trace, modules, limits)
    assert near_limit(trace, modules, limits) == expected
    assert expected  # the pool puts values near the max: the check can fail
    beyond = [
        (p.name, p.stats.abs_max)
        for info in modules
        for p in info.params
        if p.stats.dtype != limits.dtype and p.stats.abs_max is not None
        and p.stats.abs_max >= limits.overflow_threshold
    ]
    assert beyond_range_params(modules, limits) == beyond


@pytest.mark.parametrize("seed", range(4))
def test_predicted_top_and_bad_outputs_match_the_per_record_definitions(seed: int) -> None:
    trace, modules = _trace(random.Random(100 + seed), F16)
    low = {c.module for c in trace.calls if any(r.stats.dtype == F16.dtype for r in c.outputs)}
    assert low_precision_modules(trace, F16) == low
    owners = {p.name: info.name for info in modules for p in info.params}
    largest = 0.0
    for e in trace.grad_events:
        if (e.stats.dtype == F16.dtype or (e.kind == "param" and owners.get(e.param or "") in low)) and e.stats.abs_max:
            largest = max(largest, e.stats.abs_max)
    top = predicted_top(trace, F16, modules)
    assert top == predicted_top(trace, F16, modules, owners, low)
    if 0 < largest < math.inf:
        assert largest * 2.0**top < F16.overflow_threshold or top == 0
    bad = [c for c in trace.calls if any(r.stats.measured and not r.stats.is_finite for r in c.outputs)]
    assert list(trace.bad_output_calls()) == bad and bad
    origin = forward_origin(trace)
    assert origin is not None and origin.module == min(bad, key=lambda c: c.end_order).module
    seen = {e.call for e in trace.grad_events if e.kind == "output"}
    assert not_captured(trace) == [
        c.label for c in trace.calls if any(r.requires_grad for r in c.outputs) and c.index not in seen
    ]


@pytest.mark.parametrize("sparse", [False, True])
def test_grouped_sums_match_summing_row_by_row(sparse: bool) -> None:
    rng = np.random.default_rng(3)
    rows_i = rng.integers(0, 2**36, size=(500, 130))  # large counts, all sums still below 2**53 (exact)
    if sparse:  # most bins empty, as in a real gradient's histogram
        rows_i[rng.random(rows_i.shape) < 0.9] = 0
    groups = [int(g) for g in rng.integers(0, 137, size=500)]
    used = sorted(set(groups))
    dense = [used.index(g) for g in groups]  # every group has a row, as LossPrediction numbers them
    summed = np.zeros((len(used), 130))
    for g, row in zip(dense, rows_i):
        summed[g] += row.astype(np.float64)
    expected = np.concatenate((np.zeros((len(used), 1)), np.cumsum(summed, axis=1)), axis=1)  # bins below each column
    grouped = _Grouped(HistogramRows.from_dense([rows_i], 130), np.asarray(dense))
    columns = np.asarray([0, 1, 5, 5, 64, 129, 130, 200])
    below = grouped.below_each(columns, len(used))
    assert np.array_equal(below, expected[:, np.minimum(columns, 130)])
    for c in (0, 3, 77, 130, 131):
        assert grouped.below(c) == expected[:, min(c, 130)].sum()
        assert [grouped.below(c, g) for g in range(len(used))] == expected[:, min(c, 130)].tolist()


def test_records_built_field_by_field_equal_their_constructors() -> None:
    """build_trace sets only the fields that differ from the defaults: every record reads, compares, hashes and
    round-trips as the one its constructor builds from the same values."""
    import dataclasses

    import ampdoctor
    from ampdoctor.report import Report

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    report = ampdoctor.diagnose(model, torch.randn(3, 4), verify=False)
    records = [*report.trace.calls, *report.trace.grad_events]
    records += [r for c in report.trace.calls for r in (*c.inputs, *c.outputs)]
    assert any(r.producer is not None for c in report.trace.calls for r in c.inputs)
    assert any(e.param is not None for e in report.trace.grad_events)
    for record in records:
        built = type(record)(**{f.name: getattr(record, f.name) for f in dataclasses.fields(record)})
        assert built == record and hash(built) == hash(record)
    assert Report.from_json(report.to_json()) == report


def test_records_the_path_walk_skips_hold_no_source_location() -> None:
    """report.paths skips these records when it looks for source files: none can hold a SourceLocation."""
    import dataclasses
    import typing

    from ampdoctor.records import SourceLocation
    from ampdoctor.report.paths import _NO_LOCATION

    def reachable(hint: object, seen: set[object]) -> bool:
        if hint is SourceLocation:
            return True
        if hint in seen:
            return False
        seen.add(hint)
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            return any(reachable(h, seen) for h in typing.get_type_hints(hint).values())
        return any(reachable(a, seen) for a in typing.get_args(hint))

    for cls in _NO_LOCATION:
        assert not reachable(cls, set()), cls
    from ampdoctor.records import OpFinding

    assert reachable(OpFinding, set())  # the check finds one where there is one


@pytest.mark.parametrize("seed", range(4))
def test_forward_healthy_looks_only_at_bad_output_calls_and_agrees(seed: int) -> None:
    trace, _ = _trace(random.Random(200 + seed), F16, n=40)
    expected = trace.forward_finite() and not any(
        r.stats.measured and (r.stats.has_nan or r.stats.has_posinf) for c in trace.calls for r in c.outputs
    )
    assert trace.forward_healthy() == expected
    rng = random.Random(seed)
    neg = TensorStats("float16", (4,), -INF, 1.0, 0)  # -inf only: a mask-like output, still healthy
    calls = tuple(
        ModuleCall(i, f"m{i}", 0, "Linear", None, i, outputs=(TensorRecord("out", neg if rng.random() < 0.5 else
                                                                          TensorStats("float16", (4,), -1.0, 1.0, 0)),))
        for i in range(6)
    )
    finite = TensorStats("float32", (), 0.5, 0.5, 0)
    clean = PassTrace(1.0, False, calls, (), (), (TensorRecord("out", finite),), finite, False)
    assert clean.forward_healthy()
