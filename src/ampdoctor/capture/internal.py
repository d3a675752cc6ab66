"""Marking ampdoctor's own tensor work (hooks, statistics), so op zooms and the hidden-overflow watch pass it over."""

from __future__ import annotations

import threading

_internal = threading.local()


def measuring() -> bool:
    """True while ampdoctor itself is computing statistics (op zooms must not mistake those ops for the model's)."""
    return getattr(_internal, "depth", 0) > 0


class Internal:
    """``with INTERNAL:`` marks ampdoctor's own work (hooks, statistics): :func:`measuring` is True inside, so
    the op zooms and the hidden-overflow watch pass its ops over. Reentrant; no allocation per use."""

    __slots__ = ()

    def __enter__(self) -> None:
        _internal.depth = getattr(_internal, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _internal.depth -= 1


INTERNAL = Internal()
