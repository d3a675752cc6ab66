"""Loss predictions from binade histograms of one backward: how many gradient values each module would lose to
zero at another power-of-two scale, without re-running it (the loss-scale window and the survey's own answers)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Optional

import numpy as np

from ..thresholds import GRADIENT_KEY, HIST_LOW

# Binade histograms of gradients (layout: capture.stats.StatsCollector.add_histogram): by parameter name, and under
# GRADIENT_KEY the sum of those of the gradients held in the low precision (the calls' output gradients).
Histograms = Mapping[str, Sequence[float]]


class LossPrediction:
    """From binade histograms of a backward at ``2**at_exponent``: how many values each module would lose to zero
    at another power-of-two scale (a value is lost once its whole binade lies at or below the flush threshold;
    bin 0 holds everything below ``2**HIST_LOW``, the last bin everything from ``2**HIST_HIGH`` up)."""

    def __init__(self, histograms: Histograms, at_exponent: int, flush_exponent: int, owners: Mapping[str, str]):
        self.at = at_exponent
        self.flush = flush_exponent
        # One row of cumulative counts per owning module (and per low-precision gradient), as arrays: a model of
        # thousands of modules would otherwise hold 130 Python floats per parameter and per module.
        gradients = [hist for name, hist in histograms.items() if name.startswith(GRADIENT_KEY)]
        self._gradients = _prefixes(gradients, list(range(len(gradients))), len(gradients))
        index: dict[str, int] = {}
        rows, groups = [], []
        for name, hist in histograms.items():
            if not name.startswith(GRADIENT_KEY):
                rows.append(hist)
                groups.append(index.setdefault(owners.get(name, name), len(index)))
        self._index = index
        self._prefix = _prefixes(rows, groups, len(index))
        self._total_gradients = float(self._gradients[:, -1].sum())

    def _column(self, exponent: int, width: int) -> int:
        # Bin i holds binade k = HIST_LOW + i - 1; lost when k + 1 + (exponent - at) <= flush.
        last = self.flush - (exponent - self.at) - HIST_LOW
        return max(0, min(width - 1, last + 1))

    def lost(self, exponent: int, module: Optional[str] = None) -> float:
        column = self._column(exponent, self._prefix.shape[1])
        if module is None:
            return float(self._prefix[:, column].sum())
        row = self._index.get(module)
        return 0.0 if row is None else float(self._prefix[row, column])

    def lowest_useful(self, counts: Mapping[str, int], top: int, share: float) -> dict[str, int]:
        """Per module of ``counts`` (its nonzero gradient values, > 0): the smallest exponent ``e <= top`` such
        that every scale ``2**k`` with ``e <= k < top`` is predicted to lose under ``share`` of them, walking
        down from ``top`` (all modules at once: a model of thousands of modules asks for each)."""
        names = list(counts)
        if top <= 0 or not names:
            return dict.fromkeys(names, max(top, 0))
        width = self._prefix.shape[1]
        columns = [self._column(k, width) for k in range(top - 1, -1, -1)]  # scales 2**(top-1) down to 1
        lost = np.zeros((len(names), len(columns)))
        known = [(i, self._index[m]) for i, m in enumerate(names) if m in self._index]
        if known:
            at, rows = zip(*known)
            lost[list(at)] = self._prefix[np.ix_(list(rows), columns)]
        total = np.asarray([counts[m] for m in names], dtype=np.float64)[:, None]
        keeps = np.cumprod(lost / total < share, axis=1).sum(axis=1)  # scales kept in a row, from the top down
        return {m: top - int(k) for m, k in zip(names, keeps)}

    def gradient_share(self, exponent: int) -> float:
        """The share of the low-precision gradients' nonzero values they would lose together (0 without any)."""
        if not self._total_gradients:
            return 0.0
        column = self._column(exponent, self._gradients.shape[1])
        return float(self._gradients[:, column].sum()) / self._total_gradients


# Rows converted to one array at a time when summing histograms: a block's float64 copy stays near 1 MiB however
# many parameters the model has (a whole matrix of ten thousand 130-bin rows doubled the survey's peak).
_BLOCK_ROWS = 1024


def _prefixes(rows: Sequence[Sequence[float]], groups: Sequence[int], count: int) -> np.ndarray:
    """Cumulative counts (a leading 0) of the rows summed by group: one row per group."""
    width = max((len(r) for r in rows), default=0)
    out = np.zeros((count, width + 1), dtype=np.float64)
    summed = out[:, 1:]
    if rows and all(len(r) == width for r in rows):
        # Per block: a flat read of its numbers (not a nested conversion), summed per group by one reduceat over
        # its rows in group order. Counts below 2**53 sum exactly in any order.
        keys = np.asarray(groups, dtype=np.int64)
        for first in range(0, len(rows), _BLOCK_ROWS):
            part = rows[first : first + _BLOCK_ROWS]
            if isinstance(part[0], np.ndarray):
                block = np.asarray(part, dtype=np.float64)
            else:
                flat = itertools.chain.from_iterable(part)
                block = np.fromiter(flat, dtype=np.float64, count=len(part) * width).reshape(len(part), width)
            part_keys = keys[first : first + _BLOCK_ROWS]
            order = np.argsort(part_keys, kind="stable")
            ordered = part_keys[order]
            starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
            summed[ordered[starts]] += np.add.reduceat(block[order], starts, axis=0)
    else:
        for group, row in zip(groups, rows):
            summed[group, : len(row)] += np.asarray(row, dtype=np.float64)
    np.cumsum(summed, axis=1, out=summed)
    return out
