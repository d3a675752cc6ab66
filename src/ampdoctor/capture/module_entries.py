"""What a pass's state guard (:class:`~.state.StateGuard`) keeps of every module for the whole diagnosis, compactly:
a model of ten thousand modules would otherwise keep a dict and a tuple per module per kind (megabytes, all
diagnosis long)."""

from __future__ import annotations

import array
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn


class Entries:
    """What one dict attribute (``_parameters``, ``_buffers``, ``_modules``) of every module held, compactly: per
    module its names (one shared tuple per distinct list of names) and where its objects start in one flat list.
    About 16 bytes a module and 8 an entry, against a dict and a tuple per module."""

    __slots__ = ("names", "objects", "starts")

    def __init__(self, modules: list[nn.Module], attribute: str) -> None:
        shared: dict[tuple[str, ...], tuple[str, ...]] = {(): ()}
        self.names: list[tuple[str, ...]] = []
        self.objects: list[Any] = []
        self.starts = array.array("q")
        for module in modules:
            entries = getattr(module, attribute)
            self.starts.append(len(self.objects))
            if entries:
                keys = tuple(entries)
                self.names.append(shared.setdefault(keys, keys))
                self.objects.extend(entries.values())
            else:
                self.names.append(())
        self.starts.append(len(self.objects))

    def held(self, i: int) -> bool:
        """Module ``i`` held any entry."""
        return bool(self.names[i])

    def at(self, i: int) -> dict[str, Any]:
        """Module ``i``'s entries as they were."""
        return dict(zip(self.names[i], self.objects[self.starts[i] : self.starts[i + 1]]))

    def same(self, i: int, current: Mapping[str, Any]) -> bool:
        """``current`` holds the same names and the same objects (by identity: == on tensors compares values)."""
        return _holds(current, self.names[i], self.objects[self.starts[i] : self.starts[i + 1]])


def _holds(current: Mapping[Any, Any], names: Sequence[Any], objects: Sequence[Any]) -> bool:
    """``current`` holds exactly these names, each with the same object (by identity: == on tensors compares
    values)."""
    if len(current) != len(names):
        return False
    if tuple(current) == tuple(names):  # the common case: same names in the same order
        return all(map(operator.is_, current.values(), objects))
    return all(current.get(name, _MISSING) is value for name, value in zip(names, objects))


_MISSING = object()


# A module's hook dicts (a forward hook's flags live in dicts of their own, keyed like the hooks).
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


_HOOK_LISTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


class HookDicts:
    """The hooks every module held, kept for the modules that held any (most hold none): a one-shot hook that
    removes itself when it fires, or a hook a forward registers, would otherwise leave the model's hooks other than
    they were."""

    __slots__ = ("saved",)

    def __init__(self, modules: list[nn.Module]) -> None:
        self.saved: dict[int, tuple[Any, ...]] = {}
        for i, module in enumerate(modules):
            d = module.__dict__
            if any(d.get(name) for name in _HOOK_LISTS):  # (the flags' dicts hold entries only beside a hook)
                self.saved[i] = tuple(dict(d[name]) if isinstance(d.get(name), dict) else None for name in _HOOK_DICTS)

    def put_back(self, modules: list[nn.Module]) -> bool:
        """Every module's hook dicts hold what they held (the same dict objects, their entries put back); True
        when any had changed."""
        changed = False
        saved = self.saved
        for i, module in enumerate(modules):
            before = saved.get(i)
            d = module.__dict__
            if before is None and not any(d.get(name) for name in _HOOK_LISTS):
                continue
            for k, name in enumerate(_HOOK_DICTS):
                current = d.get(name)
                if not isinstance(current, dict):
                    continue
                want = before[k] if before is not None else None
                if want is None:
                    if current:
                        current.clear()
                        changed = True
                elif not _holds(current, tuple(want), tuple(want.values())):
                    current.clear()
                    current.update(want)
                    changed = True
        return changed
