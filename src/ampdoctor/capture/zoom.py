"""Op-level zoom: which aten op made the non-finite value that reaches the bad output, and on which line.

A ``TorchDispatchMode`` is switched on only inside the origin call (forward) or during the backward of a
deterministic re-run; it synchronises per op, which is fine there and nowhere else. How it follows the data
(what reached the output, what was discarded, what is uninitialised memory) is in :mod:`.zoom_flow`.
"""

from __future__ import annotations

import dataclasses
import linecache
import math
import re
import sys
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..records import Direction, OpFinding, SourceLocation
from .cleanup import uninterrupted, uninterrupted_enter
from .dtypes import dtype_name
from .node_calls import NodeCalls
from .node_calls import available as node_calls_available
from .stats import measuring
from .walk import iter_tensors
from .zoom_flow import DataFlow, Flags, Op, Written, nonfinite

# Frames in these folders are the library, not the user's model. Compared as paths (``is_relative_to``), never
# as string prefixes: ``site-packages/torchvision`` is not inside ``site-packages/torch``.
_TORCH_DIR = Path(torch.__file__).resolve().parent
_OWN_DIR = Path(__file__).resolve().parent.parent
# ampdoctor's own model code (the demo) is user code for the zoom; the rest of the package is not.
_OWN_MODEL_FILES = frozenset({_OWN_DIR / "demo.py"})

_ENTRY = _OWN_DIR / "capture" / "walk.py"  # call_model: where a pass enters the user's model


def _frame_kind(filename: str) -> str:
    """"model" (user or library code: a candidate), "skip" (torch, ampdoctor's hooks and modes, <frozen ...>) or
    "stop" (where ampdoctor's pass called the model: beyond it lies the caller of ``diagnose``)."""
    if filename.startswith("<"):
        return "skip"
    path = Path(filename).resolve()
    if path == _ENTRY:
        return "stop"
    if (path.is_relative_to(_OWN_DIR) and path not in _OWN_MODEL_FILES) or path.is_relative_to(_TORCH_DIR):
        return "skip"
    return "model"


def _innermost_model_frame(frames: Iterable[tuple[str, int, str, str]]) -> Optional[SourceLocation]:
    """Walk (file, line, function, code) frames from the innermost outward to the first frame of model code.

    ampdoctor's own frames on the way (the zoom asking, a hook, a mode, a float32 fallback wrapper) are passed
    over; the frame where the pass called the model ends the walk: past it lies the caller of ``diagnose`` (a
    training loop), not model code, so a model without a Python forward (``nn.Sequential``) has no line.
    """
    for filename, line, function, code in frames:
        kind = _frame_kind(filename)
        if kind == "stop":
            return None
        if kind == "model":
            return SourceLocation(filename, line, function, code.strip())
    return None


def user_location() -> Optional[SourceLocation]:
    """The innermost stack frame of model code (outside torch and ampdoctor) that is running now."""
    stack = reversed(traceback.extract_stack())
    return _innermost_model_frame((f.filename, f.lineno or 0, f.name, f.line or "") for f in stack)


def innermost_user_line() -> Optional[SourceLocation]:
    """:func:`user_location` walking the live frames: only the chosen frame's source line is read (no
    traceback of every frame)."""
    frame = sys._getframe(1)
    kinds: dict[str, str] = {}
    while frame is not None:
        filename = frame.f_code.co_filename
        kind = kinds.get(filename) or kinds.setdefault(filename, _frame_kind(filename))
        if kind == "stop":
            return None
        if kind == "model":
            line = frame.f_lineno
            code = linecache.getline(filename, line).strip()
            return SourceLocation(filename, line, frame.f_code.co_name, code)
        frame = frame.f_back  # type: ignore[assignment]
    return None


