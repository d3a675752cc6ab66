"""The slots of a :class:`~ampdoctor.capture.stats.StatsCollector`: what each measured tensor was (dtype name,
shape) and where its numbers wait for the readback, kept column by column.

A pass on a model of 10,000 modules fills 80,000 slots. One tuple per slot (six fields, its index an int object
of its own) held about 120 bytes each until the readback, at the pass's peak; here a slot is three pointers to
shared objects (the dtype name, one tuple per distinct shape, the owner of its numbers), an 8-byte index and a
1-byte level: about 33 bytes.
"""

from __future__ import annotations

import math
from array import array
from typing import Any

from ..records import TensorStats, survey_stats
from .reductions import behind_nan, detailed_record


class SlotTable:
    """Per slot: dtype name, shape, ``where`` its numbers are (a device, a Stage, a batch of Segments; None: not
    measured), its index there and its level (0: min/max, 1: min/max and zeros, 2: detailed; 3 and 4: 0 and 1,
    staged); level 1's zero counts have an index of their own (``zindex``)."""

    __slots__ = ("names", "shapes", "wheres", "indices", "levels", "zindex", "_shapes")

    def __init__(self) -> None:
        self.names: list[str] = []
        self.shapes: list[tuple[int, ...]] = []
        self.wheres: list[Any] = []
        self.indices = array("q")
        self.levels = bytearray()
        self.zindex: dict[int, int] = {}  # slot -> index of its nonzero count (level 1 only)
        # One tuple per distinct shape, shared by every slot and record of that shape (a model of many small
        # modules has a handful of shapes for its hundred thousand tensors).
        self._shapes: dict[tuple[int, ...], tuple[int, ...]] = {}

    def add(self, name: str, size: tuple[int, ...], where: Any, index: int, level: int) -> int:
        """A new slot; returns its number. ``size``: the tensor's shape (a ``torch.Size`` will do)."""
        shape = self._shapes.get(size)
        if shape is None:
            shape = self._shapes[size] = tuple(size)
        self.names.append(name)
        self.shapes.append(shape)
        self.wheres.append(where)
        self.indices.append(index)
        self.levels.append(level)
        return len(self.levels) - 1

    def __len__(self) -> int:
        return len(self.levels)

    def nbytes(self, slot: int, itemsize: dict[str, int]) -> int:
        return math.prod(self.shapes[slot]) * itemsize.get(self.names[slot], 4)

    def records(self, host: dict[Any, dict[str, Any]]) -> list[TensorStats]:
        """The record of every slot, in order, from the numbers read back (``host``: per owner, by statistic)."""
        records: list[TensorStats] = []
        append = records.append
        prod = math.prod
        zindex = self.zindex
        for slot, (name, shape, where, index, level) in enumerate(
            zip(self.names, self.shapes, self.wheres, self.indices, self.levels)
        ):
            if where is None:
                append(TensorStats(name, shape))
                continue
            data = host[where]
            if level == 2:
                append(detailed_record(name, shape, data["counts"][index], data["extremes"][index]))
                continue
            low, high = data["min"][index], data["max"][index]
            if high != high or low != low:  # NaN: an inf behind it shows in the NaN-ignoring sum
                low, high = behind_nan(low, high, data["nansum"][index])
            if level == 1:
                append(survey_stats(name, shape, low, high, prod(shape) - int(data["zero_count"][zindex[slot]])))
            elif level == 4:  # staged, zeros counted
                append(survey_stats(name, shape, low, high, prod(shape) - int(data["zero_count"][index])))
            else:  # the common case, kept lean: a record per tensor of every pass
                append(survey_stats(name, shape, low, high))
        return records
