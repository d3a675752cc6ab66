"""The pass's gradient hooks, one small object per hooked tensor.

A pass hangs one gradient hook per module output and one per parameter: twenty thousand on a model of ten
thousand small modules, all alive until the backward ends. A ``functools.partial`` of a bound method with its
arguments costs about 320 bytes each (the partial, its argument tuple, the bound method); these slotted objects
cost about 110, which is most of what the hooks themselves add to a pass's peak memory there.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch

from ..records import GradKind


class Recorder(Protocol):
    """What the hooks call (``capture.hooks.Recorder``; named here so that this module never imports it)."""

    def _receive(self, kind: GradKind, index: int, path: str, via_base: bool, grad: torch.Tensor) -> None: ...

    def _param_grad(self, name: str, grad: torch.Tensor) -> Optional[torch.Tensor]: ...


class OutputGradHook:
    """``recorder._receive(kind, index, path, via_base, grad)``: the gradient of one module input or output."""

    __slots__ = ("recorder", "kind", "index", "path", "via_base")

    def __init__(self, recorder: Recorder, kind: GradKind, index: int, path: str, via_base: bool) -> None:
        self.recorder = recorder
        self.kind: GradKind = kind
        self.index = index
        self.path = path
        self.via_base = via_base

    def __call__(self, grad: torch.Tensor) -> None:
        self.recorder._receive(self.kind, self.index, self.path, self.via_base, grad)


class ParamGradHook:
    """``recorder._param_grad(name, grad)``: the gradient of one parameter (the hook's return replaces it)."""

    __slots__ = ("recorder", "name")

    def __init__(self, recorder: Recorder, name: str) -> None:
        self.recorder = recorder
        self.name = name

    def __call__(self, grad: torch.Tensor) -> Optional[torch.Tensor]:
        return self.recorder._param_grad(self.name, grad)