class _Zoom(TorchDispatchMode):
    """Watches every aten op of one call and names the op whose non-finite result reaches the bad output.

    Every op that makes a non-finite value from finite meaningful inputs is a *candidate*; :mod:`.zoom_flow`
    follows which candidates' values each storage holds, and when the call ends the zoom names the first
    candidate whose values reached the output (:meth:`finish`), or, when the output was not handed over,
    the values the call made and left unconsumed. Candidates whose values were discarded on the way are kept
    in the finding's ``discarded``. Subclasses decide what counts as making a value and where the op's source
    line is. Active only on a deterministic re-run: one host read per op (two for a non-finite output).
    ampdoctor's own statistics ops are ignored.
    """

    direction: Direction = "forward"
    # Does the call's output outlive it? The forward's does (the hook holds it); the backward's gradients
    # are freed by the time the zoom closes, so there any value nothing consumed counts.
    outputs_outlive_call = True

    def __init__(self, module: str, call: int) -> None:
        super().__init__()
        self.module = module
        self.call = call
        self.finding: Optional[OpFinding] = None
        self.error: Optional[str] = None  # why inspecting an op failed (reported in the pass's notes)
        self._flow = DataFlow()
        self._done = False  # resolved: later ops (and the zoom's own reads) pass through
        self._entered = False

    # torch wraps a dispatch mode's ``__torch_dispatch__`` in ``torch._disable_dynamo`` when the class is made, and
    # that wrapper imports torch._dynamo on its first call (about 2 s and 80 MB, the whole cost of a first
    # diagnosis). Only when dynamo is already loaded can anything be compiling: the wrap is done then, on entry.
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if self._done or measuring():
            return func(*args, **kwargs)
        op: Optional[Op] = None
        try:
            op = self._flow.before(func, args, kwargs)
        except Exception as exc:  # the zoom is best effort: never break the user's step, but say so
            self._failed(func, exc)
        out = func(*args, **kwargs)
        if op is not None:
            try:
                self._inspect(func, op, out)
            except Exception as exc:
                self._failed(func, exc)
        return out

    def _failed(self, func: Any, exc: Exception) -> None:
        self.error = self.error or f"{_op_name(func)}: {type(exc).__name__}: {exc}"

    def _inspect(self, func: Any, op: Op, out: Any) -> None:
        written = self._flow.after(op, out)
        if written is None:
            return
        taint = self._flow.inherited(op, written.inputs)
        if not taint and not op.explicit_nonfinite:
            if self._creates(written.inputs, written.flags):
                taint = frozenset({self._flow.add_candidate(self._describe(func, op, written))})
            elif self._passes_outside_value(written):
                finding = dataclasses.replace(self._describe(func, op, written), from_saved=True)
                taint = frozenset({self._flow.add_candidate(finding)})
        self._flow.settle(written, taint)

    def _describe(self, func: Any, op: Op, written: Written) -> OpFinding:
        node, location = self._where()
        return OpFinding(
            op=_op_name(func),
            module=self.module,
            call=self.call,
            input_dtypes=tuple(dtype_name(i.t.dtype) for i in op.inputs),
            input_abs_max=tuple(_abs_max(f) for f in written.inputs),
            output_dtype=dtype_name(written.tensors[0].dtype),
            output_nan_count=int(sum(f[0] for f in written.flags)),
            output_posinf_count=int(sum(f[1] for f in written.flags)),
            output_neginf_count=int(sum(f[2] for f in written.flags)),
            location=location,
            direction=self.direction,
            node=node,
            scalar_args=op.scalars,
        )

    def _creates(self, inputs: list[Flags], outputs: list[Flags]) -> bool:
        """Whether an op none of whose non-finite inputs came from a candidate made its non-finite output."""
        raise NotImplementedError

    def _where(self) -> tuple[Optional[str], Optional[SourceLocation]]:
        return None, user_location()

    def _passes_outside_value(self, written: Written) -> bool:
        """Whether an op that made nothing passed on a non-finite value that no op of the zoom made (the
        backward's saved forward values); such a candidate is named only when no op made one."""
        return False

    # -- the end of the call ----------------------------------------------------------------------------------
    def finish(self, output: Any) -> None:
        """Name the op whose non-finite values reach ``output`` (what the zoomed call returned: a module's
        output, the loss). The first non-finite floating tensor in ``output`` that holds a candidate's values
        decides, in the order :func:`.walk.iter_tensors` walks it (the order the origin names its outputs)."""
        if self._done:
            return
        self._done = True  # the reads below are the zoom's own
        try:
            # Outside the dispatch, the zoom's reads would be autograd ops: recorded in the graph, and counted
            # as saved tensors by a non-reentrant checkpoint around the call.
            with torch.no_grad():
                first, union = self._flow.reaching(t for _, t in iter_tensors(output, "out"))
            self._name(first, union)
        except Exception as exc:
            self.error = self.error or f"the call's output: {type(exc).__name__}: {exc}"
        finally:
            self._flow.cells.clear()  # the per-element flags are spent: not held while the rest of the pass runs

    @uninterrupted_enter
    def __enter__(self) -> _Zoom:
        if "torch._dynamo" in sys.modules and "__wrapped_dynamo__" not in _Zoom.__dict__:
            _Zoom.__torch_dispatch__ = torch._disable_dynamo(  # type: ignore[method-assign]
                _Zoom.__dict__["__torch_dispatch__"], recursive=True
            )
            _Zoom.__wrapped_dynamo__ = True  # type: ignore[attr-defined]
        if not self._entered:
            super().__enter__()
            self._entered = True
        return self

    @uninterrupted
    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        """Idempotent: the mode leaves the stack once (a Ctrl-C waits until it has)."""
        if not self._entered:
            return
        self._entered = False
        super().__exit__(exc_type, exc_val, exc_tb)
        if self._done:
            return
        self._done = True
        try:
            reached = self._flow.sinks(alive_only=self.outputs_outlive_call)
            self._name(reached, reached)
        except Exception as exc:
            self.error = self.error or f"the call's output: {type(exc).__name__}: {exc}"
        finally:
            self._flow.cells.clear()

    def _name(self, reaching: frozenset[int], reached: frozenset[int]) -> None:
        """The first candidate in ``reaching`` is the op; those in none of ``reached`` were discarded."""
        candidates = self._flow.candidates
        if not reaching:
            return  # the bad output holds no candidate's values (an explicit inf constant, a -inf mask)
        made = [i for i in reaching if not candidates[i].finding.from_saved]  # an op that made it comes first
        discarded = tuple(c.finding for c in candidates if c.index not in reached and not c.finding.from_saved)
        self.finding = dataclasses.replace(candidates[min(made or reaching)].finding, discarded=discarded)


