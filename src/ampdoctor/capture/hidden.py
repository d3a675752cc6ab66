"""Hidden overflows: float16/bfloat16 ops that make inf or NaN from finite inputs, seen even when a later op hides
them (softmax of ``-inf``, ``clamp``, ``where``, ``nan_to_num``, ``masked_fill``, a ``max``) and the module's output
stays finite.

:class:`HiddenWatch` is a forward-only ``TorchFunctionMode``, installed by :func:`watching` (the one place it is
pushed and popped). It sees the ops the model's Python code calls (``q @ k`` arrives as ``Tensor.__matmul__``;
what runs inside ``F.scaled_dot_product_attention`` or a C++ module is one op to it). For each op with a
low-precision floating output it queues one fused reduction on the device (``aminmax``: inf, -inf and NaN all
show in it) for the pass's single readback, and keeps on the host only which op made which tensor (by object
id, through views) and who consumed it: no host synchronisation and no traceback per op. After the readback,
:meth:`HiddenWatch.records` names every op whose output is non-finite while its inputs were all finite, and the
first op that consumed the values and gave a finite result (what hid them).

That survey only flags ops. A re-run with ``targets`` (the flagged ops, by module call, op name and occurrence)
counts them exactly, classifies each element (see :class:`~ampdoctor.records.OpOverflow`) and resolves the
user's source line, for those ops only.

Sentinels are not overflows: fills and selections (``masked_fill(-inf)``, ``where(mask, x, -inf)``, a
``finfo.min`` fill) never make a value; elementwise arithmetic whose operand is already at or beyond the format's
max at an element (an additive ``finfo.min`` mask overflowing to ``-inf``) is mask arithmetic at that element. A
finite constant the format cannot hold is no sentinel: ``(1 - mask) * -1e9``, ``where(mask, x, -1e9)`` and
``x[mask] = -1e9`` in float16 make ``-inf`` from finite values. What the watch knows about each op (names,
categories, those constants) is in :mod:`.hidden_ops`.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..records import LOSS, OpOverflow
from .hidden_ops import (
    ARITH,
    CAST,
    DTYPE_NAMES,
    ELEMENTWISE,
    INPUT,
    LOW_DTYPES,
    LOW_NAMES,
    MAKE,
    MASK_FILLS,
    SELECT,
    SHAPE_ONLY_OPS,
    SKIP,
    VIEW,
    copied_from,
    counted_op,
    makes_with_scalar,
    op_info,
    resolved,
    selection_makes,
)
from .internal import INTERNAL, _internal
from .outputs_inside import outputs_used_inside
from .state import written_tensor
from .stats import format_limits, measurable
from .walk import transformed as _transformed
from .zoom import innermost_user_line

__all__ = ["MAX_CONSUMERS", "HiddenWatch", "Paused", "counted_op", "op_info", "targets_of", "watching"]

_DisableTorchFunction = torch._C.DisableTorchFunction
_SET_GRAD_ENABLED = torch._C._set_grad_enabled

# How many consumers of one op's values are followed when looking for what hid them.
MAX_CONSUMERS = 4


class _Node:
    """One op (or one unknown input) as the watch saw it: plain values, no tensor."""

    __slots__ = ("call", "name", "called", "occurrence", "category", "inputs", "consumers", "first", "outputs",
                 "dtype", "numel", "counts", "location", "masks", "unmasked")

    def __init__(self, call: Optional[int], name: str, called: str, occurrence: int, category: int,
                 inputs: tuple[int, ...]) -> None:
        self.call = call  # index of the innermost module call running it (None: outside the model, the loss)
        self.name = name
        self.called = called
        self.occurrence = occurrence
        self.category = category
        self.inputs = inputs  # node ids whose values it read
        self.consumers: list[int] = []
        self.first = -1  # index of its (min, max) pairs in HiddenWatch.values; -1: not measured
        self.outputs = 0  # low-precision outputs measured
        self.dtype = ""
        self.numel = 0
        self.counts = -1  # targets: index of (finite count, made count) in HiddenWatch.values
        self.location: Any = None
        self.masks: tuple[int, ...] = ()  # arithmetic: inputs that may be intentional masks (fills, unseen inputs)
        self.unmasked = -1  # arithmetic with masks: index of the (min, max) of its output where they are finite


class Paused:
    """``with watch.paused:`` takes the watch off the mode stack while it is on top (ampdoctor's own reads)."""

    __slots__ = ("watch", "_popped")

    def __init__(self, watch: HiddenWatch) -> None:
        self.watch = watch
        self._popped: list[bool] = []

    def __enter__(self) -> None:
        depth = torch._C._len_torch_function_stack()
        top = depth > 0 and torch._C._get_function_stack_at(depth - 1) is self.watch
        if top:
            torch._C._pop_torch_function_stack()
            if self.watch.writes is not None:  # the watch also guarded writes: the guard alone stays meanwhile
                torch._C._push_on_torch_function_stack(self.watch.writes)
        self._popped.append(top)

    def __exit__(self, *exc: object) -> None:
        if self._popped.pop():
            if self.watch.writes is not None:
                torch._C._pop_torch_function_stack()
            torch._C._push_on_torch_function_stack(self.watch)


class HiddenWatch(TorchFunctionMode):
    """The forward-only mode (see the module docstring). ``recorder`` says which module call runs; ``targets``: keys
    of ops to count, classify and locate. Never raises in the user's forward: the first failure is ``error``."""

    def __init__(self, recorder: Any, targets: frozenset[tuple[str, int, str, int]] = frozenset()) -> None:
        super().__init__()
        self.recorder = recorder
        self.targets = targets
        self.nodes: list[_Node] = []
        # 0-d device tensors, or (min, max) pairs of them as aminmax returns them (kept whole: unpacking each
        # costs more than the reduction on small tensors); read back with the pass's statistics.
        self.values: list[Any] = []
        self._count = 0  # values queued, pairs counted as two
        self.transformed_ops = 0  # ops inside a torch.func transform (vmap, grad): not watched
        self.grad_disabled = False  # the forward switched grad off somewhere (torch.no_grad)
        self.error: Optional[str] = None
        self._where: dict[int, tuple[weakref.ref[torch.Tensor], tuple[int, ...]]] = {}
        self._occurrences: dict[tuple[Optional[int], str], int] = {}
        self._queued: list[tuple[int, list[int]]] = []  # (collector vector, positions in values)
        self._from_slots: list[tuple[int, int]] = []  # (position in values, collector slot of a staged tensor)
        self.paused = Paused(self)
        # The pass's copy-on-write of parameters (capture.state.StateGuard), when the watch runs it too: one Python
        # mode per op instead of two (see guarding); ``writes`` is its own mode, put in the watch's place while
        # the watch is paused.
        self.guard: Any = None
        self.writes: Optional[TorchFunctionMode] = None

    def guarding(self, guard: Any) -> None:
        """Run ``guard.check_write`` (a StateGuard's copy-on-write of parameters) before every op the watch sees,
        in place of the guard's own mode; while the watch is paused, the guard's own mode stands in for it."""
        self.guard = guard
        self.writes = guard.guard_writes()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # The hot path: every op of the forward passes here (ten thousand on a model of ten thousand modules), so
        # the guard's check, INTERNAL and the single-output case are written out inline.
        if kwargs is None:
            kwargs = {}
        guard = self.guard
        if guard is not None:
            target = written_tensor(func, args, kwargs)
            if target is not None:
                guard.before_write(target)
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            outs: Sequence[Any] = (out,)
        elif isinstance(out, (tuple, list)):
            outs = out
        elif out is None and getattr(func, "__name__", "") == "__setitem__" and args:
            outs = (args[0],)  # ``x[mask] = -inf`` writes into x
        else:  # (no_grad in the forward: a reentrant checkpoint's region, which only .backward() differentiates)
            self.grad_disabled = self.grad_disabled or (func is _SET_GRAD_ENABLED and args == (False,))
            return out
        depth = getattr(_internal, "depth", 0)
        if depth:  # ampdoctor's own work (capture.stats.measuring)
            return out
        _internal.depth = 1  # INTERNAL, inline
        try:
            with _DisableTorchFunction():  # its own reads pass no mode below it (the write guard)
                self._see(func, args, kwargs, outs)
        except Exception as exc:  # never break the user's forward; the pass reports it
            if self.error is None:
                self.error = f"{op_info(func)[1]}: {type(exc).__name__}: {exc}"
        finally:
            _internal.depth = 0
        return out

    def _see(self, func: Any, args: Any, kwargs: Any, outs: Sequence[Any]) -> None:
        name, called, category, inplace = op_info(func)
        if len(outs) == 1:  # the common case, without a comprehension
            first = outs[0]
            if not isinstance(first, torch.Tensor) or not first.is_floating_point():
                return
            if _transformed(first):
                self.transformed_ops += 1
                return
            tensors = [first]
        else:
            tensors = [t for t in outs if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if tensors and _transformed(tensors[0]):
                self.transformed_ops += 1
                return
            if not tensors:
                return
        if category == SKIP:  # memory not written yet: no values of anyone's (whatever stale bytes it holds)
            for t in tensors:
                self._remember(t, ())
            return
        sources: list[int] = []
        if name not in SHAPE_ONLY_OPS:
            where = self._where
            for a in (*args, *kwargs.values()) if kwargs else args:
                if isinstance(a, torch.Tensor):
                    found = where.get(id(a))
                    sources += found[1] if found is not None and found[0]() is a else self._source(a)
                elif isinstance(a, (list, tuple)):
                    sources += [s for v in a if isinstance(v, torch.Tensor) for s in self._source(v)]
        inputs = tuple(sources) if len(sources) < 2 else tuple(dict.fromkeys(sources))
        written = tensors  # what its values are measured on
        if category == CAST:
            category = resolved(category, tensors, args)
        elif category == SELECT and selection_makes(name, tensors[0].dtype, args, kwargs):
            category = MAKE  # ``where(mask, x, -1e9)``, ``cache.copy_(wide)`` in float16: they make the overflow
            wide = copied_from(name, args, kwargs)  # measured itself (a -inf it holds is passed on, not made), and
            if wide is not None:  # what it became when written: not the whole buffer (an empty()'s stale bytes)
                inputs += self._measured(wide)
                written = [wide.detach().to(tensors[0].dtype)]
        if category == VIEW:
            for t in tensors:
                self._remember(t, inputs)
            return
        stack = self.recorder.stack
        call = stack[-1] if stack else None
        key = (call, name)
        occurrences = self._occurrences
        occurrence = occurrences.get(key, 0)
        occurrences[key] = occurrence + 1
        nodes = self.nodes
        node_id = len(nodes)
        node = _Node(call, name, called, occurrence, category, inputs)
        nodes.append(node)
        for i in inputs:
            consumers = nodes[i].consumers
            if len(consumers) < MAX_CONSUMERS:
                consumers.append(node_id)
        low = [t for t in written if t.dtype in LOW_DTYPES and t.numel()]
        if low:
            self._measure(node, low)
            if category == ARITH or name in ELEMENTWISE:
                self._measure_unmasked(node, low[0], args, inplace)
            if self.targets and category != SELECT and self._key(node) in self.targets:
                self._classify(node, low[0], args, kwargs, inplace)
        elif tensors[0].numel() and any(nodes[i].dtype in LOW_NAMES for i in inputs):
            # A wider result of low-precision values (softmax under CUDA autocast): measured too, so that what
            # hid a value is known; it never counts as making one (that is float32's business).
            self._measure(node, tensors[:1])
        made = (node_id,)
        where = self._where
        for t in tensors:
            try:
                where[id(t)] = (weakref.ref(t), made)
            except TypeError:
                pass
            if (inplace or name == "setitem") and t._base is not None:
                # Written through a view (``h[:, :4].mul_(s)``): the base holds these values now too.
                self._remember(t._base, tuple(dict.fromkeys((*self._source(t._base), node_id))))

    def _source(self, t: torch.Tensor) -> tuple[int, ...]:
        """The nodes whose values ``t`` holds; an unseen floating tensor (not a parameter) is measured once."""
        found = self._where.get(id(t))
        if found is not None and found[0]() is t:
            return found[1]
        if isinstance(t, nn.Parameter) or not t.is_floating_point() or not t.numel():
            return ()
        made = self._measured(t)
        self._remember(t, made)
        return made

    def _measured(self, t: torch.Tensor) -> tuple[int]:
        """A node of ``t``'s own values as they are now, measured."""
        self.nodes.append(node := _Node(None, "input", "", -1, INPUT, ()))
        self._measure(node, [t])
        return (len(self.nodes) - 1,)

    def _measure(self, node: _Node, tensors: list[torch.Tensor]) -> None:
        node.first = self._count
        node.outputs = len(tensors)
        dtype = tensors[0].dtype
        node.dtype = DTYPE_NAMES.get(dtype) or str(dtype).replace("torch.", "")
        node.numel = tensors[0].numel()
        shared = self.recorder.collector.add_if_staged
        values = self.values
        for t in tensors:
            # A small tensor is staged by the pass's collector, which its module's hook then finds measured already
            # (same tensor, same version: a leaf module's one op makes its output): one copy for both, its min and
            # max read from the pass's records. Otherwise one fused reduction; inf, -inf and NaN show in either.
            slot = shared(t)
            values.append(slot if slot >= 0 else torch.aminmax(measurable(t.detach())))
        self._count += 2 * len(tensors)

    def _measure_unmasked(self, node: _Node, out: torch.Tensor, args: Any, inplace: bool) -> None:
        """An elementwise op on a possible mask (``scores + mask``, then ``* scale``): one more reduction, of the
        output where those operands are finite (an inf made beside the mask's -inf is no mask)."""
        keep: Optional[torch.Tensor] = None
        masks: list[int] = []
        for i, a in enumerate(args[:2]):
            if (inplace and i == 0) or not isinstance(a, torch.Tensor) or a.dtype not in LOW_DTYPES:
                continue
            found = self._where.get(id(a))
            if found is None or found[0]() is not a or not found[1] or not all(map(self._mask_like, found[1])):
                continue
            masks.extend(found[1])
            finite = torch.isfinite(a.detach())
            keep = finite if keep is None else keep & finite
        if keep is None:
            return
        node.masks = tuple(masks)
        node.unmasked = self._count
        self.values.append(torch.aminmax(torch.where(keep, out.detach(), 0)))
        self._count += 2

    def _mask_like(self, source: int, steps: int = 2) -> bool:
        """A fill or an unseen input, or up to ``steps`` elementwise ops on one (bounded: each costs a reduction)."""
        n = self.nodes[source]
        direct = n.category == INPUT or n.name in MASK_FILLS
        return direct or (steps > 0 and bool(n.masks) and all(self._mask_like(m, steps - 1) for m in n.masks))

    def _remember(self, t: torch.Tensor, nodes: tuple[int, ...]) -> None:
        try:
            self._where[id(t)] = (weakref.ref(t), nodes)
        except TypeError:
            pass

    def _key(self, node: _Node) -> tuple[str, int, str, int]:
        if node.call is None:
            return (LOSS, 0, node.name, node.occurrence)
        call = self.recorder.calls[node.call]
        return (call.module, call.call, node.name, node.occurrence)

    def _classify(self, node: _Node, out: torch.Tensor, args: Any, kwargs: Any, inplace: bool) -> None:
        """A flagged op on the re-run: count its non-finite elements, and those it made (elementwise arithmetic:
        not where an operand was non-finite or at the format's max: mask arithmetic), and find its line."""
        o = out.detach()
        node.counts = self._count
        self._count += 2
        finite = torch.isfinite(o)
        self.values.append(torch.count_nonzero(finite))
        if node.category == ARITH or node.masks:  # (elementwise ops on a mask's -inf pass it on, like arithmetic)
            made = finite.logical_not_()  # reuses the mask: one temporary of o's size in bytes
            limits = format_limits(o.dtype)
            operands = list(args[:2]) + [v for k, v in kwargs.items() if k in ("other", "alpha")]
            for i, a in enumerate(operands):
                if inplace and i == 0:
                    continue  # ``x += y``: x's old values are gone (it is the output)
                if isinstance(a, torch.Tensor):
                    if a.dtype == torch.bool or a.is_complex():
                        continue  # 0 or 1: never at the max
                    a = a.detach()
                    made &= torch.isfinite(a)
                    # At the max *in the output's format*: a wider operand beyond its range (a float32 -1e9, a
                    # float32 finfo.min) rounds to inf there, a constant float16 cannot hold: not a sentinel.
                    low = a if a.dtype == o.dtype else a.to(o.dtype)
                    made &= (low.abs() < limits.max) | torch.isinf(low)
                elif isinstance(a, (int, float)) and not makes_with_scalar(a, limits):
                    made.zero_()
            self.values.append(torch.count_nonzero(made))
        else:  # every non-finite element was made (the op's inputs were finite)
            self.values.append(o.numel() - self.values[-1])
        del finite
        node.location = innermost_user_line()

    def queue(self, collector: Any, output: Any = None) -> None:
        """Hand the queued values to ``collector`` for the pass's single readback (one stacked vector per device
        and dtype); first, which of ``output`` the model read itself (the recorder's ``used_inside``)."""
        if output is not None:
            self.recorder.used_inside = outputs_used_inside(self, output)
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        flat: list[Any] = []
        self._from_slots = []
        for entry in self.values:
            if isinstance(entry, int):  # a collector slot: a (min, max) pair read from the records
                self._from_slots.append((len(flat), entry))
                flat += (None, None)
            elif isinstance(entry, tuple):
                flat += entry
            else:
                flat.append(entry)
        for i, v in enumerate(flat):
            if v is not None:
                groups.setdefault((v.device, v.dtype), []).append(i)
        with INTERNAL:
            self._queued = [
                (collector.add_vector(torch.stack([flat[i] for i in where])), where) for where in groups.values()
            ]
        self.values = []  # the collector holds them now (0-d tensors, no activation)
        # What only the forward needed (an entry per op): freed before the backward rather than with the pass.
        self._where = {}
        self._occurrences = {}

    def read_values(self, collector: Any, stats: Sequence[Any]) -> list[float]:
        """The values in the order they were queued, after ``collector.read()`` (which returned ``stats``)."""
        out = [0.0] * self._count
        for slot, where in self._queued:
            for position, value in zip(where, collector.vectors[slot]):
                out[position] = value
        for position, slot in self._from_slots:
            record = stats[slot]
            out[position] = record.min
            out[position + 1] = record.max
        return out

    def records(self, values: Sequence[float], calls: Sequence[Any]) -> tuple[OpOverflow, ...]:
        """Every op that made inf/NaN from finite inputs, from ``values`` (``self.values`` read back) and the
        recorder's calls. A classified op whose non-finite elements are all sentinels is left out."""
        nodes = self.nodes
        bad = [False] * len(nodes)
        for i, n in enumerate(nodes):
            if n.first >= 0:
                seen = values[n.first : n.first + 2 * n.outputs]
                bad[i] = any(not math.isfinite(v) for v in seen)
            else:
                bad[i] = any(bad[s] for s in n.inputs)
        found = []
        for i, n in enumerate(nodes):
            if not bad[i] or n.first < 0 or n.category not in (MAKE, ARITH, CAST) or n.dtype not in LOW_NAMES:
                continue
            if any(bad[s] for s in n.inputs) and (
                n.unmasked < 0
                or any(bad[s] for s in n.inputs if s not in n.masks)
                or all(math.isfinite(v) for v in values[n.unmasked : n.unmasked + 2])
            ):
                continue  # passed a non-finite value on (a mask's -inf and nothing beside it)
            count: Optional[int] = None
            sentinels = 0
            if n.counts >= 0:
                finite, made = int(values[n.counts]), int(values[n.counts + 1])
                count, sentinels = made, n.numel - finite - made
                if count == 0:
                    continue  # every non-finite element is mask arithmetic
            if n.call is None:
                module, number = LOSS, 0
            else:
                module, number = calls[n.call].module, calls[n.call].call
            found.append(
                OpOverflow(
                    module=module,
                    call=number,
                    call_index=n.call,
                    op=n.name,
                    function=n.called,
                    occurrence=n.occurrence,
                    dtype=n.dtype,
                    numel=n.numel,
                    count=count,
                    sentinels=sentinels,
                    classified=n.counts >= 0,
                    hidden_by=self._hider(i, bad),
                    location=n.location,
                )
            )
        return tuple(found)

    def _hider(self, start: int, bad: list[bool]) -> str:
        """The first op (in op order) that consumed the values, directly or through ops that kept them
        non-finite, and gave a finite result (or one the watch did not measure); "" when none."""
        nodes = self.nodes
        seen = {start}
        todo = sorted(nodes[start].consumers)
        while todo:
            c = todo.pop(0)
            if c in seen:
                continue
            seen.add(c)
            n = nodes[c]
            if n.first >= 0 and bad[c]:
                todo = sorted({*todo, *n.consumers})
                continue
            return n.name if n.first >= 0 else f"{n.name} (result not measured)"
        return ""


def targets_of(overflows: Sequence[OpOverflow]) -> frozenset[tuple[str, int, str, int]]:
    """The keys a re-run classifies: the ops a pass flagged."""
    return frozenset((o.module, o.call, o.op, o.occurrence) for o in overflows)


@contextlib.contextmanager
def watching(watch: Optional[HiddenWatch]) -> Iterator[None]:
    """Install ``watch`` for the duration of the block (the forward and the loss) and remove it however the
    block ends: the one place the hidden-overflow mode is pushed and popped."""
    if watch is None:
        yield
        return
    with watch:
        yield
