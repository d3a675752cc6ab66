"""Room on the Python stack for instrumentation: torch calls a module that has hooks through one more frame than a
plain call, so a model nested as deep as a plain step allows would hit the recursion limit under hooks. The limit
is raised by the model's nesting depth while ampdoctor's hooks are on, and put back after."""

from __future__ import annotations

import sys
import threading
from typing import Any, Optional

from torch import nn

from .cleanup import raise_held_interrupt, shield_sigint, uninterrupted, uninterrupted_enter, unshield_sigint

# Frames torch's ``Module._call_impl`` adds per nesting level once a module has hooks (its ``inner`` closure), with
# one to spare; and the frames of ampdoctor's own (passes, hooks, statistics) below and above the model.
_HOOK_FRAMES_PER_LEVEL = 2
_OWN_FRAMES = 200
_room_lock = threading.Lock()
# While any diagnosis holds room: [users, the limit before the first raised it, the limit ampdoctor set].
_room: list[int] = [0, 0, 0]


def module_depth(root: nn.Module) -> int:
    """How deeply the module tree nests (the root alone: 1), walked without recursion."""
    deepest, todo = 0, [(root, 1)]
    seen: set[int] = set()
    while todo:
        module, depth = todo.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if depth > deepest:
            deepest = depth
        children = module._modules
        if children:  # (most modules of a large model are leaves: no generator for them)
            below = depth + 1
            todo.extend([(child, below) for child in children.values() if child is not None])
    return deepest


class RecursionRoom:
    """Room on the Python stack for what instrumentation adds per nesting level: torch calls a module with
    hooks through one more frame than a plain call, so a model that runs plain at 200 nested levels would hit
    the recursion limit under hooks. The limit is raised by that much while the passes run (never lowered),
    and put back when the last user leaves (unless someone else changed it meanwhile)."""

    def __init__(self, root: nn.Module, depth: Optional[int] = None) -> None:
        """``depth``: ``module_depth(root)`` when the caller knows it already (a pass enters room twice, for its
        forward and for its backward: one walk of a model of ten thousand modules, not two)."""
        self.extra = (module_depth(root) if depth is None else depth) * _HOOK_FRAMES_PER_LEVEL + _OWN_FRAMES
        self.entered = False

    @uninterrupted_enter
    def __enter__(self) -> RecursionRoom:
        with _room_lock:
            if self.entered:
                return self
            current = sys.getrecursionlimit()
            if _room[0] == 0:
                _room[1] = _room[2] = current
            wanted = _room[1] + self.extra
            if wanted > current:
                sys.setrecursionlimit(wanted)
                _room[2] = wanted
            _room[0] += 1
            self.entered = True
        return self

    @uninterrupted
    def __exit__(self, *exc: Any) -> None:
        """Idempotent: the last user puts the limit back, unless something else set it meanwhile."""
        with _room_lock:
            if not self.entered:
                return
            self.entered = False
            _room[0] -= 1
            if _room[0] == 0 and sys.getrecursionlimit() == _room[2]:
                sys.setrecursionlimit(_room[1])


class HeldWhileOn:
    """What a long-lived instrument (``watch``) holds from start to close: the SIGINT shield (a Ctrl-C that
    arrives while it installs or removes something waits until that is done), and room on the Python stack for
    the frame its hooks cost per nesting level (a model that trains plain trains watched)."""

    def __init__(self, root: nn.Module) -> None:
        self._shielded = shield_sigint()
        self._room: Optional[RecursionRoom] = RecursionRoom(root).__enter__()

    def release(self) -> None:
        """Idempotent; a Ctrl-C held meanwhile is raised at the end (unless one is already on its way)."""
        room, self._room = self._room, None
        if room is not None:
            room.__exit__(None, None, None)
        if self._shielded:
            self._shielded = False
            if unshield_sigint() and not isinstance(sys.exc_info()[1], KeyboardInterrupt):
                raise_held_interrupt()
