"""Fixes applied to a live model: run named modules in float32 while AMP stays on everywhere else."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..capture.dtypes import LOW_DTYPES, model_device_type, upcast
from ..capture.model import find_module, unwrap_model
from .patching import ForwardPatch


class Fp32Fallback(ForwardPatch):
    """Runs the named modules with autocast disabled and their low-precision floating inputs cast to float32.

    Parameters stored in a low precision (``model.half()``, ``torch_dtype=float16``) are cast too, at run time and
    for the forward call only: the module sees float32 copies (on the autograd graph, so the stored parameters
    still get their gradients, in their own dtype), and its own parameters are back in place when the call
    returns or raises. Use as a context manager, or keep the handle and call ``remove()``; either way the modules'
    ``forward`` attributes are put back exactly as they were (an instance attribute is restored, a class method is
    uncovered again). Parameters and hooks are never replaced for longer than one call.
    """

    def __init__(self, model: nn.Module, modules: Iterable[str]) -> None:
        super().__init__()
        root, _ = unwrap_model(model)
        names = [modules] if isinstance(modules, str) else list(modules)
        self.modules = names
        self._patch([(name, find_module(root, name)) for name in names])

    def _wrap(self, key: Any, module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        def fp32_forward(*args: Any, **kwargs: Any) -> Any:
            with torch.autocast(model_device_type(module, (args, kwargs)), enabled=False), _fp32_params(module):
                return forward(*tree_map(upcast, args), **tree_map(upcast, kwargs))

        fp32_forward.__wrapped__ = forward  # type: ignore[attr-defined]
        return fp32_forward


@contextlib.contextmanager
def _fp32_params(module: nn.Module) -> Iterator[None]:
    """For the duration of one call: the module's low-precision parameters (its submodules' too) replaced in their
    modules' parameter tables by float32 copies on the graph (a tied parameter gets one copy); the stored
    ``Parameter`` objects are put back afterwards, untouched."""
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    copies: dict[int, torch.Tensor] = {}
    try:
        for owner in module.modules():
            for name, param in list(owner._parameters.items()):
                if param is None or param.dtype not in LOW_DTYPES:
                    continue
                copy = copies.get(id(param))
                if copy is None:
                    copy = copies[id(param)] = param.float()
                swapped.append((owner, name, param))
                owner._parameters[name] = copy  # type: ignore[assignment]
        yield
    finally:
        for owner, name, param in reversed(swapped):
            owner._parameters[name] = param


def fp32_fallback(model: nn.Module, modules: Iterable[str]) -> Fp32Fallback:
    """Run ``modules`` (names as in the report) in float32; returns a handle with ``.remove()``.

    >>> with ampdoctor.fp32_fallback(model, ["encoder.layers.3.self_attn"]):
    ...     train_step()
    """
    return Fp32Fallback(model, modules)
