"""Op-level zoom: which aten op made the first non-finite value, and on which source line.

A ``TorchDispatchMode`` is switched on only inside the origin call (forward) or during the backward of a
deterministic re-run; it synchronises per op, which is fine there and nowhere else.
"""

from __future__ import annotations

import math
import re
import traceback
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..records import Direction, OpFinding, SourceLocation
from .dtypes import dtype_name
from .stats import measuring
from .walk import floating_leaves

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


def _value_flags(t: torch.Tensor) -> tuple[int, int, int]:
    return int(torch.isnan(t).sum()), int(torch.isposinf(t).sum()), int(torch.isneginf(t).sum())


class _Zoom(TorchDispatchMode):
    """Watches every aten op and keeps the first one that *created* a non-finite value.

    Active only on a deterministic re-run; it synchronises per op, which is fine there. Subclasses decide what
    counts as creation and where the op's source line is. ampdoctor's own statistics ops are ignored.
    """

    direction: Direction = "forward"

    def __init__(self, module: str, call: int) -> None:
        super().__init__()
        self.module = module
        self.call = call
        self.finding: Optional[OpFinding] = None
        self.error: Optional[str] = None  # why inspecting an op failed (reported in the pass's notes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if self.finding is None and not measuring():
            try:
                self._inspect(func, args, kwargs or {}, out)
            except Exception as exc:  # the zoom is best effort: never break the user's step, but say so
                self.error = self.error or f"{_op_name(func)}: {type(exc).__name__}: {exc}"
        return out

    def _inspect(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        outputs = floating_leaves(out)
        out_flags = [_value_flags(t) for t in outputs]
        if not any(sum(f) for f in out_flags):
            return
        leaves = tree_flatten((args, kwargs))[0]
        inputs = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not self._creates(leaves, inputs, out_flags, outputs):
            return
        abs_max: list[Optional[float]] = []
        for t in inputs:
            finite = t[torch.isfinite(t)]
            abs_max.append(float(finite.abs().max()) if finite.numel() else None)
        nan, posinf, neginf = (sum(f[i] for f in out_flags) for i in range(3))
        node, location = self._where()
        self.finding = OpFinding(
            op=_op_name(func),
            module=self.module,
            call=self.call,
            input_dtypes=tuple(dtype_name(t.dtype) for t in inputs),
            input_abs_max=tuple(abs_max),
            output_dtype=dtype_name(outputs[0].dtype),
            output_nan_count=nan,
            output_posinf_count=posinf,
            output_neginf_count=neginf,
            location=location,
            direction=self.direction,
            node=node,
            scalar_args=tuple(float(v) for v in leaves if isinstance(v, (int, float)) and not isinstance(v, bool)),
        )

    def _creates(
        self, leaves: list[Any], inputs: list[torch.Tensor], out_flags: list[tuple[int, int, int]], outputs: Any
    ) -> bool:
        raise NotImplementedError

    def _where(self) -> tuple[Optional[str], Optional[SourceLocation]]:
        return None, user_location()


class OpZoom(_Zoom):
    """Forward, inside the origin call: the first op with a non-finite output whose inputs had no NaN or +inf.

    An op that fills an explicit ``-inf`` constant (``masked_fill(-inf)``) or passes a ``-inf`` mask on creates
    nothing; a finite constant too large for the format (``masked_fill(-1e9)`` in float16) does.
    """

    def _creates(
        self, leaves: list[Any], inputs: list[torch.Tensor], out_flags: list[tuple[int, int, int]], outputs: Any
    ) -> bool:
        if any(isinstance(v, float) and not math.isfinite(v) for v in leaves):
            return False
        in_flags = [_value_flags(t) for t in inputs]
        if any(nan or posinf for nan, posinf, _ in in_flags):
            return False  # propagation of an existing NaN/inf
        made_nan_or_posinf = any(nan or posinf for nan, posinf, _ in out_flags)
        return made_nan_or_posinf or not any(neginf for _, _, neginf in in_flags)


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
    """Backward: the first op that makes a kind of non-finite value (NaN, or inf) that none of its inputs holds,
    and none of whose inputs was made non-finite by an earlier backward op.

    Saved forward values may hold inf (``exp`` in the untaken branch of a ``torch.where``): passing them on
    creates nothing, but multiplying them by a zero gradient *creates* the NaN. Needs anomaly mode in the
    forward for the forward line.
    """

    direction: Direction = "backward"

    def __init__(self) -> None:
        super().__init__("", 0)
        self._made_bad: dict[int, weakref.ref[torch.Tensor]] = {}

    def _creates(
        self, leaves: list[Any], inputs: list[torch.Tensor], out_flags: list[tuple[int, int, int]], outputs: Any
    ) -> bool:
        inherited = any((ref := self._made_bad.get(id(t))) is not None and ref() is t for t in inputs)
        in_flags = [_value_flags(t) for t in inputs]
        input_nan = any(nan for nan, _, _ in in_flags)
        input_inf = any(posinf or neginf for _, posinf, neginf in in_flags)
        made_nan = any(nan for nan, _, _ in out_flags)
        made_inf = any(posinf or neginf for _, posinf, neginf in out_flags)
        created = not inherited and ((made_nan and not input_nan) or (made_inf and not input_inf))
        if created or inherited:  # a saved inf merely passed on (detach, view) is not a bad gradient yet
            for t, flags in zip(outputs, out_flags):
                if sum(flags):
                    self._made_bad[id(t)] = weakref.ref(t)
        return created

    def _where(self) -> tuple[Optional[str], Optional[SourceLocation]]:
        node = torch._C._current_autograd_node()
        return (node.name() if node is not None else None), forward_location(node)


def _op_name(func: Any) -> str:
    schema = getattr(func, "_schema", None)
    name = str(schema.name) if schema is not None else str(func)  # "aten::bmm"
    overload = getattr(func, "_overloadname", "default")
    return name if overload in ("default", "") else f"{name}.{overload}"

