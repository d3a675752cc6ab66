"""Replacing the ``forward`` of chosen modules for a while, and putting each back exactly as it was."""

from __future__ import annotations

from types import TracebackType
from typing import Any, Callable, Optional, TypeVar

from torch import nn

from ..capture.cleanup import cleaned, on_cleanup, uninterrupted

_Patch = TypeVar("_Patch", bound="ForwardPatch")


class ForwardPatch:
    """The ``forward`` of each target module wrapped by :meth:`_wrap` until :meth:`remove` (or the end of the
    ``with`` block): an instance attribute is restored, a class method is uncovered again. The patch is owned by a
    diagnosis's cleanup from the moment it is applied, so an interrupted diagnosis removes it too."""

    def __init__(self) -> None:
        self._saved: list[tuple[nn.Module, bool, Any]] = []
        self._undo: Optional[Callable[[], None]] = None

    def _wrap(self, key: Any, module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        raise NotImplementedError

    @uninterrupted
    def _patch(self, targets: list[tuple[Any, nn.Module]]) -> None:
        """Patch every ``(key, module)`` at once (a Ctrl-C waits); a module listed twice is patched once."""
        self._undo = on_cleanup(self.remove)
        for key, module in targets:
            if any(module is m for m, _, _ in self._saved):
                continue
            had_own = "forward" in module.__dict__
            self._saved.append((module, had_own, module.__dict__.get("forward")))
            module.forward = self._wrap(key, module, module.forward)  # type: ignore[method-assign]

    @uninterrupted
    def remove(self) -> None:
        """Idempotent; runs to its end even when Ctrl-C arrives meanwhile."""
        for module, had_own, original in reversed(self._saved):
            if had_own:
                module.forward = original  # type: ignore[method-assign]
            else:
                module.__dict__.pop("forward", None)
        self._saved.clear()
        if self._undo is not None:
            cleaned(self._undo)
            self._undo = None

    def __enter__(self: _Patch) -> _Patch:
        return self

    def __exit__(
        self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.remove()
