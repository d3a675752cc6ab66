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


class FusedLog(TorchFunctionMode):
    """Runs ``log(inner(x))`` as the fused, finite form for one kind of inner function; counts how often."""

    def __init__(self, kind: Fused) -> None:
        super().__init__()
        self.kind = kind
        self.applied = 0
        self._made: dict[int, tuple[torch.Tensor, torch.Tensor, Any, Any]] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _LOG and args and id(args[0]) in self._made:
            made, x, dim, dtype = self._made[id(args[0])]
            if made is args[0]:
                self.applied += 1
                if self.kind == "sigmoid":
                    return F.logsigmoid(x)
                return torch.log_softmax(x, dim, dtype=dtype)
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
