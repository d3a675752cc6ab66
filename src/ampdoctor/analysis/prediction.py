"""Loss predictions from binade histograms of one backward: how many gradient values each module would lose to
zero at another power-of-two scale, without re-running it (the loss-scale window and the survey's own answers)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

import numpy as np

from ..records.histograms import BinadeHistograms, HistogramRows, sparse_block
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
        table = histograms if isinstance(histograms, BinadeHistograms) else _table(histograms)
        # The nonzero bins summed per owning module (and per low-precision gradient), sparse: a model of thousands
        # of modules would otherwise hold a row of 130 cumulative counts for each (10 MiB for 10,000 modules).
        index: dict[str, int] = {}
        groups = np.empty(len(table), dtype=np.int64)
        gradients = np.full(len(table), -1, dtype=np.int64)
        count = 0
        for i, name in enumerate(table.names):
            if name.startswith(GRADIENT_KEY):
                gradients[i] = count
                count += 1
                groups[i] = -1
            else:
                groups[i] = index.setdefault(owners.get(name, name), len(index))
        self._index = index
        self._owners = _Grouped(table.rows, groups)
        self._gradients = _Grouped(table.rows, gradients)
        self._total_gradients = float(self._gradients.sums.sum())

    def _column(self, exponent: int) -> int:
        """Bins below this one are lost at ``2**exponent``."""
        # Bin i holds binade k = HIST_LOW + i - 1; lost when k + 1 + (exponent - at) <= flush.
        return self.flush - (exponent - self.at) - HIST_LOW + 1

    def lost(self, exponent: int, module: Optional[str] = None) -> float:
        column = self._column(exponent)
        if module is None:
            return self._owners.below(column)
        row = self._index.get(module)
        return 0.0 if row is None else self._owners.below(column, row)

    def lowest_useful(self, counts: Mapping[str, int], top: int, share: float) -> dict[str, int]:
        """Per module of ``counts`` (its nonzero gradient values, > 0): the smallest exponent ``e <= top`` such
        that every scale ``2**k`` with ``e <= k < top`` is predicted to lose under ``share`` of them, walking
        down from ``top`` (all modules at once: a model of thousands of modules asks for each)."""
        names = list(counts)
        if top <= 0 or not names:
            return dict.fromkeys(names, max(top, 0))
        columns = np.asarray([self._column(k) for k in range(top - 1, -1, -1)])  # scales 2**(top-1) down to 1
        rows = np.asarray([self._index.get(m, -1) for m in names], dtype=np.int64)
        total = np.asarray([counts[m] for m in names], dtype=np.float64)
        keeps = self._owners.kept_columns(columns, rows, total, share)  # scales kept in a row, from the top down
        return {m: top - int(k) for m, k in zip(names, keeps)}

    def gradient_share(self, exponent: int) -> float:
        """The share of the low-precision gradients' nonzero values they would lose together (0 without any)."""
        if not self._total_gradients:
            return 0.0
        return self._gradients.below(self._column(exponent)) / self._total_gradients


class _Grouped:
    """Rows of histograms summed by group, sparse: per nonzero (group, bin), its group, bin and count (float64),
    sorted by group then bin. Counts below 2**53 sum exactly in any order."""

    __slots__ = ("group", "column", "sums")

    def __init__(self, rows: HistogramRows, groups: np.ndarray) -> None:
        # Small integer types and one sort: its scratch is a few bytes per stored bin (the survey's peak on a model
        # of 10,000 modules is reached here otherwise).
        owner = np.repeat(np.asarray(groups, dtype=np.int32), np.diff(rows.indptr))
        columns, counts = rows.columns, rows.counts
        kept = owner >= 0
        if not kept.all():
            owner, columns, counts = owner[kept], columns[kept], counts[kept]
        del kept
        width = rows.width
        keys = owner * np.int32(width)
        keys += columns
        del owner
        order = np.argsort(keys, kind="stable")
        keys = keys[order]
        starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1]))) if keys.size else order[:0]
        self.sums = np.add.reduceat(counts[order].astype(np.float64), starts) if keys.size else np.zeros(0)
        keys = keys[starts]
        self.group = (keys // width).astype(np.int32)
        self.column = (keys % width).astype(np.int16)

    def below(self, column: int, group: Optional[int] = None) -> float:
        """The counts in bins below ``column``: of one group, or of all."""
        if group is None:
            return float(self.sums[self.column < column].sum())
        start, end = np.searchsorted(self.group, (group, group + 1))
        return float(self.sums[start:end][self.column[start:end] < column].sum())

    def below_each(self, columns: np.ndarray, count: int) -> np.ndarray:
        """``(count, len(columns))``: per group, the counts in bins below each of ``columns`` (non-decreasing)."""
        first = np.searchsorted(columns, self.column, side="right")  # the first of columns above each bin
        width = len(columns) + 1
        added = np.bincount(self.group.astype(np.int64) * width + first, weights=self.sums, minlength=count * width)
        return np.cumsum(added.reshape(count, width), axis=1)[:, :-1]

    def kept_columns(self, columns: np.ndarray, groups: np.ndarray, total: np.ndarray, share: float) -> np.ndarray:
        """Per group of ``groups`` (-1: none of its bins stored), how many of ``columns`` (non-decreasing) in a row,
        from the first, have ``below(column, group) / total < share``: what a ``(len(groups), len(columns))``
        table of ``below`` would say, without one. The losses only grow along ``columns``, so the answer is where
        the running count of a group's bins first fails the test."""
        if not share > 0:  # nothing lost already fails
            return np.zeros(len(groups), dtype=np.int64)
        kept = np.full(len(groups), len(columns), dtype=np.int64)
        known = np.flatnonzero(groups >= 0)
        if not known.size or not self.sums.size:
            return kept
        running = np.cumsum(self.sums)  # exact: counts below 2**53
        size = max(int(self.group[-1]), int(groups.max())) + 1
        starts = np.searchsorted(self.group, np.arange(size + 1))
        before = np.concatenate(([0.0], running))[starts[:-1]]  # the running count before each group's first bin
        owner = self.group.astype(np.int64)
        of_group = np.full(size, np.nan)
        of_group[groups[known]] = total[known]
        asked = of_group[owner]
        fails = ~np.isnan(asked)  # a group not asked about never fails
        fails[fails] = (running[fails] - before[owner[fails]]) / asked[fails] >= share
        # A group's bins fail from some bin on: its first failing one follows a passing bin or another group's.
        head = fails.copy()
        head[1:] &= ~(fails[:-1] & (owner[1:] == owner[:-1]))
        first = np.full(size, -1, dtype=np.int64)
        first[owner[head]] = np.flatnonzero(head)
        at = first[groups[known]]
        failing = at >= 0
        kept[known[failing]] = np.searchsorted(columns, self.column[at[failing]], side="right")
        return kept


def _table(histograms: Histograms) -> BinadeHistograms:
    """Dense rows by name (of any lengths) as a sparse table."""
    rows = [np.asarray(row).reshape(1, -1) for row in histograms.values()]
    width = max((r.shape[1] for r in rows), default=0)
    return BinadeHistograms(list(histograms), HistogramRows.from_parts((sparse_block(r) for r in rows), width))
