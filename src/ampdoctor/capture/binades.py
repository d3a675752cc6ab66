"""Binade histograms of gradients (the loss-scale predictions' input): one tensor's, computed on its device, and
the rows a pass queues, kept sparse on the host (:class:`~ampdoctor.records.histograms.HistogramRows`).

Layout (``HIST_BINS``, from .staging): bin ``1 + k - HIST_LOW`` counts binade ``2**k`` for
``HIST_LOW <= k < HIST_HIGH``; bin 0 everything nonzero below ``2**HIST_LOW``, the last bin everything finite
above.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Optional, Union

import numpy as np
import torch

from ..records.histograms import BinadeHistograms, HistogramRows, SparseBlock, sparse_block
from ..thresholds import HIST_HIGH, HIST_LOW
from .reductions import chunks
from .staging import HIST_BINS

# Histograms of large tensors go chunk by chunk in pieces this small (their scratch stays in the cache).
HIST_CHUNK = 1 << 16


def binade_histogram(tensor: torch.Tensor) -> torch.Tensor:
    """The binade histogram (int64, ``HIST_BINS``) of ``tensor``'s nonzero finite values, on its device: a
    bincount of the float32 exponent field, chunk by chunk (four kernels a chunk), folded into ``HIST_BINS`` at
    the end."""
    x = tensor.detach()
    total: Optional[torch.Tensor] = None
    for c in chunks(x, HIST_CHUNK):
        w = c.float() if c.dtype != torch.float32 else c  # float64 magnitudes beyond float32 go to the ends
        exponent = (w.view(torch.int32) >> 23).bitwise_and_(0xFF)  # 0: zero/subnormal, 255: inf/NaN
        part = torch.bincount(exponent.reshape(-1), minlength=256)
        total = part if total is None else total.add_(part)
    assert total is not None
    # Binade 2**k is biased exponent k + 127. Exponent 0 holds the zeros (dropped here) and float32 subnormals
    # (and float64 values too small for float32), which belong to the bottom bin; 255 holds inf and NaN.
    low, high = HIST_LOW + 127, HIST_HIGH + 127
    zeros = x.numel() - torch.count_nonzero(x)
    below = total[1:low].sum() + total[0] - zeros
    return torch.cat((below.reshape(1), total[low:high], total[high:255].sum().reshape(1)))


class RowQueue:
    """Histogram rows queued during a pass, in order, by blocks: a CPU block is made sparse at once (its dense
    counts go: a pass never holds every row densely), a block on another device waits for the pass's one
    readback (:meth:`waiting`, then :meth:`rows` with the host copies)."""

    __slots__ = ("blocks", "count")

    def __init__(self) -> None:
        self.blocks: list[Union[SparseBlock, torch.Tensor]] = []
        self.count = 0

    def add(self, rows: torch.Tensor) -> int:
        """Queue a block of rows (``(n, HIST_BINS)`` counts); returns the index of its first row."""
        self.blocks.append(sparse_block(rows.numpy()) if rows.device.type == "cpu" else rows)
        first = self.count
        self.count = first + rows.shape[0]
        return first

    def waiting(self) -> list[torch.Tensor]:
        """The blocks still on their device, in order (read back together, per device)."""
        return [b for b in self.blocks if isinstance(b, torch.Tensor)]

    def rows(self, host: Mapping[torch.device, np.ndarray]) -> HistogramRows:
        """Every row in order; ``host``: per device, the dense host copy of its :meth:`waiting` blocks stacked."""
        return HistogramRows.from_parts(self._sparse(host), HIST_BINS)

    def _sparse(self, host: Mapping[torch.device, np.ndarray]) -> Iterator[SparseBlock]:
        taken: dict[torch.device, int] = {}
        for block in self.blocks:
            if not isinstance(block, torch.Tensor):
                yield block
                continue
            first = taken.get(block.device, 0)
            taken[block.device] = first + block.shape[0]
            yield sparse_block(host[block.device][first : first + block.shape[0]])


def named_histograms(
    table: HistogramRows, rows: Iterable[tuple[str, int]], total: Optional[str], gradient_total: Optional[list[int]]
) -> BinadeHistograms:
    """The rows of ``table`` named by ``rows`` ((name, index) pairs; a name given twice keeps its first place and
    its last row, as a dict would), and ``gradient_total`` under ``total`` when both are given. Nothing dense is
    built."""
    chosen: dict[str, int] = {}
    for name, index in rows:
        chosen[name] = index
    if total is not None and gradient_total is not None:
        chosen[total] = len(table)  # one more row, after all the others
        extra = sparse_block(np.asarray([gradient_total], dtype=np.int64))
        table = HistogramRows.from_parts([table.as_block(), extra], HIST_BINS)
    return BinadeHistograms(list(chosen), table.take(list(chosen.values())))
