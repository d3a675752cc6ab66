"""Statistics of ``ampdoctor.stats`` against a float64 reference computed with numpy.

numpy has no bfloat16, so tensors are upcast exactly (``t.float().double()``; fp16/bf16/fp32 values are exact in
float64). The cast counts are checked against the round-to-nearest-even edges derived here from the bit layout of
each format, not against torch's cast, so a wrong implementation cannot agree with its own oracle.
"""

from __future__ import annotations

import gc
import math
import weakref
from typing import Any, Optional

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ampdoctor.capture.stats import DETAIL_FIELDS, SURVEY_FIELDS, StatsCollector, format_limits, tensor_stats
from ampdoctor.records import TensorStats

INF = math.inf
NAN = math.nan
LOW_DTYPES = (torch.float16, torch.bfloat16)
SOURCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
COUNT_FIELDS = tuple(name for name in DETAIL_FIELDS if name.endswith("_count"))
VALUE_FIELDS = tuple(name for name in DETAIL_FIELDS if name not in COUNT_FIELDS)

# (explicit mantissa bits, smallest normal exponent, largest exponent) of each diagnosed format.
_LAYOUT = {torch.float16: (10, -14, 15), torch.bfloat16: (7, -126, 127)}


def edges(low: torch.dtype) -> dict[str, float]:
    """The format's limits and its exact rounding edges, from the bit layout alone (all exact in float64)."""
    m, emin, emax = _LAYOUT[low]
    smallest_subnormal = 2.0 ** (emin - m)
    return {
        "max": (2 - 2.0**-m) * 2.0**emax,
        # Halfway between max and the next (unrepresentable) step 2**(emax+1): the tie rounds to even, i.e. up.
        "overflow_threshold": (2 - 2.0 ** -(m + 1)) * 2.0**emax,
        "tiny": 2.0**emin,
        "smallest_subnormal": smallest_subnormal,
        # Halfway between 0 and the smallest subnormal: the tie rounds to even, i.e. to 0.
        "flush_threshold": smallest_subnormal / 2,
    }


F16 = edges(torch.float16)
BF16 = edges(torch.bfloat16)
F32_TINY_SUBNORMAL = 2.0**-149


def upcast(t: torch.Tensor) -> np.ndarray:
    """Exact float64 copy of a tensor's values (numpy has no bfloat16)."""
    wide = t.double() if t.dtype == torch.float64 else t.float().double()
    return wide.numpy().reshape(-1)


def reference(t: torch.Tensor, low: torch.dtype) -> dict[str, Any]:
    """Every statistic of ``t`` computed in float64 with numpy."""
    a = upcast(t)
    lim = edges(low)
    finite = a[np.isfinite(a)]
    nonzero = np.abs(finite[finite != 0])
    any_nan = bool(np.isnan(a).any())
    return {
        "min": NAN if any_nan else float(a.min()),
        "max": NAN if any_nan else float(a.max()),
        "zero_count": int((a == 0).sum()),
        "nan_count": int(np.isnan(a).sum()),
        "posinf_count": int((a == INF).sum()),
        "neginf_count": int((a == -INF).sum()),
        "finite_min": float(finite.min()) if finite.size else None,
        "finite_max": float(finite.max()) if finite.size else None,
        "min_abs_nonzero": float(nonzero.min()) if nonzero.size else None,
        "subnormal_count": int((nonzero < lim["tiny"]).sum()),
        # Values already in the format never overflow or flush; for them these counts are 0 by construction.
        "cast_overflow_count": int((np.abs(finite) >= lim["overflow_threshold"]).sum()),
        "cast_flush_count": int((nonzero <= lim["flush_threshold"]).sum()),
    }


def assert_field(name: str, actual: Any, expected: Any) -> None:
    if expected is None:
        assert actual is None, f"{name}: {actual!r} is not None"
    elif name in COUNT_FIELDS:
        assert type(actual) is int, f"{name}: {actual!r} is not an int"
        assert actual == expected, f"{name}: {actual} != {expected}"
    else:
        assert type(actual) is float, f"{name}: {actual!r} is not a float"
        if math.isnan(expected):
            assert math.isnan(actual), f"{name}: {actual!r} is not NaN"
        else:
            assert actual == expected, f"{name}: {actual!r} != {expected!r}"


