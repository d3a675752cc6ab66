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

from typing import Callable, Optional

import torch

from ..thresholds import HIST_HIGH, HIST_LOW
from .reductions import segment_extremes

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
    """One staging area (a device and a dtype) and the statistics of the segments flushed from it.

    ``add`` costs one copy of the tensor (``clone``: one kernel, no slicing of a shared buffer) kept in a list of
    its shape; a flush stacks each shape's copies (one kernel per shape) and reduces all of them together. The
    statistics come back in the order the segments were added whatever their shapes."""

    __slots__ = ("groups", "used", "wants_hist", "any_hist", "results", "count", "histogram", "order", "device",
                 "dtype")

    def __init__(self, dtype: torch.dtype, device: torch.device, histogram: Callable[[torch.device], torch.Tensor]):
        self.device = device
        self.dtype = dtype
        # Per shape: (segment indices, copies), in the order of first appearance of the shape.
        self.groups: dict[tuple[int, ...], tuple[list[int], list[torch.Tensor]]] = {}
        self.used = 0
        self.wants_hist: list[bool] = []  # per segment ever added
        self.any_hist = False
        # Per flush: (min, max, NaN-ignoring sum, nonzero count), float32 1-D tensors of one value per segment,
        # in the flush's order (``order``).
        self.results: list[Statistics] = []
        self.order: list[int] = []  # segment index of each value in ``results``, all flushes in turn
        self.count = 0  # segments staged so far: the index of the next one
        self.histogram = histogram  # the running histogram total of the device (int64, HIST_BINS)

    def add(self, x: torch.Tensor, hist: bool = False) -> int:
        """Copy ``x`` (no gradient needed; 1 to ``STAGE_EACH`` elements of this stage's dtype and device); returns
        its index among this stage's segments. ``hist``: add its binade histogram to the total."""
        n = x.numel()
        if self.used + n > STAGE_ELEMENTS:
            self.flush()
        shape = x.shape
        group = self.groups.get(shape)
        if group is None:
            group = self.groups[shape] = ([], [])
        index = self.count
        group[0].append(index)
        group[1].append(x.clone())  # the values as they are now: a later in-place write cannot change them
        self.used += n
        self.wants_hist.append(hist)
        if hist:
            self.any_hist = True
        self.count = index + 1
        return index

    def flush(self) -> None:
        """Reduce the staged segments (a few kernels per distinct shape); the copies are dropped afterwards."""
        if not self.groups:
            return
        blocks: list[torch.Tensor] = []
        lengths: list[int] = []
        order: list[int] = []
        for indices, copies in self.groups.values():
            block = torch.stack(copies) if len(copies) > 1 else copies[0].unsqueeze(0)
            blocks.append(block.reshape(-1))
            size = block[0].numel()
            lengths += [size] * len(copies)
            order += indices
        self.groups = {}
        data = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
        w = data if data.dtype == torch.float32 else data.float()
        mins, maxs, sums, nonzero = segment_extremes(w, tuple(lengths))  # NaN propagates through min and max
        self.results.append((mins, maxs, sums, nonzero))
        self.order += order
        if self.any_hist:
            bins = histogram_bins(w)
            wants = [self.wants_hist[i] for i in order]
            if not all(wants):
                wanted = torch.tensor(wants, device=w.device).repeat_interleave(torch.tensor(lengths, device=w.device))
                bins.masked_fill_(wanted.logical_not_(), HIST_BINS)
            total = self.histogram(w.device)
            total += torch.bincount(bins, minlength=HIST_BINS + 1)[:HIST_BINS]
        self.used = 0
        self.any_hist = False

    def statistics(self) -> Optional[Statistics]:
        """Every segment's (min, max, NaN-ignoring sum, nonzero count) in the order added, flushed first; None
        when none was staged."""
        self.flush()
        if not self.results:
            return None
        if len(self.results) > 1 or self.order != list(range(len(self.order))):
            merged = [torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*self.results)]
            position = [0] * len(self.order)
            for value, segment in enumerate(self.order):
                position[segment] = value
            back = torch.tensor(position, device=merged[0].device)
            self.results = [tuple(m.index_select(0, back) for m in merged)]  # type: ignore[list-item]
            self.order = list(range(len(position)))
        return self.results[0]
