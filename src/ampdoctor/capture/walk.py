"""Walking the nested inputs and outputs of a module call, and calling a model on a batch."""

from __future__ import annotations

import dataclasses
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

