"""Walking the nested inputs and outputs of a module call, and calling a model on a batch."""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

_MAX_WALK_DEPTH = 8


def iter_tensors(obj: Any, path: str, _depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(path, tensor)`` for every tensor in tuples, lists, dicts, dataclasses and ``ModelOutput``s."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    if _depth >= _MAX_WALK_DEPTH or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    if isinstance(obj, Mapping):  # dicts, and Hugging Face ModelOutput (an OrderedDict)
        for key, value in obj.items():
            yield from iter_tensors(value, f"{path}[{key!r}]", _depth + 1)
    elif isinstance(obj, (list, tuple)):
        names = getattr(obj, "_fields", None)  # namedtuple
        for i, value in enumerate(obj):
            sub = f"{path}.{names[i]}" if names else f"{path}[{i}]"
            yield from iter_tensors(value, sub, _depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name, None), f"{path}.{f.name}", _depth + 1)
    elif not isinstance(obj, (type, nn.Module)) and isinstance(getattr(obj, "__dict__", None), dict):
        # Plain result objects (torch_geometric Data, detectron2 Instances, a user's Box): their attributes.
        for key, value in list(vars(obj).items()):
            if not key.startswith("__"):
                yield from iter_tensors(value, f"{path}.{key}", _depth + 1)


def call_model(model: nn.Module, batch: Any) -> Any:
    """A Tensor → ``model(batch)``, a tuple/list → ``model(*batch)``, a dict → ``model(**batch)``."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


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
        deepest = max(deepest, depth)
        todo.extend((child, depth + 1) for child in module._modules.values() if child is not None)
    return deepest


class RecursionRoom:
    """Room on the Python stack for what instrumentation adds per nesting level: torch calls a module with
    hooks through one more frame than a plain call, so a model that runs plain at 200 nested levels would hit
    the recursion limit under hooks. The limit is raised by that much while the passes run (never lowered),
    and put back when the last user leaves (unless someone else changed it meanwhile)."""

    def __init__(self, root: nn.Module) -> None:
        self.extra = module_depth(root) * _HOOK_FRAMES_PER_LEVEL + _OWN_FRAMES
        self.entered = False

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

    def __exit__(self, *exc: Any) -> None:
        """Idempotent: the last user puts the limit back, unless something else set it meanwhile."""
        with _room_lock:
            if not self.entered:
                return
            self.entered = False
            _room[0] -= 1
            if _room[0] == 0 and sys.getrecursionlimit() == _room[2]:
                sys.setrecursionlimit(_room[1])
