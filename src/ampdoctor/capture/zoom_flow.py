"""What the op zoom knows about the data inside one call: which memory holds what, and which op put it there.

The zoom must name the op whose non-finite result *reaches* the bad output, not merely the first op that made
one: code often makes a ``-inf`` or NaN and throws it away (``torch.where``, ``nan_to_num``, ``masked_fill``,
a value turned into integer indices), and allocation ops hand out memory holding whatever bytes were there.
So the zoom follows the data, per storage (a tensor's memory, shared by all its views):

- **taint**: the *candidate* ops (ops that made non-finite values from finite meaningful inputs) whose
  non-finite values the storage may hold now. An op whose meaningful inputs are non-finite passes their taint
  on to its non-finite outputs; a finite output carries none (whatever came in was discarded).
- **garbage**: which bytes no op has written since an allocation op (``empty``, ``new_empty_strided`` ...) made
  the storage. Garbage is never a value: it is left out of every flag and count, copies and casts of it
  (autocast's ``_to_copy``) are garbage too, and an op that reads it where it matters makes garbage.
- when the storage was last written and last read: values the call made and never consumed are its outputs.

Inputs an op ignores are not meaningful: the ``input`` of ``addmm``/``baddbmm`` with ``beta=0`` (documented:
its NaN and inf are not propagated), the old contents of an ``out=`` tensor or of the target of ``copy_`` and
``fill_``, the unselected side of ``torch.where`` and the filled positions of ``masked_fill``.

Taint is kept per storage, not per element: a buffer whose parts hold values of two ops carries both (a partial
write into a tainted storage re-checks whether anything non-finite is left around what it wrote). Garbage is
kept per byte, so a buffer filled piece by piece (strided views, ``index_put_``, ``scatter_``) is clean once
every piece is written.

Cost: one host read per op (its outputs' flags), a second only for an op with a non-finite output, and one for
an op that reads memory an allocation op made and that is not yet known to be fully written; none for a view.
Only the zoom uses this, on one call of one deterministic re-run (or one backward).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..records import OpFinding
from .zoom_ops import (
    ALLOCATION_OPS,
    BETA_OPS,
    OVERWRITE_OPS,
    PARTIAL_WRITES,
    RESIZE_OPS,
    leaves,
    regions,
    roles_of,
    scalar_is_nonfinite,
    tensors_in,
)

# NaN count, +inf count, -inf count, largest finite |x|, finite count
Flags = tuple[float, float, float, float, float]


def nonfinite(flags: Flags) -> bool:
    return bool(flags[0] or flags[1] or flags[2])


def _storage(t: torch.Tensor) -> Optional[torch.UntypedStorage]:
    try:
        return t.untyped_storage()
    except Exception:  # sparse, nested and some subclass tensors have no plain storage: not followed
        return None


@dataclass
class Cell:
    """What the zoom knows about one storage."""

    ref: weakref.ref[torch.UntypedStorage]
    taint: frozenset[int] = frozenset()
    garbage: Optional[torch.Tensor] = None  # bool per byte of the storage, True where nothing wrote yet
    written: int = -1  # step of the last write
    read: int = -1  # step of the last meaningful read


@dataclass
class Input:
    """A meaningful floating input of an op: the tensor, and which of its elements the op uses."""

    t: torch.Tensor
    keep: Optional[torch.Tensor]  # bool, broadcastable to t; None: all elements
    cell: Optional[Cell]
    garbage: Optional[torch.Tensor] = None  # bool per element of t (keep applied), when its storage has garbage


@dataclass
class Op:
    """One op as the zoom sees it, before it runs."""

    name: str  # "aten::baddbmm"
    every: dict[str, Any]  # its arguments by schema name
    is_view: bool = False
    pointwise: bool = False
    inputs: list[Input] = field(default_factory=list)  # meaningful floating inputs
    read_cells: list[Cell] = field(default_factory=list)  # cells of every meaningful input, any dtype
    # (input, its garbage per element) for meaningful inputs of any dtype that hold garbage where used
    garbage_read: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    targets: list[torch.Tensor] = field(default_factory=list)  # written in place (self of ``mul_``, ``out=``)
    arg_storages: set[int] = field(default_factory=set)
    scalars: tuple[float, ...] = ()
    explicit_nonfinite: bool = False  # a Python NaN/inf constant (``masked_fill(-inf)``): an intentional value
    pre_stats: Optional[list[torch.Tensor]] = None  # inputs' stats taken before an in-place op ran
    pre_numel: list[int] = field(default_factory=list)


@dataclass
class Written:
    """What one op wrote, measured; ``inputs`` filled when some written value is non-finite."""

    tensors: list[torch.Tensor]  # floating, in memory the op wrote
    flags: list[Flags]
    around: list[Optional[Flags]]  # the whole storage, for a partial write into a tainted one
    step: int
    inputs: list[Flags] = field(default_factory=list)

    @property
    def nonfinite(self) -> bool:
        return any(nonfinite(f) for f in self.flags)


@dataclass
class Candidate:
    index: int
    finding: OpFinding


def stats(t: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[NaN, +inf, -inf counts, largest finite |x|, finite count] over the kept elements: float64, on t's device.

    No host read: the caller reads many at once.
    """
    if keep is not None:
        t, keep = torch.broadcast_tensors(t, keep.to(t.device))
    if t.numel() == 0:
        return torch.zeros(5, dtype=torch.float64, device=t.device)
    nan, posinf, neginf, finite = torch.isnan(t), torch.isposinf(t), torch.isneginf(t), torch.isfinite(t)
    if keep is not None:
        nan, posinf, neginf, finite = nan & keep, posinf & keep, neginf & keep, finite & keep
    abs_max = torch.where(finite, t.abs(), torch.zeros((), dtype=t.dtype, device=t.device)).amax()
    counts = [nan.sum(), posinf.sum(), neginf.sum(), abs_max, finite.sum()]
    return torch.stack([c.double() for c in counts])


