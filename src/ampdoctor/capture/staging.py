"""Small tensors measured together: each is copied into one staging buffer per (device, dtype) as it is seen, and
the buffer's segments are reduced together when it is full or when the pass reads its statistics back.

A model of many small modules makes many small activations and gradients. Measured one by one, each costs a few
reductions and a few 0-d result tensors (kernel launches, and hundreds of bytes of tensor bookkeeping each, kept
until the readback). Staged, each costs one copy into the buffer (its values as they are now: a later in-place
write cannot change them, and no reference to the tensor is kept); a flush then makes four 1-D results for all
its segments (min, max, NaN-ignoring sum, nonzero count: the survey's statistics, as
:class:`~ampdoctor.capture.stats.StatsCollector` defines them) with a handful of segmented reductions, and adds
the binade histogram of the segments that asked for one into a running total.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from ..thresholds import HIST_HIGH, HIST_LOW

# Tensors up to this many elements are staged; larger ones are measured on their own (the reductions dominate).
STAGE_EACH = 1 << 12
# Elements a staging buffer holds (its scratch: this many elements of the tensors' dtype, plus float32 copies of
# it during a flush).
STAGE_ELEMENTS = 1 << 16
# Dtypes staged (exact in float32, where the flush reduces), and the devices staged: the CPU only, where each op
# costs its dispatch in the pass's time. A flush hands the segment lengths to the device; on CUDA that copy from
# host memory would wait for the stream (a synchronisation per flush), while per-tensor reductions there are
# queued without one.
STAGED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
STAGED_DEVICES = frozenset({"cpu"})
# Binade histogram layout (capture.stats.StatsCollector.add_histogram): bin 0 holds everything nonzero below
# 2**HIST_LOW, bins 1.. the binades 2**k for HIST_LOW <= k < HIST_HIGH, the last bin everything finite above.
HIST_BINS = HIST_HIGH - HIST_LOW + 2
_FP32_BIAS = 127


def histogram_bins(w: torch.Tensor, values: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The histogram bin of each element of the float32 tensor ``w`` (contiguous), and ``HIST_BINS`` (a bin to
    drop) for zeros, infinities and NaN: the layout of ``HIST_BINS`` above, from the float32 exponent field.
    ``values``: the tensor ``w`` was converted from, when wider (its zeros are dropped; a float64 value too small
    for float32 lands in the bottom bin)."""
    exponent = (w.view(torch.int32) >> 23) & 0xFF  # 0: zero or float32 subnormal; 255: inf or NaN
    bins = (exponent - (HIST_LOW + _FP32_BIAS - 1)).clamp_(0, HIST_BINS - 1)
    zero = (w if values is None else values) == 0
    return bins.masked_fill_(zero | (exponent == 255), HIST_BINS)


Statistics = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class Segments:
    """Statistics already reduced for consecutive tensors: (min, max, NaN-ignoring sum, nonzero count), 1-D
    tensors of one value per tensor, on ``device``."""

    __slots__ = ("device", "values")

    def __init__(self, device: torch.device, values: Statistics) -> None:
        self.device = device
        self.values = values

    def statistics(self) -> Optional[Statistics]:
        return self.values


class Stage:
    """One staging buffer (a device and a dtype) and the statistics of the segments flushed from it."""

    __slots__ = ("buffer", "used", "lengths", "wants_hist", "any_hist", "results", "count", "histogram")

    def __init__(self, dtype: torch.dtype, device: torch.device, histogram: Callable[[torch.device], torch.Tensor]):
        self.buffer = torch.empty(STAGE_ELEMENTS, dtype=dtype, device=device)
        self.used = 0
        self.lengths: list[int] = []
        self.wants_hist: list[bool] = []
        self.any_hist = False
        # Per flush: (min, max, NaN-ignoring sum, nonzero count), float32 1-D tensors of one value per segment.
        self.results: list[Statistics] = []
        self.count = 0  # segments staged so far: the index of the next one
        self.histogram = histogram  # the running histogram total of the device (int64, HIST_BINS)

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def add(self, x: torch.Tensor, hist: bool = False) -> int:
        """Copy ``x`` (no gradient needed; 1 to ``STAGE_EACH`` elements of the buffer's dtype and device) into the
        buffer; returns its index among this stage's segments. ``hist``: add its binade histogram to the total."""
        n = x.numel()
        if self.used + n > STAGE_ELEMENTS:
            self.flush()
        self.buffer[self.used : self.used + n].view(x.shape).copy_(x)
        self.used += n
        self.lengths.append(n)
        self.wants_hist.append(hist)
        self.any_hist = self.any_hist or hist
        self.count += 1
        return self.count - 1

    def flush(self) -> None:
        """Reduce the staged segments (a few kernels for all of them); the buffer is free again afterwards."""
        if not self.lengths:
            return
        data = self.buffer[: self.used]
        w = data if data.dtype == torch.float32 else data.float()
        lengths = torch.tensor(self.lengths, device=w.device)
        reduce = torch.segment_reduce  # NaN propagates through min and max, as in aminmax
        mins = reduce(w, "min", lengths=lengths)
        maxs = reduce(w, "max", lengths=lengths)
        sums = reduce(torch.nan_to_num(w, nan=0.0, posinf=math.inf, neginf=-math.inf), "sum", lengths=lengths)
        nonzero = reduce((w != 0).float(), "sum", lengths=lengths)  # NaN counts as nonzero, as in count_nonzero
        self.results.append((mins, maxs, sums, nonzero))
        if self.any_hist:
            bins = histogram_bins(w)
            if not all(self.wants_hist):
                wanted = torch.tensor(self.wants_hist, device=w.device).repeat_interleave(lengths)
                bins.masked_fill_(wanted.logical_not_(), HIST_BINS)
            total = self.histogram(w.device)
            total += torch.bincount(bins, minlength=HIST_BINS + 1)[:HIST_BINS]
        self.used = 0
        self.lengths = []
        self.wants_hist = []
        self.any_hist = False

    def statistics(self) -> Optional[Statistics]:
        """Every segment's (min, max, NaN-ignoring sum, nonzero count), flushed first; None when none was staged."""
        self.flush()
        if not self.results:
            return None
        if len(self.results) > 1:
            self.results = [tuple(torch.cat(parts) for parts in zip(*self.results))]  # type: ignore[list-item]
        return self.results[0]