def assert_detailed(stats: TensorStats, t: torch.Tensor, low: torch.dtype) -> None:
    expected = reference(t, low)
    assert stats.dtype == str(t.dtype).replace("torch.", "")
    assert stats.shape == tuple(t.shape)
    for name in DETAIL_FIELDS:
        assert_field(name, getattr(stats, name), expected[name])
    assert stats.measured and stats.detailed
    assert stats.numel == t.numel()
    assert stats.nonzero_count == t.numel() - expected["zero_count"]
    assert stats.nonfinite_count == expected["nan_count"] + expected["posinf_count"] + expected["neginf_count"]
    assert stats.has_nan == (expected["nan_count"] > 0)
    assert stats.has_posinf == (expected["posinf_count"] > 0)
    assert stats.has_neginf == (expected["neginf_count"] > 0)
    assert stats.is_finite == (stats.nonfinite_count == 0)
    assert stats.only_neginf == (expected["neginf_count"] > 0 and stats.nonfinite_count == expected["neginf_count"])
    a = upcast(t)
    finite = a[np.isfinite(a)]
    assert stats.abs_max == (float(np.abs(finite).max()) if finite.size else None)


def assert_survey(stats: TensorStats, t: torch.Tensor) -> None:
    expected = reference(t, torch.float16)
    assert stats.dtype == str(t.dtype).replace("torch.", "")
    assert stats.shape == tuple(t.shape)
    a = upcast(t)
    nan = bool(np.isnan(a).any())
    posinf = bool((a == INF).any())
    neginf = bool((a == -INF).any())
    for name in SURVEY_FIELDS:
        if nan and name in ("min", "max"):
            continue  # below: a NaN and the inf it hides
        assert_field(name, getattr(stats, name), expected[name])
    if nan:  # NaN stays in one of min/max; the other names an inf it hides (+inf first), else is NaN too
        finite = a[np.isfinite(a)].astype(np.float64)
        if np.abs(finite).sum() > torch.finfo(torch.float32).max:
            # The NaN-ignoring sum is a float32 one: finite values summing past float32's maximum (values near
            # it, an overflow themselves) read as an inf too.
            posinf, neginf = posinf or stats.max == INF, neginf or stats.min == -INF
        if posinf:
            assert stats.max == INF and math.isnan(stats.min)
        elif neginf:
            assert stats.min == -INF and math.isnan(stats.max)
        else:
            assert math.isnan(stats.min) and math.isnan(stats.max)
    for name in DETAIL_FIELDS[len(SURVEY_FIELDS) :]:
        assert getattr(stats, name) is None, name
    assert stats.measured and not stats.detailed
    assert stats.nonfinite_count is None
    assert stats.nonzero_count == t.numel() - expected["zero_count"]
    # Survey level: min/max, and behind a NaN the inf it hides (a NaN-ignoring sum): the verdict overflow vs NaN
    # needs it when no detailed pass runs. With both infs and NaN, +inf is the one named.
    assert stats.has_nan == nan
    assert stats.has_posinf == posinf
    assert stats.has_neginf == (neginf and not (nan and posinf))
    assert stats.is_finite == bool(np.isfinite(a).all())
    assert stats.only_neginf == (neginf and not nan and not posinf)
    assert stats.abs_max == (float(np.abs(a).max()) if np.isfinite(a).all() else None)


# ---------------------------------------------------------------------------------------------------------------
# Value and tensor strategies


def _below(x: float) -> float:
    return math.nextafter(x, 0.0)


def _above(x: float) -> float:
    return math.nextafter(x, INF)


