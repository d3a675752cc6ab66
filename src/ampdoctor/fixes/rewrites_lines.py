"""Code-level remedies at one source line, run for real in a verification re-run (issue 18, item 4).

Each mode is a ``TorchFunctionMode`` that computes, at the origin's source line (or in the loss), what the
rewritten code would compute, so the re-run is the rewrite's own arithmetic:

- :class:`SubtractMax`: ``torch.exp(x)`` → ``(x - x.amax(-1, keepdim=True)).exp()``;
- :class:`Float32AtLine`: squares, products, norms and sums at the line in float32 (``x.float().pow(2)...``);
- :class:`ScalarAtLine`: a Python number at the line replaced by one derived from ``torch.finfo`` of the tensor it
  meets (an ``eps`` below float16's resolution → ``finfo.eps``; a mask constant beyond the max → ``finfo.min``);
- :class:`LossInFloat32`: every op of the loss (run by ``capture.passes.resolve_loss``) with autocast off, its
  low-precision inputs in float32 (``with torch.autocast(dev, enabled=False): loss = loss_fn(out.float(), y)``);
- :class:`BceWithLogits`: ``F.binary_cross_entropy(torch.sigmoid(x), y)`` →
  ``F.binary_cross_entropy_with_logits(x, y)``.

``applied`` counts the rewritten calls; ``peak`` is the largest finite |value| the rewritten ops produced in low
precision (for the margin). The frame walks that place an op at a line run in verification re-runs only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import CodeType, FrameType, TracebackType
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..capture.passes import resolve_loss
from .rewrites import finite_peak

LOW = (torch.float16, torch.bfloat16)


def _user_frames() -> Optional[FrameType]:
    return sys._getframe(2)


# Library code between the user's line and the op: torch's Python (F.normalize, nn.Module.__call__) and ours.
_LIBRARY = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(os.path.dirname(__file__)) + os.sep)


def _runs_line(where: tuple[str, int]) -> bool:
    """Whether the current op's innermost user frame (the first outside torch and ampdoctor, as the op zoom
    names it) is at ``file:line``: an op of a function called from that line is not at it."""
    frame = _user_frames()
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY):
        frame = frame.f_back
    return frame is not None and frame.f_lineno == where[1] and frame.f_code.co_filename == where[0]


def _inside(code: CodeType) -> bool:
    frame = _user_frames()
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in LOW:
        return value.float()
    if isinstance(value, (list, tuple)):
        return type(value)(_float32(v) for v in value)
    return value


def _tensors(args: tuple[Any, ...]) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


class LineRewrite(TorchFunctionMode):
    """The common part: what was applied, the low-precision peak of the rewritten results, nothing missed."""

    missed = 0

    def __init__(self) -> None:
        super().__init__()
        self.applied = 0
        self.peak = 0.0

    def _result(self, out: Any) -> Any:
        self.applied += 1
        if isinstance(out, torch.Tensor):
            self.peak = max(self.peak, finite_peak(out))
        return out


_EXP = (torch.exp, torch.Tensor.exp)


class SubtractMax(LineRewrite):
    """``exp(x)`` at ``file:line`` computed as ``exp(x - x.amax(-1, keepdim=True))``: every value at most 1; a
    ratio of such exponentials (softmax written by hand, an attention weight) is unchanged."""

    def __init__(self, file: str, line: int) -> None:
        super().__init__()
        self.where = (file, line)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _EXP and len(args) == 1 and not kwargs and _runs_line(self.where):
            x = args[0]
            return self._result(torch.exp(x - x.amax(-1, keepdim=True)))
        return func(*args, **kwargs)


_SQUARES: frozenset[Any] = frozenset({
    torch.pow, torch.Tensor.pow, torch.Tensor.__pow__, torch.square, torch.Tensor.square,
    torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__,
    torch.norm, torch.Tensor.norm, torch.linalg.vector_norm, torch.linalg.norm,
    torch.sum, torch.Tensor.sum, torch.mean, torch.Tensor.mean,
    torch.var, torch.Tensor.var, torch.std, torch.Tensor.std,
})


class Float32AtLine(LineRewrite):
    """Squares, products, norms and sums at ``file:line`` computed in float32 (autocast off there, the
    low-precision inputs cast up, the result kept in float32: casting back would re-create the inf)."""

    def __init__(self, file: str, line: int) -> None:
        super().__init__()
        self.where = (file, line)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        low = any(t.dtype in LOW for t in _tensors(args))
        if func in _SQUARES and low and _runs_line(self.where):
            with torch.autocast(_tensors(args)[0].device.type, enabled=False):
                out = func(*_float32(args), **kwargs)
            self.applied += 1
            return out
        return func(*args, **kwargs)


_ADDS: frozenset[Any] = frozenset({
    torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.add_,
    torch.Tensor.__iadd__, torch.clamp_min, torch.Tensor.clamp_min, torch.clamp, torch.Tensor.clamp,
    torch.Tensor.clip, torch.clip,
})
_MULS: frozenset[Any] = frozenset({torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__})
_NORMALIZE = F.normalize
Replace = Callable[[float, torch.dtype], Optional[float]]


def representable_eps(value: float, dtype: torch.dtype) -> Optional[float]:
    """An ``eps`` below the format's smallest normal becomes ``torch.finfo(dtype).eps`` (None: leave it)."""
    finfo = torch.finfo(dtype)
    return finfo.eps if 0 < value < finfo.tiny else None