class OpZoom(_Zoom):
    """Forward, inside the origin call: an op makes a value when its output is non-finite while the inputs it
    used held no NaN or +inf (and none came from a candidate).

    An op that fills an explicit ``-inf`` constant (``masked_fill(-inf)``) or passes a ``-inf`` mask on makes
    nothing; a finite constant too large for the format (``masked_fill(-1e9)`` in float16) does, and so does
    an op that turns a ``-inf`` mask into NaN (softmax of a row that is masked everywhere).
    """

    def _creates(self, inputs: list[Flags], outputs: list[Flags]) -> bool:
        if any(f[0] or f[1] for f in inputs):
            return False  # an existing NaN/inf passed on
        return any(f[0] or f[1] for f in outputs) or not any(f[2] for f in inputs)


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>[^\n]+)\n(?:\s*(?P<code>[^\n]*))?')


def forward_location(node: Any) -> Optional[SourceLocation]:
    """The forward line that created an autograd node, from anomaly mode's recorded stack (innermost user frame)."""
    stack = getattr(node, "metadata", {}).get("traceback_") if node is not None else None
    if not stack:
        return None
    matches = (_FRAME.search(entry) for entry in reversed(list(stack)))
    return _innermost_model_frame(
        (m["file"], int(m["line"]), m["func"], m["code"] or "") for m in matches if m is not None
    )


class BackwardZoom(_Zoom):
    """Backward: an op makes a value when it outputs a kind of non-finite value (NaN, or inf) that none of the
    inputs it used holds, and none of its non-finite inputs came from a candidate.

    Saved forward values may hold inf (``exp`` in the untaken branch of a ``torch.where``): passing them on
    makes nothing, but multiplying them by a zero gradient *makes* the NaN. A non-finite gradient that a later
    backward op discards (the ``where`` backward zeroes it) is not the origin. Needs anomaly mode in the
    forward for the forward line.
    """

    direction: Direction = "backward"
    outputs_outlive_call = False

    def __init__(self, recorder: Any = None) -> None:
        super().__init__("", 0)
        # The pass's recorder numbers the nodes each call makes (node_calls): a finding names the call that made
        # its node; without one, or without torch's node numbers, no call is named (module "").
        self._calls = NodeCalls() if recorder is not None and node_calls_available() else None
        if self._calls is not None:
            recorder.node_calls = self._calls

    def __enter__(self) -> _Zoom:
        if self._calls is not None:  # entered as the backward starts
            self._calls.backward_starts()
        return super().__enter__()

    def _describe(self, func: Any, op: Op, written: Written) -> OpFinding:
        finding = super()._describe(func, op, written)
        node = torch._C._current_autograd_node()
        made_by = self._calls.locate(node._sequence_nr()) if self._calls is not None and node is not None else None
        return dataclasses.replace(finding, module=made_by[0], call=made_by[1]) if made_by else finding

    def _creates(self, inputs: list[Flags], outputs: list[Flags]) -> bool:
        input_nan = any(f[0] for f in inputs)
        input_inf = any(f[1] or f[2] for f in inputs)
        made_nan = any(f[0] for f in outputs)
        made_inf = any(f[1] or f[2] for f in outputs)
        return (made_nan and not input_nan) or (made_inf and not input_inf)

    def _where(self) -> tuple[Optional[str], Optional[SourceLocation]]:
        node = torch._C._current_autograd_node()
        return (node.name() if node is not None else None), forward_location(node)

    def _passes_outside_value(self, written: Written) -> bool:
        # a non-finite output whose non-finite inputs carry no candidate: they came from outside the backward's
        # ops (the gradient reaching the model is finite at a backward origin): a value the forward saved
        return any(nonfinite(f) for f in written.flags) and any(nonfinite(f) for f in written.inputs)


def _op_name(func: Any) -> str:
    schema = getattr(func, "_schema", None)
    name = str(schema.name) if schema is not None else str(func)  # "aten::bmm"
    overload = getattr(func, "_overloadname", "default")
    return name if overload in ("default", "") else f"{name}.{overload}"


def _abs_max(flags: Flags) -> Optional[float]:
    """An operand's largest magnitude as the report shows it: inf when it holds an inf (a saved forward value an
    overflow made), else NaN when it holds one, else its largest finite |x|; None for an empty operand."""
    nan, posinf, neginf, largest, finite = flags
    if posinf or neginf:
        return math.inf
    if nan:
        return math.nan
    return largest if finite else None