EDGE_VALUES = (
    # specials
    0.0, -0.0, INF, -INF, NAN, 1.0, 0.1, 3.0,
    # float16 edges, as float32 and as float64 neighbours of the thresholds
    F16["max"], 65519.0, F16["overflow_threshold"], 65536.0, 70000.0, _below(F16["overflow_threshold"]),
    np.nextafter(np.float32(F16["overflow_threshold"]), np.float32(0)).item(),
    F16["tiny"], F16["tiny"] - F16["smallest_subnormal"], 2.0**-20, F16["smallest_subnormal"], 1.5 * 2.0**-24,
    F16["flush_threshold"], 2.0**-25 + 2.0**-48, _above(F16["flush_threshold"]), _below(F16["flush_threshold"]),
    2.0**-25 * (1 + 2.0**-7), 2.0**-26,
    # bfloat16 edges
    BF16["max"], BF16["overflow_threshold"], BF16["overflow_threshold"] - 2.0**104, _below(BF16["overflow_threshold"]),
    float(torch.finfo(torch.float32).max), 1e39,
    BF16["tiny"], BF16["smallest_subnormal"], BF16["flush_threshold"], BF16["flush_threshold"] + F32_TINY_SUBNORMAL,
    _above(BF16["flush_threshold"]), F32_TINY_SUBNORMAL,
)  # fmt: skip

values = st.one_of(
    st.builds(lambda v, negative: -v if negative else v, st.sampled_from(EDGE_VALUES), st.booleans()),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.floats(min_value=-7e4, max_value=7e4, width=32),
    st.floats(min_value=-(2.0**-13), max_value=2.0**-13, width=32),
    st.floats(allow_nan=True, allow_infinity=True),
)
shapes = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)
LAYOUTS = ("contiguous", "transposed", "strided", "expanded")


@st.composite
def tensors(draw: st.DrawFn, dtypes: tuple[torch.dtype, ...] = SOURCE_DTYPES) -> torch.Tensor:
    """A floating tensor (0-d, 1-element or multi-dimensional; contiguous or a non-contiguous view)."""
    dtype = draw(st.sampled_from(dtypes))
    shape: tuple[int, ...] = draw(shapes)
    layout = draw(st.sampled_from(LAYOUTS)) if shape else "contiguous"
    if layout == "transposed":
        base_shape = shape[::-1]
    elif layout == "strided":
        base_shape = (2 * shape[0],) + shape[1:]
    elif layout == "expanded":
        base_shape = (1,) + shape[1:]
    else:
        base_shape = shape
    count = math.prod(base_shape)
    data = draw(st.lists(values, min_size=count, max_size=count))
    base = torch.tensor(data, dtype=torch.float64).to(dtype).reshape(base_shape)
    if layout == "transposed":
        t = base.permute(*reversed(range(base.dim())))
    elif layout == "strided":
        t = base[::2]
    elif layout == "expanded":
        t = base.expand(shape)
    else:
        t = base
    assert tuple(t.shape) == shape
    return t


# ---------------------------------------------------------------------------------------------------------------
# Property tests


@settings(max_examples=250, deadline=None)
@given(t=tensors(), low=st.sampled_from(LOW_DTYPES))
def test_detailed_stats_match_float64_reference(t: torch.Tensor, low: torch.dtype) -> None:
    assert_detailed(tensor_stats(t, low, detailed=True), t, low)


@settings(max_examples=120, deadline=None)
@given(t=tensors(), low=st.sampled_from(LOW_DTYPES))
def test_survey_stats_match_float64_reference(t: torch.Tensor, low: torch.dtype) -> None:
    assert_survey(tensor_stats(t, low, detailed=False), t)


@settings(max_examples=40, deadline=None)
@given(
    items=st.lists(st.tuples(tensors(), st.sampled_from((None, True, False))), min_size=1, max_size=6),
    low=st.sampled_from(LOW_DTYPES),
    default_detail=st.booleans(),
)
def test_collector_mixing_dtypes_and_levels_reads_back_once(
    items: list[tuple[torch.Tensor, Optional[bool]]], low: torch.dtype, default_detail: bool
) -> None:
    collector = StatsCollector(low, detailed=default_detail)
    slots = [collector.add(t, detailed=detail) for t, detail in items]
    records = collector.read()
    assert collector.readbacks == 1
    assert len(records) == len(collector)
    for (t, detail), slot in zip(items, slots):
        if default_detail if detail is None else detail:
            assert_detailed(records[slot], t, low)
        else:
            assert_survey(records[slot], t)