def fitting_constant(value: float, dtype: torch.dtype) -> Optional[float]:
    """A constant beyond the format's max becomes ``torch.finfo(dtype).min`` (or ``.max``) with its sign."""
    finfo = torch.finfo(dtype)
    if abs(value) <= finfo.max:
        return None
    return finfo.min if value < 0 else finfo.max


class ScalarAtLine(LineRewrite):
    """At ``file:line``, a Python number passed to an add/clamp (``eps``) or a multiply (``mask constant``) is
    replaced by what ``replace(value, dtype)`` derives from the dtype of the tensor it meets; ``F.normalize``'s
    ``eps`` (1e-12 by default) too."""

    def __init__(self, file: str, line: int, replace: Replace, funcs: frozenset[Any], measure: bool = True) -> None:
        super().__init__()
        self.where = (file, line)
        self.replace = replace
        self.funcs = funcs
        self.measure = measure  # False: the result is a mask of finfo.min sentinels, not a value to keep room for

    def _result(self, out: Any) -> Any:
        if self.measure:
            return super()._result(out)
        self.applied += 1
        return out

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is _NORMALIZE and _NORMALIZE in self.funcs and args and _runs_line(self.where):
            eps = kwargs.get("eps", args[3] if len(args) > 3 else 1e-12)
            new = self.replace(float(eps), args[0].dtype)
            if new is not None:
                kwargs["eps"] = new
                return self._result(func(*args[:3], **kwargs))
        if func not in self.funcs or not _tensors(args) or not _runs_line(self.where):
            return func(*args, **kwargs)
        dtype = _tensors(args)[0].dtype
        changed = False
        new_args = list(args)
        for i, a in enumerate(args):
            if isinstance(a, (int, float)) and not isinstance(a, bool):
                new = self.replace(float(a), dtype)
                if new is not None:
                    new_args[i], changed = new, True
        for key in ("min", "alpha", "other"):
            a = kwargs.get(key)
            if isinstance(a, (int, float)) and not isinstance(a, bool):
                new = self.replace(float(a), dtype)
                if new is not None:
                    kwargs[key], changed = new, True
        out = func(*new_args, **kwargs)
        return self._result(out) if changed else out


def eps_at_line(file: str, line: int) -> ScalarAtLine:
    return ScalarAtLine(file, line, representable_eps, _ADDS | {_NORMALIZE})


def mask_constant_at_line(file: str, line: int) -> ScalarAtLine:
    return ScalarAtLine(file, line, fitting_constant, _MULS, measure=False)


class LossInFloat32(LineRewrite):
    """Every op of the loss in float32: while ``resolve_loss`` (the capture's call of the user's loss) runs,
    autocast is off and low-precision tensor inputs are cast to float32."""

    _CODE = resolve_loss.__code__

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not _inside(self._CODE):
            return func(*args, **kwargs)
        tensors = _tensors(args)
        with torch.autocast(tensors[0].device.type if tensors else "cpu", enabled=False):
            if any(t.dtype in LOW for t in tensors):
                self.applied += 1
                return func(*_float32(args), **_float32_kwargs(kwargs))
            return func(*args, **kwargs)


def _float32_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: _float32(v) for k, v in kwargs.items()}


_SIGMOID = (torch.sigmoid, torch.Tensor.sigmoid, F.sigmoid)
_HELD = 64  # sigmoid outputs held at most (over training steps, verify_steps, they would pile up)


class BceWithLogits(LineRewrite):
    """``F.binary_cross_entropy(p, y)`` where ``p`` is the very tensor a ``sigmoid(x)`` returned is computed as
    ``F.binary_cross_entropy_with_logits(x, y)`` (what ``nn.BCEWithLogitsLoss`` runs): the gradient reaches the
    logits without passing through the saturated sigmoid. Holds the latest sigmoids' inputs until a BCE takes them
    or the mode exits."""

    def __init__(self) -> None:
        super().__init__()
        self._made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.binary_cross_entropy and args and id(args[0]) in self._made:
            made, logits = self._made.pop(id(args[0]))
            if made is args[0]:
                target = args[1] if len(args) > 1 else kwargs["target"]
                weight = args[2] if len(args) > 2 else kwargs.get("weight")
                reduction = kwargs.get("reduction", args[5] if len(args) > 5 else "mean")
                return self._result(
                    F.binary_cross_entropy_with_logits(logits, target, weight=weight, reduction=reduction)
                )
        out = func(*args, **kwargs)
        if func in _SIGMOID and args and isinstance(out, torch.Tensor):
            self._made[id(out)] = (out, args[0])
            if len(self._made) > _HELD:  # sigmoids no BCE took (attention gates): keep the most recent only
                del self._made[next(iter(self._made))]
        return out

    def __exit__(
        self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self._made.clear()
        super().__exit__(exc_type, exc, tb)


def line_rewrite(kind: str, where: Optional[tuple[str, int]]) -> Optional[LineRewrite]:
    """The mode that runs rewrite ``kind`` (a ``Rule.rewrite`` of ``fixes.rules``) at the origin's line ``where``
    (None: not one of these rewrites, or it needs a line and there is none)."""
    if kind == "loss_fp32":
        return LossInFloat32()
    if kind == "bce_logits":
        return BceWithLogits()
    at_line: dict[str, Callable[[str, int], LineRewrite]] = {
        "subtract_max": SubtractMax,
        "squares_fp32": Float32AtLine,
        "finfo_eps": eps_at_line,
        "mask_constant": mask_constant_at_line,
    }
    make = at_line.get(kind)
    return make(*where) if make is not None and where is not None else None
