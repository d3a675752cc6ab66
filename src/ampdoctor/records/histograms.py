"""Binade histograms of gradients (the loss-scale predictions' input), stored sparse.

A gradient's nonzero values span a few binades of the ~130 bins of a row (``capture.staging.HIST_BINS``): a
``Linear(4, 4)`` weight's 16 values fill at most 16 bins. Kept as one list of 130 ints per parameter, a model of
20,000 parameters held 10 MiB of them through its whole diagnosis (and several dense copies while they were read
back); here a row keeps only its nonzero bins, in three arrays for all rows together (compressed sparse rows:
``indptr``, ``columns``, ``counts``). A row read by name or index comes back as the dense list of ints it always
was; sums over many rows never build one.

No torch here: a capture makes them from its device's counts, analysis reads them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Optional

import numpy as np

_EMPTY_INDPTR = np.zeros(1, dtype=np.int64)


class HistogramRows:
    """Rows of ``width`` counts each, only the nonzero ones stored: row ``i``'s bins are
    ``columns[indptr[i]:indptr[i + 1]]`` (increasing) with ``counts`` at the same places."""

    __slots__ = ("indptr", "columns", "counts", "width")

    def __init__(self, indptr: np.ndarray, columns: np.ndarray, counts: np.ndarray, width: int) -> None:
        self.indptr = indptr
        self.columns = columns
        self.counts = counts
        self.width = width

    @classmethod
    def empty(cls, width: int) -> HistogramRows:
        return cls(_EMPTY_INDPTR, np.zeros(0, dtype=np.int16), np.zeros(0, dtype=np.int64), width)

    @classmethod
    def from_parts(cls, parts: Iterable[SparseBlock], width: int) -> HistogramRows:
        """The rows of consecutive blocks (:func:`sparse_block`), in order."""
        per_row, columns, counts = [], [], []
        for lengths, cols, values in parts:
            per_row.append(lengths)
            columns.append(cols)
            counts.append(values)
        if not per_row:
            return cls.empty(width)
        indptr = np.zeros(sum(len(p) for p in per_row) + 1, dtype=np.int64)
        np.cumsum(np.concatenate(per_row), out=indptr[1:])
        values = np.concatenate(counts)
        if values.size and int(values.max()) < 2**31:  # counts of elements: int32 unless a tensor is that large
            values = values.astype(np.int32)
        return cls(indptr, np.concatenate(columns), values, width)

    @classmethod
    def from_dense(cls, blocks: Iterable[np.ndarray], width: int) -> HistogramRows:
        """The rows of dense 2-D blocks (``width`` columns each), in order."""
        return cls.from_parts((sparse_block(b) for b in blocks), width)

    def __len__(self) -> int:
        return len(self.indptr) - 1

    def as_block(self) -> SparseBlock:
        """All rows as one block (:func:`sparse_block`'s form), to join with others (``from_parts``)."""
        return np.diff(self.indptr), self.columns, self.counts.astype(np.int64, copy=False)

    def dense(self, row: int) -> np.ndarray:
        """Row ``row`` as a dense int64 array of ``width`` counts."""
        if not 0 <= row < len(self):
            raise IndexError(f"histogram row {row} out of range (0..{len(self) - 1})")
        out = np.zeros(self.width, dtype=np.int64)
        start, end = self.indptr[row], self.indptr[row + 1]
        out[self.columns[start:end]] = self.counts[start:end]
        return out

    def __getitem__(self, row: int) -> list[int]:
        """Row ``row`` as the dense list of ints (``width`` of them) a histogram was before it was stored sparse."""
        return self.dense(row).tolist()  # type: ignore[no-any-return]

    def take(self, rows: Sequence[int]) -> HistogramRows:
        """These rows, in this order (a row may come twice)."""
        picked = np.asarray(rows, dtype=np.int64)
        if not picked.size:
            return HistogramRows.empty(self.width)
        starts, ends = self.indptr[picked], self.indptr[picked + 1]
        lengths = ends - starts
        indptr = np.zeros(len(picked) + 1, dtype=np.int64)
        np.cumsum(lengths, out=indptr[1:])
        # every stored element of the picked rows, in their new order
        where = np.repeat(starts - indptr[:-1], lengths) + np.arange(indptr[-1], dtype=np.int64)
        return HistogramRows(indptr, self.columns[where], self.counts[where], self.width)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HistogramRows):
            return NotImplemented
        return (
            self.width == other.width
            and np.array_equal(self.indptr, other.indptr)
            and np.array_equal(self.columns, other.columns)
            and np.array_equal(self.counts, other.counts)
        )

    __hash__ = None  # type: ignore[assignment]

    @property
    def nbytes(self) -> int:
        return int(self.indptr.nbytes + self.columns.nbytes + self.counts.nbytes)


# A block's rows, sparse: nonzero bins per row, their columns and their counts (all rows of the block in order).
SparseBlock = tuple[np.ndarray, np.ndarray, np.ndarray]


def sparse_block(block: np.ndarray) -> SparseBlock:
    """The nonzero bins of a dense 2-D block of counts (any layout, any integer or exact float dtype)."""
    rows, cols = np.nonzero(block)
    values = block[rows, cols]
    if values.dtype != np.int64:
        values = values.astype(np.int64)
    return np.bincount(rows, minlength=block.shape[0]), cols.astype(np.int16), values


class BinadeHistograms(Mapping[str, list[int]]):
    """Binade histograms by name (a parameter's name, or ``GRADIENT_KEY`` for the summed low-precision gradients),
    as a read-only mapping of dense rows over :class:`HistogramRows`."""

    __slots__ = ("names", "rows", "_index")

    def __init__(self, names: Sequence[str], rows: HistogramRows) -> None:
        if len(names) != len(rows):
            raise ValueError(f"{len(names)} histogram names for {len(rows)} rows")
        self.names = tuple(names)
        self.rows = rows
        self._index: Optional[dict[str, int]] = None  # built on the first lookup by name

    @classmethod
    def empty(cls, width: int) -> BinadeHistograms:
        return cls((), HistogramRows.empty(width))

    def _lookup(self) -> dict[str, int]:
        if self._index is None:
            self._index = {name: i for i, name in enumerate(self.names)}
        return self._index

    def __getitem__(self, name: str) -> list[int]:
        return self.rows[self._lookup()[name]]

    def __contains__(self, name: object) -> bool:
        return name in self._lookup()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"BinadeHistograms({len(self)} rows, {self.rows.nbytes} bytes)"
