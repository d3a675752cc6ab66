"""Small reductions the statistics collector reads back: extremes of many small tensors at once, what a
NaN-ignoring sum says about the infs behind a NaN, and the detailed record from its counts."""

from __future__ import annotations

import itertools
import math

import torch

from ..records import FormatLimits, TensorStats


def behind_nan(low: float, high: float, nansum: float) -> tuple[float, float]:
    """Survey-level min and max of a tensor holding NaN: NaN stays in one of them (the tensor is not finite), and
    the other says which inf the tensor also holds, if any: a NaN-ignoring sum of +inf (or NaN: +inf and -inf
    together) means +inf is there, -inf means -inf. (A float32 sum of finite values could overflow only for
    values within a factor ``numel`` of float32's maximum: itself an overflow.)"""
    if nansum == math.inf or nansum != nansum:
        return math.nan, math.inf
    if nansum == -math.inf:
        return -math.inf, math.nan
    return math.nan, math.nan


def segment_extremes(
    flat: torch.Tensor, lengths: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per consecutive segment of ``flat`` (segments sorted by size): its min, max, NaN-ignoring sum and nonzero
    count, as 1-D tensors of one value per segment (float32): one reduction of each kind per run of equal sizes."""
    mins: list[torch.Tensor] = []
    maxs: list[torch.Tensor] = []
    sums: list[torch.Tensor] = []
    counts: list[torch.Tensor] = []
    start = 0
    for size, run in itertools.groupby(lengths):
        count = len(list(run))
        block = flat[start : start + size * count].view(count, size)
        mins.append(block.amin(dim=1))
        maxs.append(block.amax(dim=1))
        sums.append(block.nansum(dim=1))
        counts.append(torch.count_nonzero(block, dim=1))
        start += size * count
    one = torch.cat if len(mins) > 1 else (lambda parts: parts[0])
    return one(mins), one(maxs), one(sums), one(counts).to(flat.dtype)


_SEGMENT_IDS: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def segment_ids(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``i`` for every element of the ``i``-th of consecutive segments of these sizes, on ``device`` (cached: a
    model's parameter layout comes back in every backward, with no host-to-device copy)."""
    key = (lengths, device)
    found = _SEGMENT_IDS.get(key)
    if found is None:
        if len(_SEGMENT_IDS) > 64:
            _SEGMENT_IDS.clear()
        sizes = torch.tensor(lengths, device=device)
        found = _SEGMENT_IDS[key] = torch.repeat_interleave(torch.arange(len(lengths), device=device), sizes)
    return found


def detailed_record(name: str, shape: tuple[int, ...], counts: list[float], extremes: list[float]) -> TensorStats:
    nonzero, nan, posinf, neginf, below_tiny, flush, overflow = (int(v) for v in counts)
    finite_min, finite_max, smallest = extremes
    numel = math.prod(shape)
    zeros = numel - nonzero
    has_finite = numel - nan - posinf - neginf > 0
    if nan:
        low = high = math.nan
    else:
        low = -math.inf if neginf else (finite_min if has_finite else math.inf)
        high = math.inf if posinf else (finite_max if has_finite else -math.inf)
    return TensorStats(
        name,
        shape,
        low,
        high,
        zeros,
        nan,
        posinf,
        neginf,
        finite_min if has_finite else None,
        finite_max if has_finite else None,
        smallest if math.isfinite(smallest) else None,
        below_tiny - zeros,
        overflow - posinf - neginf,
        flush - zeros,
    )


def format_limits(dtype: torch.dtype) -> FormatLimits:
    """Limits of a floating format, with the exact round-to-nearest-even edges used when casting to it."""
    info = torch.finfo(dtype)
    mantissa_bits = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23, torch.float64: 52}[dtype]
    top_exponent = math.floor(math.log2(info.max))
    smallest_subnormal = info.tiny * 2.0**-mantissa_bits
    return FormatLimits(
        dtype=str(dtype).replace("torch.", ""),
        max=float(info.max),
        tiny=float(info.tiny),
        smallest_subnormal=smallest_subnormal,
        # Half an ulp above max rounds (to even) to inf; exactly half of the smallest subnormal rounds to 0.
        overflow_threshold=float(info.max) + 2.0 ** (top_exponent - mantissa_bits - 1),
        flush_threshold=smallest_subnormal / 2,
    )
