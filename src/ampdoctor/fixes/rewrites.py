"""Code-level remedies run for real: during a verification re-run, a ``TorchFunctionMode`` computes what the
rewritten code would compute, so the re-run is the rewrite's own arithmetic, not an estimate.

``log(sigmoid(x))`` → ``F.logsigmoid(x)`` and ``log(softmax(x, d))`` → ``log_softmax(x, d)``: when ``log`` is
applied to the very tensor a ``sigmoid``/``softmax`` call returned, the mode returns the fused function of that
call's input instead. The mode holds the inner calls' inputs and outputs until it exits (a re-run's memory).
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

Fused = Literal["sigmoid", "softmax"]
_INNER: dict[Any, Fused] = {
    torch.sigmoid: "sigmoid",
    torch.Tensor.sigmoid: "sigmoid",
    F.sigmoid: "sigmoid",
    torch.softmax: "softmax",
    torch.Tensor.softmax: "softmax",
    F.softmax: "softmax",
}
_LOG = (torch.log, torch.Tensor.log)


def finite_peak(t: torch.Tensor) -> float:
    """Largest finite |value| of a low-precision result (0 for float32 results: no format limit to keep).
    Reads one number back: verification re-runs only, never at training time."""
    if t.dtype not in (torch.float16, torch.bfloat16) or not t.numel():
        return 0.0
    finite = t.detach().abs().masked_fill(~torch.isfinite(t.detach()), 0)
    return float(finite.max())


class FusedLog(TorchFunctionMode):
    """Runs ``log(inner(x))`` as the fused, finite form for one kind of inner function; counts how often."""

    def __init__(self, kind: Fused) -> None:
        super().__init__()
        self.kind = kind
        self.applied = 0
        self.peak = 0.0  # largest finite |value| the rewritten ops produced in low precision (for the margin)
        self._made: dict[int, tuple[torch.Tensor, torch.Tensor, Any, Any]] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _LOG and args and id(args[0]) in self._made:
            made, x, dim, dtype = self._made[id(args[0])]
            if made is args[0]:
                self.applied += 1
                fused = F.logsigmoid(x) if self.kind == "sigmoid" else torch.log_softmax(x, dim, dtype=dtype)
                self.peak = max(self.peak, finite_peak(fused))
                return fused
        out = func(*args, **kwargs)
        if _INNER.get(func) == self.kind and args and isinstance(out, torch.Tensor):
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            self._made[id(out)] = (out, args[0], dim, kwargs.get("dtype"))
        return out

    def __exit__(
        self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self._made.clear()
        super().__exit__(exc_type, exc, tb)


_MATMUL = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm)
_SCALE = {
    torch.Tensor.__truediv__: True,
    torch.Tensor.div: True,
    torch.div: True,
    torch.Tensor.__mul__: False,
    torch.Tensor.mul: False,
    torch.mul: False,
}


class ScaleFirst(TorchFunctionMode):
    """Runs ``(a @ b) / c`` (or ``* c``) at one source line as ``(a * (1 / c)) @ b``: the rewrite "scale q before
    the scores". The matmul at ``file:line`` is computed in float32 and held; when the next op divides (or
    multiplies) that very tensor by a Python number, the mode returns the rewritten arithmetic, run in the
    autocast state the user's code runs in. A held product that no scaling followed is counted in ``missed``
    (the rewrite does not apply there)."""

    def __init__(self, file: str, line: int) -> None:
        super().__init__()
        self.where = (file, line)
        self.applied = 0
        self.peak = 0.0  # largest finite |value| of the rewritten products in low precision (for the margin)
        self._held: dict[int, tuple[torch.Tensor, Any, Any, Any]] = {}
        self._missed = 0

    @property
    def missed(self) -> int:
        return len(self._held) or self._missed

    def _at_line(self) -> bool:
        import sys

        frame = sys._getframe(2)
        while frame is not None:
            if (frame.f_code.co_filename, frame.f_lineno) == self.where:
                return True
            frame = frame.f_back  # type: ignore[assignment]
        return False

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _SCALE and len(args) == 2 and id(args[0]) in self._held and isinstance(args[1], (int, float)):
            held, a, b, mm = self._held[id(args[0])]
            if held is args[0]:
                del self._held[id(args[0])]
                factor = 1.0 / args[1] if _SCALE[func] else float(args[1])
                self.applied += 1
                product = mm(a * factor, b)
                self.peak = max(self.peak, finite_peak(product))
                return product
        if func in _MATMUL and len(args) == 2 and not kwargs and self._at_line():
            a, b = args
            with torch.autocast(a.device.type, enabled=False):
                product = func(a.float(), b.float())
            self._held[id(product)] = (product, a, b, func)
            return product
        return func(*args, **kwargs)

    def __exit__(
        self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self._missed = len(self._held)
        self._held.clear()
        super().__exit__(exc_type, exc, tb)