@settings(max_examples=60, deadline=None)
@given(t=tensors(), low=st.sampled_from(LOW_DTYPES), detailed=st.booleans(), exponent=st.integers(1, 24))
def test_scaled_down_divides_values_and_keeps_counts(
    t: torch.Tensor, low: torch.dtype, detailed: bool, exponent: int
) -> None:
    stats = tensor_stats(t, low, detailed=detailed)
    scale = 2.0**exponent
    scaled = stats.scaled_down(scale)
    for name in DETAIL_FIELDS:
        before, after = getattr(stats, name), getattr(scaled, name)
        if before is None:
            assert after is None, name
        elif name in COUNT_FIELDS:
            assert after == before, name
        elif math.isnan(before):
            assert math.isnan(after), name
        else:  # a power-of-two scale divides exactly (no value here is near the float64 subnormal range)
            assert after == before / scale, name
    assert (scaled.dtype, scaled.shape) == (stats.dtype, stats.shape)


# ---------------------------------------------------------------------------------------------------------------
# Examples at the rounding edges, with the expected numbers written out by hand


def _stats(values: list[float], dtype: torch.dtype, low: torch.dtype) -> TensorStats:
    t = torch.tensor(values, dtype=torch.float64).to(dtype)
    assert upcast(t).tolist() == pytest.approx(values, nan_ok=True, rel=0, abs=0)  # the values are exact
    return tensor_stats(t, low)


FP16_EDGE_VALUES = [
    65504.0, 65519.0, 65520.0, -65520.0, 70000.0,
    2.0**-25, -(2.0**-25), 2.0**-25 + 2.0**-48, 2.0**-26, 2.0**-24, 2.0**-20, 2.0**-14,
    0.0, -0.0, INF, -INF, NAN, 1.0,
]  # fmt: skip


def test_float32_at_float16_edges() -> None:
    s = _stats(FP16_EDGE_VALUES, torch.float32, torch.float16)
    assert math.isnan(s.min) and math.isnan(s.max)
    assert (s.zero_count, s.nan_count, s.posinf_count, s.neginf_count) == (2, 1, 1, 1)
    assert (s.finite_min, s.finite_max, s.min_abs_nonzero) == (-65520.0, 70000.0, 2.0**-26)
    # below 2**-14: ±2**-25, 2**-25 + 2**-48, 2**-26, 2**-24, 2**-20
    assert s.subnormal_count == 6
    # 65519 rounds to 65504; 65520, -65520 and 70000 become inf
    assert s.cast_overflow_count == 3
    # ±2**-25 and 2**-26 become 0; 2**-25 + 2**-48 rounds up to 2**-24
    assert s.cast_flush_count == 3


def test_float32_at_float16_edges_diagnosed_as_bfloat16() -> None:
    s = _stats(FP16_EDGE_VALUES, torch.float32, torch.bfloat16)
    assert (s.subnormal_count, s.cast_overflow_count, s.cast_flush_count) == (0, 0, 0)
    assert (s.zero_count, s.nan_count, s.posinf_count, s.neginf_count) == (2, 1, 1, 1)


def test_float32_at_bfloat16_edges() -> None:
    threshold = BF16["overflow_threshold"]
    values = [
        BF16["max"], threshold - 2.0**104, threshold, -threshold, float(torch.finfo(torch.float32).max),
        2.0**-126, 2.0**-133, 2.0**-134, -(2.0**-134), 2.0**-134 + 2.0**-149, 2.0**-149, 1.0,
    ]  # fmt: skip
    s = _stats(values, torch.float32, torch.bfloat16)
    assert (s.min, s.max) == (-threshold, float(torch.finfo(torch.float32).max))
    assert (s.zero_count, s.nan_count, s.posinf_count, s.neginf_count) == (0, 0, 0, 0)
    assert (s.finite_min, s.min_abs_nonzero) == (-threshold, 2.0**-149)
    assert s.subnormal_count == 5
    assert s.cast_overflow_count == 3  # ±threshold and float32 max; threshold - 2**104 rounds to max
    assert s.cast_flush_count == 3  # ±2**-134 and 2**-149; 2**-134 + 2**-149 rounds up to 2**-133


def test_float16_tensor_already_in_the_format() -> None:
    s = _stats([65504.0, -65504.0, 2.0**-24, 2.0**-20, 2.0**-14, 0.0, INF], torch.float16, torch.float16)
    assert (s.cast_overflow_count, s.cast_flush_count) == (0, 0)
    assert (s.subnormal_count, s.zero_count, s.posinf_count) == (2, 1, 1)
    assert (s.min, s.max, s.finite_max, s.min_abs_nonzero) == (-65504.0, INF, 65504.0, 2.0**-24)


