"""Hooks on a live model: forward hooks on every module, gradient hooks on what they return.

Every handle is kept and removed by :meth:`Recorder.remove` (the pass calls it in ``finally``). Hooks never
raise inside the user's forward or backward: they record the failure, and the pass raises after it.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..records import GradKind
from .reference import FloatReference
from .state import RngState
from .stats import StatsCollector
from .walk import iter_tensors
from .zoom import OpZoom


@dataclass
class _OpenCall:
    index: int
    module: str
    call: int
    class_name: str
    parent: Optional[int]
    inputs: list[tuple[str, int, bool, Optional[int], str]]
    outputs: list[tuple[str, int, bool]] = field(default_factory=list)
    end_order: int = -1


@dataclass
class _GradSeen:
    order: int
    kind: GradKind
    slot: int
    call: Optional[int]
    path: str
    param: Optional[str]
    via_base: bool


def register_grad_hook(t: torch.Tensor, receive: Callable[[torch.Tensor], None]) -> tuple[Any, bool]:
    """Hang a gradient hook on ``t`` that calls ``receive(gradient of t)``; returns (handle, hung on the base).

    A hook on a view never fires once a later op modifies the view in place (``ReLU(inplace=True)`` after a
    ``Linear`` on 3-D input); one on the view's base does, with the base's gradient, which is mapped back onto
    the view when the view covers only part of the base. The closure holds plain values only: it lives on the
    autograd graph and must not keep activations alive.
    """
    target, view = t, None
    base = t._base
    if base is not None and base.requires_grad:
        target = base
        if base.numel() != t.numel():
            view = (tuple(t.size()), tuple(t.stride()), t.storage_offset() - base.storage_offset())
    target_shape = target.shape

    def hook(grad: torch.Tensor) -> None:
        g = grad
        if view is not None and grad.is_contiguous() and grad.shape == target_shape:
            g = grad.as_strided(view[0], view[1], grad.storage_offset() + view[2])
        receive(g)

    return target.register_hook(hook), target is not t


class Recorder:
    """Installs forward hooks on every module and gradient hooks on what they return; records plain numbers."""

    def __init__(
        self,
        names: dict[int, str],
        modules: list[nn.Module],
        collector: StatsCollector,
        record_grads: bool,
        zoom: Optional[tuple[str, int]] = None,
        reference: Optional[FloatReference] = None,
    ) -> None:
        self.reference = reference
        self.in_backward = False
        self.names = names
        self.modules = modules
        self.collector = collector
        self.record_grads = record_grads
        self.zoom_target = zoom
        self.zoom: Optional[OpZoom] = None
        self._zoom_call: Optional[int] = None
        self.calls: list[_OpenCall] = []
        self.stack: list[int] = []
        self.counts: dict[str, int] = {}
        self.grads: list[_GradSeen] = []
        self.error: Optional[BaseException] = None
        self.last_module: Optional[str] = None
        self._ends = itertools.count()
        self._grad_order = itertools.count()
        self._producers: dict[int, tuple[weakref.ref[torch.Tensor], int, str]] = {}
        self._handles: list[Any] = []

    # install / remove
    def install(self, params: list[tuple[str, nn.Parameter]]) -> None:
        for module in self.modules:
            self._handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post, with_kwargs=True))
        if self.record_grads:
            for name, param in params:
                if param.requires_grad:
                    self._handles.append(param.register_hook(self._param_hook(name)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.close_zoom()

    def close_zoom(self) -> None:
        if self.zoom is not None and self._zoom_call is not None:
            self._zoom_call = None
            self.zoom.__exit__(None, None, None)

    # forward
    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.in_backward or (self.reference is not None and self.reference.busy):
            # Activation checkpointing re-runs forwards during backward; a float32 re-run is ours: neither is
            # a call of the AMP forward.
            return
        try:
            name = self.names.get(id(module), "?")
            number = self.counts.get(name, 0)
            self.counts[name] = number + 1
            index = len(self.calls)
            inputs = []
            for path, t in itertools.chain(iter_tensors(args, "args"), iter_tensors(kwargs, "kwargs")):
                slot = self.collector.add(t)
                producer, producer_path = self._producer(t)
                inputs.append((path, slot, bool(t.requires_grad), producer, producer_path))
                # An input returned by an earlier call already has that call's output hook: the very same
                # gradient, so analysis reads it from there instead of a second hook.
                if self.record_grads and t.requires_grad and t.is_floating_point() and producer is None:
                    self._grad_hook(t, "input", index, path)
            parent = self.stack[-1] if self.stack else None
            self.calls.append(_OpenCall(index, name, number, type(module).__name__, parent, inputs))
            self.stack.append(index)
            if self.reference is not None and self.reference.wants(module, name):
                self.reference.pending[index] = (args, kwargs, RngState.capture())
            self.last_module = name
            if self.zoom_target == (name, number) and self.zoom is None:
                self.zoom = OpZoom(name, number)
                self._zoom_call = index
                self.zoom.__enter__()
        except Exception as exc:  # never raise inside the user's forward
            self.error = self.error or exc

    def _post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.in_backward or (self.reference is not None and self.reference.busy):
            return
        try:
            if not self.stack:
                return
            index = self.stack.pop()
            if self.reference is not None and index in self.reference.pending:
                call = self.calls[index]
                self.reference.compare(module, call.module, call.call, self.reference.pending.pop(index), output)
            if self._zoom_call == index:
                self.close_zoom()
            call = self.calls[index]
            for path, t in iter_tensors(output, "out"):
                slot = self.collector.add(t)
                call.outputs.append((path, slot, bool(t.requires_grad)))
                self._remember_producer(t, index, path)
                if self.record_grads and t.requires_grad and t.is_floating_point():
                    self._grad_hook(t, "output", index, path)
            call.end_order = next(self._ends)
        except Exception as exc:
            self.error = self.error or exc

    def _producer(self, t: torch.Tensor) -> tuple[Optional[int], str]:
        """The earlier call that returned this very tensor, and where in its output it sat."""
        seen = self._producers.get(id(t))
        if seen is not None and seen[0]() is t:
            return seen[1], seen[2]
        return None, ""

    def _remember_producer(self, t: torch.Tensor, index: int, path: str) -> None:
        try:
            self._producers[id(t)] = (weakref.ref(t), index, path)
        except TypeError:
            pass

    # backward
    def _grad_hook(self, t: torch.Tensor, kind: GradKind, index: int, path: str) -> None:
        via_base = False

        def receive(g: torch.Tensor) -> None:
            try:
                slot = self.collector.add(g)
                self.grads.append(_GradSeen(next(self._grad_order), kind, slot, index, path, None, via_base))
            except Exception as exc:
                self.error = self.error or exc

        handle, via_base = register_grad_hook(t, receive)
        self._handles.append(handle)

    def _param_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            try:
                slot = self.collector.add(grad)
                self.grads.append(_GradSeen(next(self._grad_order), "param", slot, None, "grad", name, False))
            except Exception as exc:
                self.error = self.error or exc

        return hook

