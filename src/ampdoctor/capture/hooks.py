"""Hooks on a live model: every module call seen (an instance ``forward`` wrapper where that sees what hooks would,
:mod:`.call_wrappers`; forward hooks elsewhere), gradient hooks on what the calls return.

Every handle is kept and removed by :meth:`Recorder.remove` (the pass calls it in ``finally``). Hooks never
raise inside the user's forward or backward: they record the failure, and the pass raises after it.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import weakref
from typing import Any, NamedTuple, Optional

import torch
from torch import nn

from ..records import GradKind
from .call_wrappers import PassForwards, wrappers_fit
from .cleanup import uninterrupted
from .grad_hooks import OutputGradHook, ParamGradHook
from .internal import _internal
from .node_calls import NodeCalls
from .reference import FloatReference
from .state import RngState
from .stats import StatsCollector, measurable
from .tensor_hooks import (
    drop_empty_hook_dict,
    drop_forward_hooks,
    hang_tensor_hook,
    hook_dicts_work,
    register_grad_hook,
    register_post_hook,
    reserve_forward_ids,
    set_forward_hooks,
)
from .walk import in_transform as _in_transform
from .walk import iter_tensors
from .zoom import OpZoom


class _OpenCall:
    """A module call as the hooks see it (slots: one of these per call, made in the hot path)."""

    __slots__ = ("index", "module", "call", "class_name", "parent", "inputs", "outputs", "end_order", "grad_enabled")

    def __init__(
        self,
        index: int,
        module: str,
        call: int,
        class_name: str,
        parent: Optional[int],
        inputs: list[tuple[str, int, bool, Optional[int], str]],
        grad_enabled: bool = True,
    ) -> None:
        self.index = index
        self.module = module
        self.call = call
        self.class_name = class_name
        self.parent = parent
        self.inputs = inputs
        self.outputs: list[tuple[str, int, bool]] = []
        self.end_order = -1
        self.grad_enabled = grad_enabled  # False inside torch.no_grad() (a reentrant checkpoint's first forward)


class GradSeen(NamedTuple):
    """A gradient seen during a backward: ``slot`` in the pass's collector, ``histogram`` index or -1 (parameter
    gradients; the low-precision activation gradients' histograms are summed in the collector)."""

    order: int
    kind: GradKind
    slot: int
    call: Optional[int]
    path: str
    param: Optional[str]
    via_base: bool
    histogram: int = -1


# Small parameter gradients wait in a stash (their statistics are taken together) up to this many elements in all;
# larger ones are measured at once. Each is replaced in the backward by a zero-stride view, so no pass keeps a
# whole model's gradients alive (a training step does).
STASH_ELEMENTS = 1 << 20
STASH_EACH = 1 << 16
_ARG_PATHS = tuple(f"args[{i}]" for i in range(16))