def test_bfloat16_tensor_diagnosed_as_float16() -> None:
    # 65280 and 65536 are neighbours in bfloat16: the first stays finite in float16, the second overflows.
    values = [65280.0, 65536.0, -1e38 // 2**100 * 2**100, 2.0**-25, 2.0**-25 * (1 + 2.0**-7), 2.0**-26]
    t = torch.tensor(values, dtype=torch.float64).to(torch.bfloat16)
    s = tensor_stats(t, torch.float16)
    assert (s.cast_overflow_count, s.cast_flush_count, s.subnormal_count) == (2, 2, 3)
    assert_detailed(s, t, torch.float16)


def test_float64_is_counted_with_single_rounding() -> None:
    # torch casts float64 through float32 (rounding twice); the counts follow the format's exact edges.
    values = [_below(65520.0), 65520.0, 2.0**-25, 2.0**-25 * (1 + 2.0**-40), _below(2.0**-25)]
    s = _stats(values, torch.float64, torch.float16)
    assert (s.cast_overflow_count, s.cast_flush_count, s.subnormal_count) == (1, 2, 3)
    threshold = BF16["overflow_threshold"]
    values = [_below(threshold), threshold, 2.0**-134 * (1 + 2.0**-40), 2.0**-134]
    s = _stats(values, torch.float64, torch.bfloat16)
    assert (s.cast_overflow_count, s.cast_flush_count, s.subnormal_count) == (1, 1, 2)


@pytest.mark.parametrize("dtype", SOURCE_DTYPES)
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_single_element(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    for value in (0.0, -0.0, 2.0**-20, -3.0, INF, -INF, NAN):
        t = torch.full(shape, value, dtype=dtype)
        assert_detailed(tensor_stats(t, torch.float16), t, torch.float16)
        assert_survey(tensor_stats(t, torch.float16, detailed=False), t)


def test_all_nonfinite_has_no_finite_extremes() -> None:
    s = tensor_stats(torch.tensor([NAN, INF, -INF, NAN]))
    assert (s.finite_min, s.finite_max, s.min_abs_nonzero, s.abs_max) == (None, None, None, None)
    assert (s.nan_count, s.posinf_count, s.neginf_count, s.nonfinite_count) == (2, 1, 1, 4)
    zeros = tensor_stats(torch.tensor([0.0, -0.0]))
    assert (zeros.finite_min, zeros.finite_max, zeros.min_abs_nonzero, zeros.abs_max) == (0.0, 0.0, None, 0.0)


def test_survey_derived_properties() -> None:
    mask = tensor_stats(torch.tensor([0.0, -INF, 1.0]), detailed=False)
    assert (mask.min, mask.max, mask.zero_count) == (-INF, 1.0, 1)
    assert mask.has_neginf and mask.only_neginf and not mask.has_posinf and not mask.has_nan
    assert not mask.is_finite and mask.abs_max is None
    both = tensor_stats(torch.tensor([-INF, INF]), detailed=False)
    assert both.has_posinf and both.has_neginf and not both.only_neginf
    nan = tensor_stats(torch.tensor([-INF, NAN]), detailed=False)
    assert nan.has_nan and not nan.only_neginf and not nan.is_finite
    fine = tensor_stats(torch.tensor([-3.0, 2.0]), detailed=False)
    assert fine.is_finite and fine.abs_max == 3.0 and not fine.only_neginf
    # detailed level: only_neginf needs no NaN and no +inf
    detailed = tensor_stats(torch.tensor([0.0, -INF, -INF]))
    assert detailed.only_neginf and detailed.abs_max == 0.0


# ---------------------------------------------------------------------------------------------------------------
# Format limits


def test_format_limits_float16_exact() -> None:
    limits = format_limits(torch.float16)
    assert limits.dtype == "float16"
    assert limits.max == 65504.0
    assert limits.tiny == 2.0**-14
    assert limits.smallest_subnormal == 2.0**-24
    assert limits.overflow_threshold == 65520.0
    assert limits.flush_threshold == 2.0**-25


@pytest.mark.parametrize("low", LOW_DTYPES)
def test_format_limits_match_finfo_and_layout(low: torch.dtype) -> None:
    limits = format_limits(low)
    info = torch.finfo(low)
    expected = edges(low)
    assert limits.dtype == str(low).replace("torch.", "")
    assert (limits.max, limits.tiny) == (float(info.max), float(info.tiny))
    assert limits.max == expected["max"] and limits.tiny == expected["tiny"]
    assert limits.smallest_subnormal == expected["smallest_subnormal"]
    assert limits.overflow_threshold == expected["overflow_threshold"]
    assert limits.flush_threshold == expected["flush_threshold"]
    # Independent check against torch's (single-rounding) float32 cast: the edges sit exactly where it changes.
    f32 = np.float32
    probes = [
        limits.overflow_threshold,
        float(np.nextafter(f32(limits.overflow_threshold), f32(0))),
        limits.flush_threshold,
        float(np.nextafter(f32(limits.flush_threshold), f32(1))),
    ]
    cast = torch.tensor(probes, dtype=torch.float32).to(low).double().tolist()
    assert cast == [INF, limits.max, 0.0, limits.smallest_subnormal]


def test_format_limits_bfloat16_values() -> None:
    limits = format_limits(torch.bfloat16)
    assert limits.max == (2 - 2.0**-7) * 2.0**127
    assert limits.tiny == 2.0**-126
    assert limits.smallest_subnormal == 2.0**-133
    assert limits.overflow_threshold == 2.0**128 - 2.0**119
    assert limits.flush_threshold == 2.0**-134


# ---------------------------------------------------------------------------------------------------------------
# The collector


def test_same_tensor_is_measured_once_until_changed_in_place() -> None:
    collector = StatsCollector(torch.float16, detailed=True)
    t = torch.tensor([1.0, 2.0, 70000.0])
    first = collector.add(t)
    assert collector.add(t) == first
    assert len(collector) == 1
    t.mul_(2)  # bumps t._version
    second = collector.add(t)
    assert second != first and len(collector) == 2
    assert collector.add(t) == second
    t[0] = NAN
    third = collector.add(t)
    assert third not in (first, second)
    records = collector.read()
    assert collector.readbacks == 1
    assert (records[first].max, records[first].cast_overflow_count) == (70000.0, 1)
    assert (records[second].max, records[second].cast_overflow_count) == (140000.0, 1)
    assert records[third].nan_count == 1 and math.isnan(records[third].max)


def test_other_level_or_other_object_is_measured_again() -> None:
    collector = StatsCollector(torch.float16, detailed=False)
    t = torch.tensor([[1.0, -2.0], [0.0, 4.0]])
    survey = collector.add(t)
    detail = collector.add(t, detailed=True)
    view = collector.add(t.t())
    assert len({survey, detail, view}) == 3
    assert collector.add(t, detailed=True) == detail  # the level last asked for is remembered
    records = collector.read()
    assert not records[survey].detailed and records[detail].detailed
    assert records[view].shape == (2, 2) and records[view].min == -2.0


def test_collector_keeps_no_reference_and_survives_id_reuse() -> None:
    collector = StatsCollector(torch.float16, detailed=True)
    t = torch.tensor([1.0, 2.0], requires_grad=True)
    ref = weakref.ref(t)
    collector.add(t * 1)
    collector.add(t)
    del t
    gc.collect()
    assert ref() is None
    # A new tensor that happens to get a freed tensor's id is measured afresh.
    expected = []
    for i in range(50):
        fresh = torch.full((2,), float(i))
        collector.add(fresh)
        expected.append(float(i))
        del fresh
    records = collector.read()
    assert [r.max for r in records[2:]] == expected


@pytest.mark.parametrize("detailed", [True, False])
@pytest.mark.parametrize(
    "t",
    [
        torch.tensor([1, 2, 3]),
        torch.tensor([True, False]),
        torch.zeros(0),
        torch.zeros(2, 0, 3, dtype=torch.float16),
        torch.tensor([1 + 2j]),
        torch.tensor(7, dtype=torch.int32),
    ],
    ids=["int64", "bool", "empty", "empty-3d-fp16", "complex", "int-0d"],
)
def test_unmeasured_tensors(t: torch.Tensor, detailed: bool) -> None:
    s = tensor_stats(t, torch.float16, detailed=detailed)
    assert s == TensorStats(dtype=str(t.dtype).replace("torch.", ""), shape=tuple(t.shape))
    assert not s.measured and not s.detailed
    assert s.abs_max is None and s.nonzero_count is None and s.nonfinite_count is None


def test_read_is_one_transfer_without_item(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, int] = {}
    order: list[str] = []

    def counting(name: str) -> Any:
        original = getattr(torch.Tensor, name)

        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            order.append(name)
            return original(self, *args, **kwargs)

        return wrapper

    for name in ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    tensors_ = [
        torch.tensor([1.0, NAN, 70000.0]),
        torch.tensor([2.0**-25, 0.0], dtype=torch.float64),
        torch.tensor([3.0, -INF], dtype=torch.float16),
        torch.tensor([[1e38, 2.0**-130]], dtype=torch.bfloat16).t(),
        torch.arange(4),
    ]
    collector = StatsCollector(torch.float16, detailed=True)
    for i, t in enumerate(tensors_):
        collector.add(t, detailed=bool(i % 2))
    assert calls == {}  # adding never synchronises
    records = collector.read()
    monkeypatch.undo()
    # One copy to the host; every conversion to Python numbers afterwards runs on that host copy.
    assert calls.keys() == {"cpu", "tolist"} and calls["cpu"] == 1 and order[0] == "cpu"
    assert collector.readbacks == 1
    for i, t in enumerate(tensors_[:-1]):
        if i % 2:
            assert_detailed(records[i], t, torch.float16)
        else:
            assert_survey(records[i], t)
    assert not records[-1].measured


def test_empty_collector_reads_nothing() -> None:
    collector = StatsCollector(torch.bfloat16, detailed=True)
    assert collector.read() == [] and collector.readbacks == 0
    collector.add(torch.tensor([1, 2]))
    assert collector.read() == [TensorStats(dtype="int64", shape=(2,))] and collector.readbacks == 0


def test_scaled_down_example() -> None:
    stats = TensorStats(
        dtype="float32", shape=(4,), min=-INF, max=1024.0, zero_count=1, nan_count=0, posinf_count=0,
        neginf_count=1, finite_min=-64.0, finite_max=1024.0, min_abs_nonzero=2.0**-20, subnormal_count=1,
        cast_overflow_count=0, cast_flush_count=1,
    )  # fmt: skip
    scaled = stats.scaled_down(2.0**10)
    assert (scaled.min, scaled.max, scaled.finite_min, scaled.finite_max) == (-INF, 1.0, -(2.0**-4), 1.0)
    assert scaled.min_abs_nonzero == 2.0**-30
    assert {name: getattr(scaled, name) for name in COUNT_FIELDS} == {
        name: getattr(stats, name) for name in COUNT_FIELDS
    }
    assert stats.scaled_down(1.0) is stats
    survey = TensorStats(dtype="float16", shape=(2,), min=-8.0, max=8.0, zero_count=0)
    scaled_survey = survey.scaled_down(8.0)
    assert (scaled_survey.min, scaled_survey.max, scaled_survey.finite_min) == (-1.0, 1.0, None)


@pytest.mark.parametrize(("fills", "expected"), [
    ((math.nan, -math.inf), (-math.inf, math.nan)),  # -inf behind the NaN: the min says so
    ((math.nan, math.inf), (math.nan, math.inf)),
    ((math.nan,), (math.nan, math.nan)),
])
def test_a_large_float16_tensor_says_which_inf_hides_behind_a_nan(
    fills: tuple[float, ...], expected: tuple[float, float]
) -> None:
    """Over 4 chunks, the NaN-ignoring sum goes chunk by chunk (no float32 copy of the whole tensor): the inf
    placed in the last chunk still shows beside the NaN placed in the first."""
    from ampdoctor.capture.stats import CHUNK

    t = torch.ones(5 * CHUNK + 3, dtype=torch.float16)
    for i, value in enumerate(fills):
        t[i * (5 * CHUNK)] = value
    stats = tensor_stats(t, torch.float16, detailed=False)
    assert (stats.min, stats.max) == pytest.approx(expected, nan_ok=True)
    assert not stats.is_finite
