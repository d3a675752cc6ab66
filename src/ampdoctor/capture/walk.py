"""Walking the nested inputs and outputs of a module call, and calling a model on a batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

_MAX_WALK_DEPTH = 8

# torch.func's transforms (vmap, grad, jvp): the tensors a transformed function sees are wrappers whose values
# exist only inside it (a statistic of one, read after the transform, fails: "your tensor may have escaped").
_interpreters = torch._C._functorch.peek_interpreter_stack
_is_transformed = torch._C._functorch.is_functorch_wrapped_tensor


def transformed(t: torch.Tensor) -> bool:
    """``t`` is a tensor inside a ``torch.func`` transform (``vmap``'s batched tensors, ``grad``'s)."""
    return bool(_is_transformed(t))


def in_transform() -> bool:
    """Code inside a ``torch.func`` transform runs now (a module called by ``vmap``)."""
    return _interpreters() is not None


def transform_note(calls: int, ops: int) -> tuple[str, ...]:
    """The pass's note on what ran inside ``torch.func`` transforms, unmeasured (none: no note)."""
    if not calls and not ops:
        return ()
    return (
        f"{calls} module call(s) and {ops} op(s) ran inside a torch.func transform (vmap, grad, jvp) and were not "
        "measured: their values exist only inside the transform; what the transformed function returns is measured "
        "where it leaves it",
    )


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


