"""Tensor statistics computed on the tensor's own device and read back once per pass.

Each statistic is kept as a small tensor on the device; :meth:`StatsCollector.read` stacks them and copies
them to the host in a single transfer per device, so a pass costs one host synchronisation, not one per
tensor or per statistic. No reference to a measured tensor is kept.

Cost: the survey level is one ``aminmax`` and one ``count_nonzero`` per tensor (no temporaries). The detailed
level reads a tensor in chunks (:func:`chunk_size`), so its temporaries stay small however large the tensor
(a 175 MiB embedding weight costs a few MiB of scratch, not five full-size copies).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from typing import Any, Optional

import torch

from ..records import TensorStats
from ..records.histograms import BinadeHistograms, HistogramRows
from .binades import HIST_CHUNK as HIST_CHUNK
from .binades import RowQueue, binade_histogram, named_histograms
from .dtypes import dtype_name
from .internal import INTERNAL as INTERNAL  # re-exported: where capture's users have always found it
from .internal import Internal as Internal
from .internal import _internal
from .internal import measuring as measuring
from .reductions import CHUNK as CHUNK
from .reductions import CHUNK_MAX as CHUNK_MAX
from .reductions import _nansum32, format_limits, segment_extremes, segment_ids, shared_float
from .reductions import chunk_size as chunk_size
from .reductions import chunks as chunks
from .slot_table import SlotTable
from .staging import HIST_BINS, STAGE_EACH, STAGED_DEVICES, STAGED_DTYPES, Segments, Stage, histogram_bins

# Statistic names in the order records list them. The survey level takes one fused min/max and a zero count.
SURVEY_FIELDS = ("min", "max", "zero_count")
DETAIL_FIELDS = SURVEY_FIELDS + (
    "nan_count",
    "posinf_count",
    "neginf_count",
    "finite_min",
    "finite_max",
    "min_abs_nonzero",
    "subnormal_count",
    "cast_overflow_count",
    "cast_flush_count",
)
# Histograms of large tensors go chunk by chunk in pieces this small (their scratch stays in the cache), and
# tensors up to this size are histogrammed together (``add_many``).
BATCH_EACH = 1 << 16
# Histograms of this many small tensors at most are computed together (their scratch: HIST_BINS counts each).
HIST_GROUP = 1024
# Counts computed per chunk by _detail_chunk, in this order; then finite_min, finite_max, min_abs_nonzero.
_COUNTS = ("nonzero", "nan", "posinf", "neginf", "below_tiny", "at_or_below_flush", "at_or_above_overflow")
_DIRECT = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_NAMES = {dtype: dtype_name(dtype) for dtype in _DIRECT}


class StatsCollector:
    """Collects statistics of many tensors during a pass; ``read()`` returns them all at once.

    ``add`` returns a slot number; the same tensor object at the same version is measured once.
    """

    def __init__(self, low_dtype: torch.dtype, detailed: bool, zeros: bool = True) -> None:
        self.low_dtype = low_dtype
        self.detailed = detailed
        self.zeros = zeros  # the survey level counts zeros (False: min and max only, the cheapest record)
        self._limits = format_limits(low_dtype)
        # Per slot: (dtype name, shape, device or its Stage, or None when not measured, index in its lists, level,
        # zero index); level 0: min/max, 1: min/max and zeros, 2: detailed; 3 and 4: 0 and 1, staged.
        self._slots = SlotTable()  # what each slot measured and where its numbers wait
        self._read_slots = 0  # slots whose records read() returned (their bookkeeping is gone)
        self._stages: dict[tuple[torch.device, torch.dtype], Stage] = {}
        self._cpu_stages: dict[torch.dtype, Stage] = {}  # the same CPU stages, by dtype only (the hot path)
        # The running binade histogram of every gradient given to add_gradient_histogram, per device.
        self._gradient_hist: dict[torch.device, torch.Tensor] = {}
        self.gradient_histogram: Optional[list[int]] = None  # their sum, after read() (None: none given)
        # Per device: min, max, nonzero counts, and NaN-ignoring sums (which tell an inf behind a NaN min/max).
        self._survey: dict[
            torch.device, tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]
        ] = {}
        self._details: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._hist_rows = RowQueue()  # add_histogram's rows
        self._batches: list[Segments] = []  # add_many's small tensors, reduced together
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int, int, int]] = {}
        self._value_groups: list[tuple[torch.device, int, int]] = []
        self._values: dict[torch.device, list[torch.Tensor]] = {}
        self._vectors: dict[torch.device, list[torch.Tensor]] = {}
        self._vector_slots: list[tuple[torch.device, int, int]] = []
        self.vectors: list[list[float]] = []  # in add_vector order, after read()
        self.values: list[list[float]] = []
        # Counts in add_histogram order (row i: a list of HIST_BINS ints), stored sparse, after read()
        self.histograms = HistogramRows.empty(HIST_BINS)
        self.readbacks = 0

    def add(self, tensor: torch.Tensor, detailed: Optional[bool] = None) -> int:
        level = 2 if (self.detailed if detailed is None else detailed) else int(self.zeros)
        key = id(tensor)
        seen = self._seen.get(key)
        version = tensor._version
        if seen is not None and seen[1] == version and seen[2] == level and seen[0]() is tensor:
            return seen[3]
        _internal.depth = getattr(_internal, "depth", 0) + 1
        try:
            slot = self._measure(tensor.detach() if tensor.requires_grad else tensor, level)
        finally:
            _internal.depth -= 1
        try:
            self._seen[key] = (weakref.ref(tensor), version, level, slot)
        except TypeError:  # a tensor subclass without weakref support: measure again next time
            pass
        return slot

    def add_if_staged(self, tensor: torch.Tensor) -> int:
        """``add`` at the survey level when that is this collector's level and ``tensor`` is one it stages (small,
        on the CPU); -1 otherwise (nothing measured). A hook that adds the same tensor later finds its slot."""
        if self.detailed or not tensor.is_cpu or tensor.layout is not torch.strided:
            return -1
        dtype = tensor.dtype
        if dtype not in STAGED_DTYPES or not 0 < tensor.numel() <= STAGE_EACH:
            return -1
        # ``add`` written out for this one case (every op of a watched forward comes here).
        level = int(self.zeros)
        key = id(tensor)
        seen = self._seen.get(key)
        version = tensor._version
        if seen is not None and seen[1] == version and seen[2] == level and seen[0]() is tensor:
            return seen[3]
        stage = self._cpu_stages.get(dtype)
        if stage is None:
            stage = self._stages[(tensor.device, dtype)] = self._cpu_stages[dtype] = Stage(
                dtype, tensor.device, self._gradient_total)
        depth = getattr(_internal, "depth", 0)
        _internal.depth = depth + 1
        try:
            index = stage.add(tensor.detach() if tensor.requires_grad else tensor)
        finally:
            _internal.depth = depth
        slot = self._slots.add(_NAMES[dtype], tensor.shape, stage, index, level + 3)
        try:
            self._seen[key] = (weakref.ref(tensor), version, level, slot)
        except TypeError:  # a tensor subclass without weakref support: measure again next time
            pass
        return slot

    def add_fresh(self, tensor: torch.Tensor, histogram: bool = False) -> int:
        """``add`` for a tensor made just now and seen once (a gradient in a hook): no lookup of earlier slots.
        ``histogram``: also add its binade histogram to :attr:`gradient_histogram` (:meth:`add_gradient_histogram`)."""
        depth = getattr(_internal, "depth", 0)
        _internal.depth = depth + 1
        try:
            x = tensor.detach() if tensor.requires_grad else tensor
            dtype = x.dtype
            if (not self.detailed and x.is_cpu and dtype in STAGED_DTYPES and 0 < x.numel() <= STAGE_EACH
                    and x.layout is torch.strided):
                # _measure's staged case written out (every module output's gradient in a backward comes here)
                stage = self._cpu_stages.get(dtype)
                if stage is not None:
                    return self._slots.add(_NAMES[dtype], x.shape, stage, stage.add(x, histogram), int(self.zeros) + 3)
            return self._measure(x, 2 if self.detailed else int(self.zeros), histogram)
        finally:
            _internal.depth = depth

    def _measure(self, x: torch.Tensor, level: int, histogram: bool = False) -> int:
        if x.layout is not torch.strided:
            x = measurable(x)
        dtype = x.dtype
        numel = x.numel()
        # The common case first (a small CPU tensor at the survey level: staged), with no more lookups than it needs.
        if level < 2 and 0 < numel <= STAGE_EACH and x.is_cpu and dtype in STAGED_DTYPES:
            stage = self._cpu_stages.get(dtype)
            if stage is None:
                stage = self._stages[(x.device, dtype)] = self._cpu_stages[dtype] = Stage(
                    dtype, x.device, self._gradient_total)
            return self._slots.add(_NAMES[dtype], x.shape, stage, stage.add(x, histogram), level + 3)
        shape = x.shape
        name = _NAMES.get(dtype) or dtype_name(dtype)
        if dtype not in _DIRECT and (not x.is_floating_point() or x.is_complex()) or numel == 0:
            return self._slots.add(name, shape, None, -1, 0)
        device = x.device
        if level < 2 and numel <= STAGE_EACH and dtype in STAGED_DTYPES and device.type in STAGED_DEVICES:
            stage = self._stages.get((device, dtype))
            if stage is None:
                stage = self._stages[(device, dtype)] = Stage(dtype, device, self._gradient_total)
            return self._slots.add(name, shape, stage, stage.add(x, histogram), level + 3)
        if histogram:
            self.add_gradient_histogram(x)
        zindex = -1
        if level == 2:
            counts, extremes = self._detail(x)
            lists = self._details.get(device)
            if lists is None:
                lists = self._details[device] = ([], [])
            lists[0].append(counts)
            lists[1].append(extremes)
            index = len(lists[0]) - 1
        else:
            w = x if dtype in _DIRECT else x.float()  # float8: few kernels support it; exact in float32
            low, high = torch.aminmax(w)  # one pass; NaN and inf show up in the result
            survey = self._survey.get(device)
            if survey is None:
                survey = self._survey[device] = ([], [], [], [])
            survey[0].append(low)
            survey[1].append(high)
            # A NaN hides any inf from aminmax: the NaN-ignoring sum is infinite (or NaN, for +inf and -inf)
            # exactly when an inf is there, so the pass that saw an overflow can say so without a detailed re-run.
            survey[3].append(_nansum32(w))
            index = len(survey[0]) - 1
            if level == 1:  # stored as a nonzero count, turned into a zero count in read()
                survey[2].append(torch.count_nonzero(w))
                zindex = len(survey[2]) - 1
        slot = self._slots.add(name, shape, device, index, level)
        if zindex >= 0:
            self._slots.zindex[slot] = zindex
        return slot

    # -- the detailed level, chunk by chunk ---------------------------------------------------------------------
    def _detail(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Counts (int64, in ``_COUNTS`` order) and (finite_min, finite_max, min_abs_nonzero) of ``x``."""
        parts = [self._detail_chunk(c) for c in chunks(x, chunk_size(x.numel()))]
        if len(parts) == 1:
            return parts[0]
        counts = torch.stack([p[0] for p in parts]).sum(0)
        extremes = torch.stack([p[1] for p in parts])
        return counts, torch.stack((extremes[:, 0].amin(), extremes[:, 1].amax(), extremes[:, 2].amin()))

    def _detail_chunk(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # float16/bfloat16/float8 values are exact in float32, where the low format's edges are exact too; the
        # comparisons with the exact single-rounding edges then count what a cast to the low format does.
        w = c if c.dtype in (torch.float32, torch.float64) else c.float()
        inf = math.inf
        limits = self._limits
        a = w.abs()
        count = torch.count_nonzero  # (a bool tensor's sum() converts every element to int64 first: slower)
        counts = torch.stack(
            (
                count(w),
                count(torch.isnan(w)),
                count(w == inf),
                count(w == -inf),
                count(a < limits.tiny),  # zeros included (subtracted in read); NaN compares false
                count(a <= limits.flush_threshold),  # zeros included
                count(a >= limits.overflow_threshold),  # infinities included
            )
        )
        extremes = torch.stack(
            (
                torch.nan_to_num(w, nan=inf, posinf=inf, neginf=inf).amin(),
                torch.nan_to_num(w, nan=-inf, posinf=-inf, neginf=-inf).amax(),
                torch.where(a > 0, a, inf).amin(),  # NaN compares false: never the smallest magnitude
            )
        )
        return counts, extremes

    # -- gradient histograms ------------------------------------------------------------------------------------
    def add_histogram(self, tensor: torch.Tensor) -> int:
        """Queue the binade histogram of ``tensor``'s nonzero finite values (layout: ``HIST_BINS``), read back with
        everything else into ``histograms``; returns its index there."""
        return self._hist_rows.add(binade_histogram(tensor).reshape(1, HIST_BINS))

    def add_gradient_histogram(self, tensor: torch.Tensor) -> None:
        """Add the binade histogram of ``tensor`` to the running total :attr:`gradient_histogram` (after read()):
        what the loss-scale predictions read of the activations' gradients is their sum, so no histogram per
        gradient is kept or read back."""
        total = self._gradient_total(tensor.device)
        total += binade_histogram(tensor)

    def _gradient_total(self, device: torch.device) -> torch.Tensor:
        total = self._gradient_hist.get(device)
        if total is None:
            total = self._gradient_hist[device] = torch.zeros(HIST_BINS, dtype=torch.int64, device=device)
        return total

    def add_many(self, tensors: list[torch.Tensor], histograms: bool) -> list[tuple[int, int]]:
        """Survey-level slots (zeros counted) of many tensors that need no gradient, and their binade histograms
        (-1 when not asked); the small ones computed together over their concatenation (``_batch``), at most
        ``HIST_GROUP`` at a time when histograms are asked for (their scratch is ``HIST_BINS`` counts each)."""
        batchable = [t for t in tensors if t.dtype in _BATCHABLE and 0 < t.numel() <= BATCH_EACH
                     and t.layout is torch.strided]
        if len(batchable) < 2:
            return [
                (self._measure(t.detach(), 1), self.add_histogram(t) if histograms and _histogrammable(t) else -1)
                for t in tensors
            ]
        batchable.sort(key=lambda t: t.numel())  # equal sizes side by side: one reduction per size
        group = HIST_GROUP if histograms else len(batchable)
        where: dict[int, tuple[Segments, int, int]] = {}
        for start in range(0, len(batchable), group):
            part = batchable[start : start + group]
            segments, rows = self._batch(part, histograms)
            self._batches.append(segments)
            first = self._hist_rows.add(rows) if rows is not None else -1
            where.update((id(t), (segments, i, first + i if rows is not None else -1)) for i, t in enumerate(part))
        out = []
        for t in tensors:
            found = where.get(id(t))
            if found is None:
                hist = self.add_histogram(t) if histograms and _histogrammable(t) else -1
                out.append((self._measure(t.detach(), 1), hist))
                continue
            segments, i, hist = found
            out.append((self._slots.add(_NAMES.get(t.dtype) or dtype_name(t.dtype), t.shape, segments, i, 4), hist))
        return out

    @staticmethod
    def _batch(tensors: list[torch.Tensor], histograms: bool = True) -> tuple[Segments, Optional[torch.Tensor]]:
        """(min, max, NaN-ignoring sum, nonzero count) of small same-device tensors sorted by size, one value each
        in their order, from their concatenation (float32): per run of equal sizes one amin, amax, nansum and
        count_nonzero; and their histogram rows (when ``histograms``: one bincount of every element's (tensor,
        bin) for all)."""
        with torch.no_grad():
            flat = torch.cat([t.reshape(-1) for t in tensors])  # promotes to float32 when mixed
            if flat.dtype != torch.float32:
                flat = flat.float()
            lengths = tuple(t.numel() for t in tensors)
            segments = Segments(flat.device, segment_extremes(flat, lengths))
            if not histograms:
                return segments, None
            width = HIST_BINS + 1  # the last column: zeros, infinities and NaN, dropped
            index = histogram_bins(flat).add_(segment_ids(lengths, flat.device) * width)
            hists = torch.bincount(index, minlength=width * len(tensors)).view(len(tensors), width)[:, :HIST_BINS]
            return segments, hists

    def add_values(self, values: list[torch.Tensor]) -> int:
        """Queue a group of 0-d tensors (same device) for the same single readback; see ``values``."""
        device = values[0].device
        queued = self._values.setdefault(device, [])
        self._value_groups.append((device, len(queued), len(values)))
        queued.extend(values)
        return len(self._value_groups) - 1

    def add_vector(self, vector: torch.Tensor) -> int:
        """Queue a 1-D tensor of numbers (any dtype; float64 keeps them exact) for the same single readback; its
        values are ``self.vectors[index]`` afterwards. Many values in one tensor cost one conversion, not one each."""
        queued = self._vectors.setdefault(vector.device, [])
        start = sum(v.numel() for v in queued)
        queued.append(vector.reshape(-1))
        self._vector_slots.append((vector.device, start, vector.numel()))
        return len(self._vector_slots) - 1

    # -- the one readback ---------------------------------------------------------------------------------------
    def read(self) -> list[TensorStats]:
        """Copy every statistic to the host (one transfer per device) and build the records.

        Groups queued with ``add_values`` are in ``self.values`` afterwards, in the order they were added, and
        histograms queued with ``add_histogram`` in ``self.histograms``.
        """
        # Staged tensors (flushed now: a few kernels each) and add_many's batches: one value per tensor in 1-D.
        stages: dict[Any, Any] = {stage: stage.statistics() for stage in self._stages.values()}
        stages.update((batch, batch.statistics()) for batch in self._batches)
        waiting = self._hist_rows.waiting()  # histogram rows still on their device (not the CPU)
        devices = {*self._survey, *self._details, *self._values, *(b.device for b in waiting), *self._vectors,
                   *self._gradient_hist, *(owner.device for owner in stages)}
        host: dict[Any, dict[str, Any]] = {}
        floats: dict[float, float] = {}
        shared = shared_float
        for device in devices:
            # Mixed dtypes promote in cat: fp16/bf16/fp32 values and counts below 2**53 are exact in float64.
            wide = torch.float32 if device.type == "mps" else torch.float64
            parts: list[tuple[Any, str, torch.Tensor, int]] = []  # (owner, name, values, width)
            survey = self._survey.get(device)
            if survey:
                parts += [
                    (device, n, torch.stack(values).to(wide), 1)
                    for n, values in zip((*SURVEY_FIELDS, "nansum"), survey)
                    if values
                ]
            for stage, staged in stages.items():
                if staged is not None and stage.device == device:
                    parts += [(stage, n, v.to(wide), 1) for n, v in zip(_STAGED_FIELDS, staged)]
            detail = self._details.get(device)
            if detail and detail[0]:
                parts.append((device, "counts", torch.stack(detail[0]).to(wide).reshape(-1), len(_COUNTS)))
                parts.append((device, "extremes", torch.stack(detail[1]).to(wide).reshape(-1), 3))
            hists = [b for b in waiting if b.device == device]
            if hists:
                parts.append((device, "hists", torch.cat(hists).to(wide).reshape(-1), 0))
            total = self._gradient_hist.get(device)
            if total is not None:
                parts.append((device, "gradient_hist", total.to(wide), -HIST_BINS))
            queued = self._values.get(device)
            if queued:
                parts.append((device, "values", torch.stack([v.to(wide) for v in queued]), 1))
            vectors = self._vectors.get(device)
            if vectors:
                parts.append((device, "vectors", torch.cat([v.to(wide) for v in vectors]), 1))
            if not parts:
                continue
            # The one transfer of this device; the parts are split and converted on the host (no full list of
            # every number, and counts come back as ints: small ones are shared objects).
            numbers = torch.cat([p for _, _, p, _ in parts]).cpu()
            self.readbacks += 1
            for (owner, name, _part, width), piece in zip(parts, numbers.split([p.numel() for _, _, p, _ in parts])):
                if width == 0:  # histogram rows: dense here, sparse below
                    values: Any = piece.view(-1, HIST_BINS).numpy()
                elif width < 0:  # counts
                    values = piece.to(torch.int64).view(-1, -width).tolist()
                elif name in _EXTREMES:  # one float object per distinct value in the records
                    values = [shared(v, floats) for v in piece.tolist()]
                else:
                    values = piece.tolist() if width == 1 else piece.view(-1, width).tolist()
                host.setdefault(owner, {})[name] = values
        records = self._slots.records(host)
        gradient = [host[d]["gradient_hist"][0] for d in self._gradient_hist]
        self.gradient_histogram = [sum(bins) for bins in zip(*gradient)] if gradient else None
        self.values = [host[device]["values"][start : start + count] for device, start, count in self._value_groups]
        self.vectors = [host[device]["vectors"][start : start + n] for device, start, n in self._vector_slots]
        self.histograms = self._hist_rows.rows({d: data["hists"] for d, data in host.items() if "hists" in data})
        self._release()
        return records

    def _release(self) -> None:
        """After the one readback: the per-slot bookkeeping and the queued device values go (a kept graph's
        next backward gets a collector of its own), the slots' too (``len`` still answers; ``nbytes`` answers
        before the readback only)."""
        self._read_slots += len(self._slots)
        self._slots = SlotTable()
        self._seen.clear()
        self._stages.clear()
        self._cpu_stages.clear()
        self._survey.clear()
        self._details.clear()
        self._hist_rows = RowQueue()
        self._batches.clear()
        self._values.clear()
        self._vectors.clear()
        self._gradient_hist.clear()

    def named_histograms(self, rows: Iterable[tuple[str, int]], total: Optional[str] = None) -> BinadeHistograms:
        """After read(): the histograms of ``rows`` ((name, index) pairs; a name given twice keeps its first place
        and its last row, as a dict would) by name, and :attr:`gradient_histogram` under ``total`` when there is
        one. Nothing dense is built."""
        return named_histograms(self.histograms, rows, total, self.gradient_histogram)

    def nbytes(self, slot: int) -> int:
        """Bytes of the tensor measured in ``slot`` (from its recorded shape and dtype), before read()."""
        if slot < self._read_slots:
            raise IndexError(f"slot {slot} was read back already: its shape is in its record")
        return self._slots.nbytes(slot - self._read_slots, _ITEMSIZE)

    def __len__(self) -> int:
        return self._read_slots + len(self._slots)


_BATCHABLE = (torch.float16, torch.bfloat16, torch.float32)
# What a Stage's statistics are called in read(): the survey's names (nonzero counts under "zero_count").
_STAGED_FIELDS = ("min", "max", "nansum", "zero_count")
_EXTREMES = frozenset({"min", "max"})  # the survey's fields that records keep as floats
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def _histogrammable(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.numel() > 0 and not t.is_complex()


def tensor_stats(tensor: torch.Tensor, low_dtype: torch.dtype = torch.float16, detailed: bool = True) -> TensorStats:
    """Statistics of a single tensor (one host synchronisation). Convenient for tests and one-off checks."""
    collector = StatsCollector(low_dtype, detailed)
    collector.add(tensor)
    return collector.read()[0]


def measurable(t: torch.Tensor) -> torch.Tensor:
    """What the statistics of a tensor are taken on: the tensor itself, or a sparse one's values (its stored
    elements, duplicates summed: a sparse batch, a sparse gradient, a module returning ``to_sparse()``); the tensor
    itself is never changed."""
    if t.layout == torch.sparse_coo:
        return t.coalesce()._values()
    if t.layout != torch.strided:  # CSR and friends: their stored values
        return t.values()
    return t