class Recorder:
    """Installs forward hooks on every module and gradient hooks on what they return; records plain numbers.

    One forward, then one or more backwards on its graph (each with its own collector: :meth:`next_backward`).
    """

    def __init__(
        self,
        names: dict[int, str],
        modules: list[nn.Module],
        collector: StatsCollector,
        record_grads: bool,
        zoom: Optional[tuple[str, int]] = None,
        reference: Optional[FloatReference] = None,
        histograms: int = 0,
    ) -> None:
        self.reference = reference
        self.in_backward = False
        self.names = names
        self.modules = modules
        self.collector = collector
        self.record_grads = record_grads
        # Binade histograms (loss-scale predictions): 0 none, 1 of parameter gradients, 2 of every gradient held in
        # the low precision too.
        self.histograms = histograms
        self.zoom_target = zoom
        self.zoom: Optional[OpZoom] = None
        self._zoom_call: Optional[int] = None
        self.calls: list[_OpenCall] = []
        self.stack: list[int] = []
        self.counts: dict[str, int] = {}
        self.grads: list[GradSeen] = []
        self.error: Optional[BaseException] = None
        self.last_module: Optional[str] = None
        self.raised_inside: Optional[str] = None  # the innermost call a raise ended (for ModelRaised's message)
        self.used_inside: list[tuple[int, str]] = []  # (root call, output path): see outputs_inside
        self.node_calls: Optional[NodeCalls] = None  # set where a backward op zoom names calls (node_calls)
        self._unwound: Optional[int] = None
        self._ends = itertools.count()
        self._grad_order = itertools.count()
        self._producers: dict[int, tuple[weakref.ref[torch.Tensor], int, str]] = {}
        self._handles: list[Any] = []
        self._hung: list[tuple[Any, int]] = []  # tensor hooks hung by hang_tensor_hook: (their dict, their id)
        self._bare: list[torch.Tensor] = []  # leaves (parameters) that had no hook dict before the pass
        self._module_handles: list[Any] = []
        self._hooked: list[nn.Module] = []  # modules holding the pass's forward hooks under ``_hook_ids``
        self._hook_ids = (-1, -1)
        self._wrappers: Optional[PassForwards] = None  # instance forwards instead of hooks (call_wrappers)
        self._recompute: list[int] = []  # original call index of each re-run in progress (-1 unmatched, -2 ignored)
        self._matched: set[int] = set()
        self.uncaptured: list[str] = []  # re-run calls that could not be matched to their original call
        self.transformed_calls = 0  # module calls inside a torch.func transform (vmap): not measured
        self._stash: list[tuple[int, str, torch.Tensor]] = []
        self._stashed = 0
        # The hidden-overflow watch's pause (capture.hidden.Paused), set by the pass that installs the watch.
        self.paused: Any = _NOT_PAUSED

    # install / remove (a Ctrl-C waits until a handle is recorded, or until every handle is removed)
    @uninterrupted
    def install(self, params: list[tuple[str, nn.Parameter]]) -> None:
        pre, post = self._pre, self._post  # one bound method each for every module
        # No handle object per module (two on each of ten thousand modules): one hook id per kind for the whole
        # pass and torch's own dict entries (set_forward_hooks); drop_forward_hooks takes them out again. A module
        # class with its own registration is asked as usual.
        ids = self._hook_ids = reserve_forward_ids()
        hooked = self._hooked
        dicts = hook_dicts_work()
        # Where a wrapper sees what the hooks would, an instance forward instead (torch keeps its hook-free call
        # path: most of the pass's cost per module on a model of many small ones; see call_wrappers).
        wrappers = self._wrappers = PassForwards(pre, post, self._raised) if wrappers_fit(self.modules) else None
        for module in self.modules:
            own_registration = type(module).register_forward_pre_hook is not _REGISTER_PRE or type(
                module
            ).register_forward_hook is not _REGISTER_POST
            if wrappers is not None and not own_registration and wrappers.fits(module):
                wrappers.wrap(module)
                continue
            if not dicts or own_registration:
                self._module_handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
                self._module_handles.append(register_post_hook(module, post))
                continue
            hooked.append(module)  # first: an interrupted install is still undone by drop_forward_hooks
            set_forward_hooks(module, ids, pre, post)
        if self.record_grads:
            hung = self._hung
            # Leaves that had no hook dict: they get none back either (tensor_hooks.drop_empty_hook_dict).
            self._bare += [p for _, p in params if p.requires_grad and p._backward_hooks is None]
            for name, param in params:
                if param.requires_grad:
                    hook = ParamGradHook(self, name)
                    entry = hang_tensor_hook(param, hook)
                    if entry is None:
                        self._handles.append(param.register_hook(hook))
                    else:
                        hung.append(entry)

    @uninterrupted
    def remove(self) -> None:
        """Idempotent: every hook removed, the zoom closed."""
        self.drop_forward_hooks()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for hooks, hook_id in self._hung:
            hooks.pop(hook_id, None)
        self._hung.clear()
        for leaf in self._bare:
            drop_empty_hook_dict(leaf)
        self._bare.clear()
        self._stash.clear()
        self.close_zoom()

    @uninterrupted
    def drop_forward_hooks(self) -> None:
        """Remove the modules' forward hooks (idempotent) once no forward of this pass can run any more: a graph
        kept for more backwards needs only its gradient hooks (a re-run forward inside a backward, activation
        checkpointing's, makes such a graph unrepeatable)."""
        for handle in self._module_handles:
            handle.remove()
        self._module_handles.clear()
        for module in self._hooked:
            drop_forward_hooks(module, self._hook_ids)
        self._hooked.clear()
        if self._wrappers is not None:
            self._wrappers.remove()
            self._wrappers = None  # its wrappers call this recorder's methods: a cycle the cyclic collector frees
        self._producers.clear()

    @uninterrupted
    def close_zoom(self, output: Any = None) -> None:
        if self.zoom is not None and self._zoom_call is not None:
            self._zoom_call = None
            if output is not None:
                self.zoom.finish(output)  # name the op behind what the call returned
            self.zoom.__exit__(None, None, None)

    def next_backward(self, collector: StatsCollector) -> None:
        """Another backward on the same graph: its gradients go to ``collector``, numbered from 0 again."""
        self.collector = collector
        self.grads = []
        self._grad_order = itertools.count()

    @property
    def ran_without_grad(self) -> bool:
        """Some call ran under no_grad inside the pass: a reentrant checkpoint (or an explicit no_grad region)."""
        return any(not c.grad_enabled for c in self.calls)

    # activation checkpointing: forwards re-run during backward
    def _recompute_pre(self, module: nn.Module) -> None:
        """A forward re-run during backward is no new call. A reentrant checkpoint's re-run is where its region's
        gradients flow (its first forward ran under no_grad): match it to the original call and hook its outputs.
        A non-reentrant re-run is ignored (the original outputs carry the hooks)."""
        name = self.names.get(id(module), "?")
        top = self._recompute[-1] if self._recompute else None
        if top is not None and top < 0:  # inside an ignored (-2) or unmatched (-1) re-run
            self._recompute.append(top)
            return
        pending = [c for c in self.calls if c.module == name and not c.grad_enabled and c.index not in self._matched]
        if top is not None:
            match = next((c for c in pending if c.parent == top), None)
        else:  # a region's root: regions re-run last first
            roots = [c for c in pending if c.parent is None or self.calls[c.parent].grad_enabled]
            match = roots[-1] if roots else None
        if match is not None:
            self._matched.add(match.index)
            self._recompute.append(match.index)
        elif any(c.module == name and not c.grad_enabled for c in self.calls):
            self.uncaptured.append(name or "<root>")
            self._recompute.append(-1)
        else:
            self._recompute.append(-2)

    def _recompute_post(self, output: Any) -> None:
        index = self._recompute.pop() if self._recompute else -2
        if index < 0:
            return
        for path, t in iter_tensors(output, "out"):
            if t.requires_grad and t.is_floating_point():
                self._grad_hook(t, "output", index, path)

    # forward
    def _pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        # The hook's own tensor reads are not the model's ops: the op zoom skips them, and no torch-function mode
        # sees them (the hidden-overflow watch, the copy-on-write guard: a few ops per tensor, each a trip through
        # Python otherwise). A float32 reference re-runs the model's own code in the hook: under the guard, so
        # only the watch steps aside then.
        # (INTERNAL written out inline: these run twice per module call.)
        if _in_transform():  # a module called by vmap (and its post-hook, likewise): values only vmap can read
            self.transformed_calls += 1
            return
        depth = getattr(_internal, "depth", 0)
        _internal.depth = depth + 1
        try:
            with self.paused if self.reference is not None else _DisableTorchFunction():
                self._enter(module, args, kwargs)
        finally:
            _internal.depth = depth

    def _post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if _in_transform():
            return
        depth = getattr(_internal, "depth", 0)
        _internal.depth = depth + 1
        try:
            with self.paused if self.reference is not None else _DisableTorchFunction():
                self._exit(module, args, kwargs, output)
        finally:
            _internal.depth = depth

    def _raised(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """A forward that raised, which the model's code may catch (a fallback): its call ends there, without outputs
        (as ``always_call`` hooks see it); left open, it took the calls and ops after it and its parent's outputs."""
        self._post(module, args, kwargs, None)

    def _enter(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.reference is not None and self.reference.busy:
            return  # a float32 re-run of ours: no call of the AMP forward
        if self.in_backward:
            if self.record_grads and torch.is_grad_enabled():
                try:
                    self._recompute_pre(module)
                except Exception as exc:
                    self.error = self.error or exc
            return
        try:
            name = self.names.get(id(module), "?")
            counts = self.counts
            number = counts.get(name, 0)
            counts[name] = number + 1
            index = len(self.calls)
            inputs: list[tuple[str, int, bool, Optional[int], str]] = []
            if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor:
                pairs: Any = ((_ARG_PATHS[0], args[0]),)  # the commonest case
            elif not kwargs and len(args) <= len(_ARG_PATHS) and all(type(a) is torch.Tensor for a in args):
                pairs = zip(_ARG_PATHS, args)  # the common case, without walking
            else:
                pairs = itertools.chain(iter_tensors(args, "args"), iter_tensors(kwargs, "kwargs"))
            add = self.collector.add
            producers = self._producers
            for path, t in pairs:
                slot = add(t)
                seen = producers.get(id(t))  # the earlier call that returned this very tensor
                if seen is not None and seen[0]() is t:
                    producer, producer_path = seen[1], seen[2]
                else:
                    producer, producer_path = None, ""
                requires_grad = t.requires_grad
                inputs.append((path, slot, requires_grad, producer, producer_path))
                # An input returned by an earlier call already has that call's output hook: the very same
                # gradient, so analysis reads it from there instead of a second hook.
                if requires_grad and producer is None and self.record_grads and t.is_floating_point():
                    self._grad_hook(t, "input", index, path)
            parent = self.stack[-1] if self.stack else None
            self.calls.append(
                _OpenCall(index, name, number, type(module).__name__, parent, inputs, torch.is_grad_enabled())
            )
            self.stack.append(index)
            if self.node_calls is not None:
                self.node_calls.enter(index)
            if self.reference is not None and self.reference.wants(module, name):
                self.reference.pending[index] = (args, kwargs, RngState.capture())
            self.last_module = name
            if self.zoom_target is not None and self.zoom_target == (name, number) and self.zoom is None:
                self._open_zoom(name, number, index)
        except Exception as exc:  # never raise inside the user's forward
            self.error = self.error or exc

    @uninterrupted
    def _open_zoom(self, name: str, number: int, index: int) -> None:
        self.zoom = OpZoom(name, number)
        self._zoom_call = index
        self.zoom.__enter__()

    def _exit(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.reference is not None and self.reference.busy:
            return
        if self.in_backward:
            if self.record_grads and torch.is_grad_enabled():
                try:
                    self._recompute_post(output)
                except Exception as exc:
                    self.error = self.error or exc
            return
        try:
            if not self.stack:
                return
            index = self.stack.pop()
            call = self.calls[index]
            if self.node_calls is not None:
                self.node_calls.exit(index, call.module, call.call)
            pending = self.reference.pending.pop(index, None) if self.reference is not None else None
            if pending is not None and output is not None:  # (None: it raised; its re-run would raise again)
                self.reference.compare(module, call.module, call.call, pending, output)  # type: ignore[union-attr]
            if self._zoom_call == index:
                self.close_zoom(output)
            pairs = (("out", output),) if type(output) is torch.Tensor else iter_tensors(output, "out")
            add = self.collector.add
            producers = self._producers
            for path, t in pairs:
                slot = add(t)
                requires_grad = t.requires_grad
                call.outputs.append((path, slot, requires_grad))
                try:  # which call returned this very tensor
                    producers[id(t)] = (weakref.ref(t), index, path)
                except TypeError:
                    pass
                if requires_grad and self.record_grads and t.is_floating_point():
                    self._grad_hook(t, "output", index, path)
            call.end_order = next(self._ends)
            if output is None and sys.exc_info()[1] is not None:  # raised (not a forward that returned None)
                self._note_unwound(index)
        except Exception as exc:
            self.error = self.error or exc

    def _note_unwound(self, index: int) -> None:
        """A call ended without output: of the calls a raise passes through (each the parent of the one before,
        ending right after it), the first is where it came from."""
        calls, last = self.calls, self._unwound
        if last is None or calls[last].parent != index or calls[last].end_order != calls[index].end_order - 1:
            self.raised_inside = calls[index].module
        self._unwound = index

    # backward
    @uninterrupted
    def _grad_hook(self, t: torch.Tensor, kind: GradKind, index: int, path: str) -> None:
        base = t._base
        via_base = base is not None and base.requires_grad
        receive = OutputGradHook(self, kind, index, path, via_base)
        if base is None:
            if t.grad_fn is None and t._backward_hooks is None:  # a parameter passed in or handed back
                self._bare.append(t)
            entry = hang_tensor_hook(t, receive)
            if entry is not None:
                self._hung.append(entry)
                return
        handle, _ = register_grad_hook(t, receive)
        self._handles.append(handle)

    def _receive(self, kind: GradKind, index: int, path: str, via_base: bool, grad: torch.Tensor) -> None:
        try:
            if grad.layout is not torch.strided:
                grad = measurable(grad)
            # Gradients held in the low precision go into the pass's one summed histogram (loss-scale predictions).
            collector = self.collector
            slot = collector.add_fresh(grad, self.histograms > 1 and grad.dtype == collector.low_dtype)
            self.grads.append(GradSeen(next(self._grad_order), kind, slot, index, path, None, via_base))
        except Exception as exc:
            self.error = self.error or exc

    def _param_grad(self, name: str, grad: torch.Tensor) -> Optional[torch.Tensor]:
        """A parameter's gradient: its order now, its statistics from the stash; the backward gets a zero-stride
        stand-in (nothing reads it), so the real gradient is freed once measured. A sparse gradient
        (``nn.Embedding(sparse=True)``) is measured through its values and handed on unchanged: a hook never
        changes a gradient's layout or type."""
        sparse = grad.layout != torch.strided
        try:
            values = measurable(grad)
            self._stash.append((next(self._grad_order), name, values))
            self._stashed += values.numel()
            if self._stashed >= STASH_ELEMENTS or values.numel() >= STASH_EACH:
                self.flush_params()
        except Exception as exc:
            self.error = self.error or exc
        return None if sparse else _zeros_like(grad)

    def flush_params(self) -> None:
        """Measure the stashed parameter gradients (after a backward, or when the stash is full)."""
        if not self._stash:
            return
        measured = self.collector.add_many([grad for _, _, grad in self._stash], self.histograms > 0)
        for (order, name, _), (slot, hist) in zip(self._stash, measured):
            self.grads.append(GradSeen(order, "param", slot, None, "grad", name, False, hist))
        self._stash.clear()
        self._stashed = 0


_NOT_PAUSED = contextlib.nullcontext()
_REGISTER_PRE = nn.Module.register_forward_pre_hook
_REGISTER_POST = nn.Module.register_forward_hook
_DisableTorchFunction = torch._C.DisableTorchFunction


_ZEROS: dict[tuple[torch.dtype, torch.device, tuple[int, ...]], torch.Tensor] = {}


def _zeros_like(t: torch.Tensor) -> torch.Tensor:
    """A zero-stride view of one zero in ``t``'s shape: what a parameter-gradient hook hands on instead of the
    gradient (the pass never reads the returned gradients; autograd copies a view like this before it would
    accumulate into it). Cached per dtype, device and shape: a model's shapes come back in every backward."""
    key = (t.dtype, t.device, tuple(t.shape))
    zeros = _ZEROS.get(key)
    if zeros is None:
        if len(_ZEROS) > 256:
            _ZEROS.clear()
        zeros = _ZEROS[key] = torch.zeros((), dtype=t.dtype, device=t.device).expand(key[2])
    return zeros
