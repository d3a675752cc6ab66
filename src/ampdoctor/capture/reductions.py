"""Small reductions the statistics collector reads back: a tensor in pieces (``chunks``, sized by
``chunk_size``), extremes of many small tensors at once, what a NaN-ignoring sum says about the infs behind a NaN,
and the detailed record from its counts."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import torch

from ..records import FormatLimits, TensorStats

# Detailed statistics are reduced over chunks (scratch per chunk: about 13 bytes an element) of at least CHUNK
# elements and 1/64 of a larger tensor, at most CHUNK_MAX. Small pieces reuse the heap blocks that a model's small
# activations free (fixed 2**16-element pieces left the heap 1-2 MiB larger on a 7 MiB step); a large tensor
# takes at most 64 pieces up to 16M elements, and its scratch stays near a tenth of its own size.
CHUNK = 1 << 14
CHUNK_MAX = 1 << 18


def chunk_size(numel: int) -> int:
    """The piece size in which the detailed level reads a tensor of ``numel`` elements."""
    return min(CHUNK_MAX, max(CHUNK, -(-numel >> 6)))


def _nansum32(w: torch.Tensor) -> torch.Tensor:
    """The NaN-ignoring float32 sum of ``w``. Summing a low-precision tensor with ``dtype=float32`` first makes a
    float32 copy of all of it, so a large one is summed in chunks (inf + -inf is NaN either way)."""
    size = chunk_size(w.numel())
    if w.dtype == torch.float32 or w.numel() <= 4 * size:
        return torch.nansum(w, dtype=torch.float32)
    return torch.stack([torch.nansum(c, dtype=torch.float32) for c in chunks(w, size)]).sum()


_ZERO, _NEGATIVE_ZERO = 0.0, -0.0


def shared_float(value: float, table: dict[float, float]) -> float:
    """``value`` as one float object per distinct value (``table`` holds them): a pass's records repeat few
    values (a float16 tensor's extremes take at most 63,488 finite values, and 0.0 is the minimum of every ReLU
    output), so on a model of 10,000 modules 80,000 extremes are about 21,000 distinct floats. Zeros keep their
    sign (``-0.0 == 0.0`` as a dict key); a NaN stays the object it is (it never finds itself in ``table``)."""
    if value == 0.0:
        return _ZERO if math.copysign(1.0, value) > 0 else _NEGATIVE_ZERO
    return table.setdefault(value, value)


def chunks(x: torch.Tensor, size: int = CHUNK) -> Iterator[torch.Tensor]:
    """``x`` flattened, in pieces of at most ``size`` elements; only a non-contiguous piece is ever copied."""
    if x.is_contiguous() or x.numel() <= size:
        flat = x.reshape(-1)
        for start in range(0, flat.numel(), size):
            yield flat[start : start + size]
    elif x.shape[0] == 1:
        yield from chunks(x[0], size)
    else:  # a large non-contiguous tensor: whole rows of its first dimension at a time
        rows = max(1, size // max(1, x[0].numel()))
        for start in range(0, x.shape[0], rows):
            yield from chunks(x[start : start + rows], size)


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