def read_all(values: Sequence[torch.Tensor]) -> list[Flags]:
    """Read stats tensors back: one host read per device."""
    out: list[Flags] = [(0.0, 0.0, 0.0, 0.0, 0.0)] * len(values)
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        by_device.setdefault(v.device, []).append(i)
    for indices in by_device.values():
        rows = torch.stack([values[i] for i in indices]).tolist()
        for i, row in zip(indices, rows):
            out[i] = (row[0], row[1], row[2], row[3], row[4])
    return out


def _bytes(mask: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The bytes of a per-byte storage mask that tensor ``t`` covers, shaped ``t.shape + (element size,)``."""
    size = t.element_size()
    return mask.as_strided(
        tuple(t.shape) + (size,), tuple(s * size for s in t.stride()) + (1,), t.storage_offset() * size
    )


def _covers_storage(t: torch.Tensor, storage: torch.UntypedStorage) -> bool:
    return t.numel() * t.element_size() == storage.nbytes()


class DataFlow:
    """Cells per storage, candidates in op order; :meth:`before`, :meth:`after` and :meth:`settle` bracket
    every op."""

    def __init__(self) -> None:
        self.cells: dict[int, Cell] = {}
        self.candidates: list[Candidate] = []
        self.step = 0

    # -- cells ------------------------------------------------------------------------------------------------
    def cell(self, t: torch.Tensor, create: bool = False) -> Optional[Cell]:
        storage = _storage(t)
        if storage is None:
            return None
        found = self.cells.get(id(storage))
        if found is not None and found.ref() is storage:
            return found
        if not create:
            return None
        made = Cell(weakref.ref(storage))
        self.cells[id(storage)] = made
        return made

    def garbage_of(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """Which elements of ``t`` no op has written (None: all were written, or never allocated here)."""
        cell = self.cell(t)
        if cell is None or cell.garbage is None:
            return None
        return _bytes(cell.garbage, t).any(-1)

    def _garbage_read(
        self, t: torch.Tensor, cell: Optional[Cell], keep: Optional[torch.Tensor]
    ) -> Optional[torch.Tensor]:
        """The elements of ``t`` the op uses that no op has written; None when there are none.

        One host read, only for storages that an allocation op made and that are not yet known to be fully
        written; a storage found fully written loses its mask, so later ops pay nothing.
        """
        if cell is None or cell.garbage is None:
            return None
        garbage = _bytes(cell.garbage, t).any(-1)
        if keep is not None:
            garbage = garbage & keep.to(garbage.device)
        anywhere, here = torch.stack([cell.garbage.any(), garbage.any()]).tolist()
        if not anywhere:
            cell.garbage = None
        return garbage if here else None

    # -- before the op runs -----------------------------------------------------------------------------------
    def before(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Op:
        roles = roles_of(func)
        if roles.is_view:  # a view reads and writes nothing: it shares its input's storage, and so its cell
            return Op(roles.name, {}, is_view=True)
        bound: list[tuple[str, bool, bool, Any]] = [
            (name, written, kw_only, value) for (name, written, kw_only), value in zip(roles.arguments, args)
        ]
        by_name = {a[0]: a for a in roles.arguments}
        for key, value in kwargs.items():
            bound.append(by_name.get(key, (key, False, True)) + (value,))
        every = {name: value for name, _, _, value in bound}
        ignored: set[str] = set()
        if (roles.name in BETA_OPS and every.get("beta", 1) == 0) or roles.name in OVERWRITE_OPS:
            ignored.add("self")
        keeps = regions(roles.name, every)
        op = Op(roles.name, every, pointwise=roles.pointwise)
        scalars: list[float] = []
        for name, written, kw_only, value in bound:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                scalars.append(float(value))
                op.explicit_nonfinite = op.explicit_nonfinite or scalar_is_nonfinite(value)
            for t in tensors_in(value):
                storage = _storage(t)
                if storage is not None:
                    op.arg_storages.add(id(storage))
                if written:
                    op.targets.append(t)
                if (written and kw_only) or name in ignored or not t.numel():  # out= tensors, ignored inputs
                    continue
                keep = keeps.get(name)
                cell = self.cell(t)
                if cell is not None:
                    op.read_cells.append(cell)
                garbage = self._garbage_read(t, cell, keep)
                if garbage is not None:
                    op.garbage_read.append((t, garbage))
                if t.is_floating_point():
                    op.inputs.append(Input(t, keep, cell, garbage))
        op.scalars = tuple(scalars)
        if op.targets:
            # An in-place op changes its inputs: measure them now (still on the device; read later if needed).
            op.pre_stats = [_input_stats(i) for i in op.inputs]
            op.pre_numel = [t.numel() for t in op.targets]
        return op

    # -- after the op ran -------------------------------------------------------------------------------------
    def after(self, op: Op, out: Any) -> Optional[Written]:
        """Update the cells for what the op wrote. Returns what it wrote when some of it is non-finite: the
        caller decides whether the op made it, then calls :meth:`settle`. ``None``: nothing to decide."""
        results = leaves(out)
        writes = self._writes(op, results)
        if op.is_view or (results and not writes and all(_storage_id(t) in op.arg_storages for t in results)):
            return None  # a view, or an op that hands back its input: it reads nothing and makes nothing
        self.step += 1
        for read in op.read_cells:
            read.read = 2 * self.step
        if not writes:
            return None
        step = 2 * self.step + 1
        if op.name in ALLOCATION_OPS or (op.name in RESIZE_OPS and op.pre_numel and op.pre_numel[0] == 0):
            self._allocated(writes, step)
            return None
        garbage = [self._write_garbage(op, t) for t in writes]
        floating = [(t, g) for t, g in zip(writes, garbage) if t.is_floating_point()]
        for t in writes:
            if not t.is_floating_point():
                self._set(t, frozenset(), step)  # integers and booleans hold no inf
        measured = [stats(t, None if g is None else ~g) for t, g in floating]
        # A partial write into a storage that held tainted values: is anything non-finite left around it?
        around_at: list[Optional[int]] = []
        for t, _ in floating:
            cell, storage = self.cell(t), _storage(t)
            if cell is not None and storage is not None and cell.taint and not _covers_storage(t, storage):
                around_at.append(len(measured))
                measured.append(self._storage_stats(t, storage))
            else:
                around_at.append(None)
        flags = read_all(measured)
        written = Written(
            [t for t, _ in floating],
            flags[: len(floating)],
            [None if i is None else flags[i] for i in around_at],
            step,
        )
        if not written.nonfinite:
            self.settle(written, frozenset())
            return None
        pre = op.pre_stats if op.pre_stats is not None else [_input_stats(i) for i in op.inputs]
        written.inputs = read_all(pre) if pre else []
        return written

    def _allocated(self, writes: list[torch.Tensor], step: int) -> None:
        """Memory from an allocation op: every byte is garbage, and no candidate's value is in it."""
        for t in writes:
            storage, cell = _storage(t), self._set(t, frozenset(), step)
            if storage is not None and cell is not None:
                cell.garbage = torch.ones(storage.nbytes(), dtype=torch.bool, device=t.device)

    def _set(self, t: torch.Tensor, taint: frozenset[int], step: int) -> Optional[Cell]:
        cell = self.cell(t, create=True)
        if cell is not None:
            cell.taint, cell.written = taint, step
        return cell

    @staticmethod
    def inherited(op: Op, in_flags: list[Flags]) -> frozenset[int]:
        """The candidates whose non-finite values reached this op through the inputs it used."""
        taint: frozenset[int] = frozenset()
        for item, f in zip(op.inputs, in_flags):
            if item.cell is not None and nonfinite(f):
                taint |= item.cell.taint
        return taint

    def settle(self, written: Written, taint: frozenset[int]) -> None:
        """Give each written storage its new taint: ``taint`` where the written values are non-finite."""
        for t, f, around in zip(written.tensors, written.flags, written.around):
            cell, storage = self.cell(t, create=True), _storage(t)
            if cell is None or storage is None:
                continue
            if around is not None:  # a partial write: what was around it stays, if it is still non-finite
                kept = cell.taint if nonfinite(around) else frozenset()
            else:
                kept = frozenset() if _covers_storage(t, storage) else cell.taint
            cell.taint, cell.written = kept | (taint if nonfinite(f) else frozenset()), written.step

    def add_candidate(self, finding: OpFinding) -> int:
        index = len(self.candidates)
        self.candidates.append(Candidate(index, finding))
        return index

    # -- garbage ----------------------------------------------------------------------------------------------
    def _write_garbage(self, op: Op, t: torch.Tensor) -> Optional[torch.Tensor]:
        """Update the garbage mask of what the op wrote into ``t``; returns it per element of ``t`` (None: none)."""
        cell = self.cell(t)
        old = self.garbage_of(t)
        if not op.garbage_read and old is None:
            return None  # the usual case: no uninitialised memory anywhere near this op
        storage = _storage(t)
        if storage is None:
            return None
        new = self._garbage_after(op, t, old)
        if new is None and (cell is None or cell.garbage is None):
            return None
        cell = self.cell(t, create=True)
        assert cell is not None
        if cell.garbage is None:
            cell.garbage = torch.zeros(storage.nbytes(), dtype=torch.bool, device=t.device)
        target = _bytes(cell.garbage, t)
        try:
            if new is None:
                target.fill_(False)
            else:
                target.copy_(new.unsqueeze(-1).expand(target.shape))
        except RuntimeError:  # an overlapping view cannot be written through: leave the mask as it was
            pass
        return new

    @staticmethod
    def _garbage_after(op: Op, t: torch.Tensor, old: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Which elements of ``t`` hold garbage once the op wrote it (``old``: before; None: none)."""
        self_arg = op.every.get("self")
        in_place = self_arg is t and any(t is target for target in op.targets)
        others = [g for i, g in op.garbage_read if i is not t]
        everything = torch.ones(t.shape, dtype=torch.bool, device=t.device)
        base = op.name[:-1] if op.name.endswith("_") else op.name
        if op.name in OVERWRITE_OPS or op.pointwise:  # element i from element i of the (broadcast) inputs
            new = _union(others, t)
            if in_place and op.name not in OVERWRITE_OPS and old is not None:
                new = old if new is None else old | new
            return new
        if base in PARTIAL_WRITES and isinstance(self_arg, torch.Tensor):
            if any(i is not self_arg for i, _ in op.garbage_read):
                return everything  # garbage written in: where exactly is not worth following
            before = old if in_place else next((g for i, g in op.garbage_read if i is self_arg), None)
            return None if before is None else PARTIAL_WRITES[base](before, op.every)
        if in_place and old is not None:  # read-modify-write: what was garbage stays garbage
            return everything if others else old
        if op.garbage_read:  # computed from garbage (a reduction, a product): all of it is garbage
            return everything
        return None

    def _storage_stats(self, t: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor:
        whole = t.as_strided((storage.nbytes() // t.element_size(),), (1,), 0)
        garbage = self.garbage_of(whole)
        return stats(whole, None if garbage is None else ~garbage)

    @staticmethod
    def _writes(op: Op, results: list[torch.Tensor]) -> list[torch.Tensor]:
        """Tensors the op wrote: its in-place targets, and outputs in memory none of its arguments had."""
        writes = [t for t in op.targets if t.numel()]
        for t in results:
            if t.numel() and _storage(t) is not None and _storage_id(t) not in op.arg_storages:
                writes.append(t)
        return writes

    # -- which candidates reached the output --------------------------------------------------------------------
    def sinks(self, alive_only: bool) -> frozenset[int]:
        """Candidates held by storages written after their last read: the values the call left unconsumed."""
        reached: frozenset[int] = frozenset()
        for cell in self.cells.values():
            if cell.taint and cell.written > cell.read and (not alive_only or cell.ref() is not None):
                reached |= cell.taint
        return reached

    def reaching(self, outputs: Iterable[torch.Tensor]) -> tuple[frozenset[int], frozenset[int]]:
        """(taint of the first non-finite output that carries any, union over all non-finite outputs)."""
        chosen: list[tuple[torch.Tensor, Cell]] = []
        for t in outputs:
            cell = self.cell(t) if t.is_floating_point() and t.numel() else None
            if cell is not None and cell.taint:
                chosen.append((t, cell))
        if not chosen:
            return frozenset(), frozenset()
        measured = []
        for t, _ in chosen:
            garbage = self.garbage_of(t)
            measured.append(stats(t, None if garbage is None else ~garbage))
        first: frozenset[int] = frozenset()
        union: frozenset[int] = frozenset()
        for (_, cell), f in zip(chosen, read_all(measured)):
            if nonfinite(f):
                first = first or cell.taint
                union |= cell.taint
        return first, union


def _union(garbage: list[torch.Tensor], t: torch.Tensor) -> Optional[torch.Tensor]:
    """Garbage per element of ``t`` from inputs it was computed from element by element (broadcast)."""
    new: Optional[torch.Tensor] = None
    for g in garbage:
        try:
            spread = g.to(t.device).expand(t.shape)
        except RuntimeError:  # not broadcastable after all: count every element
            spread = torch.ones(t.shape, dtype=torch.bool, device=t.device)
        new = spread.clone() if new is None else new | spread
    return new


def _input_stats(item: Input) -> torch.Tensor:
    keep = item.keep
    if item.garbage is not None:
        keep = ~item.garbage if keep is None else keep & ~item.garbage
    return stats(item.t, keep)


def _storage_id(t: torch.Tensor) -> Optional[int]:
    storage = _storage(t)
    return None if storage is None else id(storage)
