"""When a watch must record nothing: while ampdoctor itself runs the model (issue 10, item 8).

Two kinds of passes are ampdoctor's, not training:

* a watch's own captures (``diagnose`` of a failing step) run inside :func:`own_capture`, a per-thread counter
  that every watch checks (a second watch on the same model stays quiet too);
* a user's ``diagnose`` inside an active watch: every forward of a diagnosis runs under ampdoctor's
  copy-on-write ``TorchFunctionMode``, which the current mode stack shows in O(1); should that mode ever change,
  the Python stack holds a frame of ``ampdoctor.api`` / ``ampdoctor.capture`` / ``ampdoctor.fixes`` (the fallback).

A watch asks once per root forward (:func:`diagnosing`); module calls outside a watched root forward (a
``training_step`` that calls submodules directly) get the O(1) checks only. Activation checkpointing recomputes
forwards during a backward: :func:`recomputing` tells those apart, and the watch records them only when no
diagnosis is on the stack.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

import torch

# Modules whose frames on the stack mean a diagnosis is running (the watch's own modules are not among them).
_DIAGNOSIS_MODULES = ("ampdoctor.api", "ampdoctor.capture.", "ampdoctor.fixes.")
# Modes of these modules are a watch's own (the per-op survey and taps), never a diagnosis.
_WATCH_MODULES = "ampdoctor.training."
# Frames looked at, from the innermost one (a hook fires a few frames below the model's forward).
_MAX_FRAMES = 200

_local = threading.local()


@contextlib.contextmanager
def own_capture() -> Iterator[None]:
    """A watch's capture runs inside: every watch on this thread ignores the passes."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def _ampdoctor_mode_active() -> bool:
    """A diagnosis's mode is on the stack (a watch's own op survey and taps, :mod:`.optrack`, are not one)."""
    stack = torch.overrides._get_current_function_mode_stack()
    return any(
        type(mode).__module__.startswith("ampdoctor.") and not type(mode).__module__.startswith(_WATCH_MODULES)
        for mode in stack
    )


def _diagnosis_on_stack() -> bool:
    frame = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return False
        name = frame.f_globals.get("__name__", "")
        if isinstance(name, str) and name.startswith(_DIAGNOSIS_MODULES):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def diagnosing(thorough: bool = True) -> bool:
    """True while ampdoctor runs the model on this thread: a watch's capture, or a ``diagnose`` call.

    ``thorough=False`` skips the walk up the Python stack (for checks made on every module call)."""
    if getattr(_local, "depth", 0) > 0 or _ampdoctor_mode_active():
        return True
    return thorough and _diagnosis_on_stack()


def recomputing() -> bool:
    """A module forward inside a backward: activation checkpointing recomputes its region there."""
    current = getattr(torch._C, "_current_autograd_node", None)
    return current is not None and current() is not None
