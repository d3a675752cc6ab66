"""One diagnosis per model at a time: a second diagnosis of a model (or of a model sharing modules with it) in
another thread waits until the first has put everything back; in the same thread (``diagnose`` called from inside
the model's own forward while it is diagnosed) it raises, since waiting would never end.

Why: a diagnosis runs the forward several times and puts the user's parameters and buffers back after each pass;
two diagnoses interleaving on the same parameters would each restore what the other wrote.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Callable

from torch import nn

from ..errors import InvalidInput
from .cleanup import cleaned, on_cleanup, uninterrupted

_changed = threading.Condition()
_claimed: dict[int, int] = {}  # id(module) -> the thread diagnosing it


def claim_modules(modules: Iterable[nn.Module], what: str) -> Callable[[], None]:
    """Wait until no other thread diagnoses any of ``modules``, then claim them; returns the (idempotent, owned)
    release. Raises :class:`InvalidInput` when this very thread already diagnoses one of them."""
    ids = [id(m) for m in modules]  # (a list: a set of ten thousand would cost half a megabyte more)
    me = threading.get_ident()
    with _changed:
        while True:
            holders = {_claimed[i] for i in ids if i in _claimed}
            if me in holders:
                raise InvalidInput(
                    f"{what} is already being diagnosed in this thread (diagnose called from inside its own forward "
                    "or loss?): one diagnosis per model at a time; call diagnose after the first one returns"
                )
            if not holders:
                return _take(ids, me)
            _changed.wait()  # another thread's diagnosis of these modules: its release wakes us


@uninterrupted
def _take(ids: list[int], me: int) -> Callable[[], None]:
    for i in ids:
        _claimed[i] = me

    @uninterrupted
    def release() -> None:
        with _changed:
            for i in ids:
                if _claimed.get(i) == me:
                    del _claimed[i]
            _changed.notify_all()
        cleaned(release)

    on_cleanup(release)
    return release
