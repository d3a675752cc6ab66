"""The watch's hooks on the model: the root's on every step, every module's on sampled steps.

* **Root** (every step, cheap): the inputs (by reference, for a replay), every RNG stream before the forward, the
  outputs' min/max, and the gradient the loss sends into each output (kept until the step ends, up to a size
  cap, for a capture to replay the step's own backward). A compiled root is tapped outside its graph
  (:class:`~.compiled.RootTap`).
* **Modules** (sampled steps): every module's outputs, by an instance ``forward`` wrapper that keeps torch's fast
  call path (:mod:`.forwards`; a forward hook where a wrapper cannot go), and gradient hooks on what they return
  (on a view's base, never a module-level backward hook), installed only for those steps. A compiled model gets
  :class:`~.compiled.CompiledStats` instead: hooks registered once, gated by a flag.
* **Tracked modules** (unsampled steps): the same on the few tightest modules only (the forecast's
  watchlist, :mod:`.lookout`), so their headroom trend is seen every step at the cost of a few reductions.
* **Never ampdoctor's own passes** (:mod:`.quiet`): a forward of a capture or of a user's ``diagnose`` is not a
  training forward; neither is an evaluation forward (no grad).
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import nullcontext
from typing import Any, Optional, Protocol

import torch
from torch import nn

from ..capture.call_wrappers import wrappable_class
from ..capture.cleanup import uninterrupted
from ..capture.dtypes import autocast_dtype
from ..capture.hooks import register_grad_hook
from ..capture.tensor_hooks import hook_dicts_work
from ..capture.walk import in_transform, iter_tensors
from .compiled import CompiledStats, RootTap, is_compiled
from .fastpath import OWN_KEY, hang_grad_hook
from .forwards import ForwardTap, HookTap, Tap, has_forward_hooks, wrappers_fit
from .optrack import OpTracker
from .quiet import diagnosing, recomputing
from .readback import MicroBatch, PairKey, StepState, loss_value
from .replay_step import Capture, own_loss

_mode_on = torch._C._is_torch_function_mode_enabled


def unseen() -> Any:
    """Our own reads of the model's tensors, out of sight of any torch function mode running (a survey's, a tap's,
    the user's): they are no op of the model's. Nothing to enter when none runs (the common case)."""
    return torch._C.DisableTorchFunction() if torch._C._is_torch_function_mode_enabled() else nullcontext()


class WatchedRun(Protocol):
    """What the hooks read and call on the watch (``runtime.Watch``): named here, so hooks never import runtime."""

    model: nn.Module  # as the user passed it (a wrapper or a compiled module included)
    root: nn.Module  # the unwrapped module whose hooks the watch installs
    names: dict[int, str]  # id(module) -> qualified name
    active: bool  # inside a watched step
    device_type: str
    targets: Any  # the step's targets, detached (None between steps)
    scaler: Any  # the watched GradScaler, or None
    scaler_on: bool  # it is an enabled one (else nothing skips a step: steps close before the optimizer runs)
    _step: int  # the step number
    low: Optional[torch.dtype]  # the low-precision dtype of the run (None: not known yet)
    max_output_grad_bytes: int
    cur: StepState  # the step being recorded

    def fail(self, exc: BaseException) -> None: ...

# Root forwards kept per step for a replay (gradient accumulation); beyond this the oldest are dropped.
MAX_MICRO_BATCHES = 64


class WatchHooks:
    """Installs and runs the watch's hooks; the records go into the watch's current step."""

    def __init__(self, watch: WatchedRun) -> None:
        self.w = watch
        self.root_tap: Optional[RootTap] = None
        self.module_handles: list[Tap] = []
        self.wrappers = False  # eager: modules measured by forward wrappers (torch's fast path), not hooks
        self.compiled: Optional[CompiledStats] = None
        self.open = False  # a watched root forward is running
        self.grads_on = False  # this step is sampled: gradient hooks on module outputs
        self.all_modules = False  # every module's outputs are measured this step (sampled, or a dense window)
        self.probes: list[Any] = []  # one-shot hooks that look for autocast inside the first forward
        self.probed = False
        self.tracked: list[str] = []  # modules hooked on unsampled steps (the forecast's watchlist)
        self.tracked_handles: list[Tap] = []
        self.count_underflow = False  # sampled steps: count small gradient values too (a sink wants the share)
        self.dicts_ok = False  # gradient hooks may go straight into a tensor's own hook dict (checked at install)
        self._receivers: dict[tuple[str, bool], _GradReceiver] = {}
        self._probes: dict[int, _ModuleProbe] = {}  # per module: its forward hook, made once (no closure per step)
        self._captures_seen = 0
        self.ops = OpTracker(watch.root, watch.names, self._measure_op, lambda: self.open)  # per-op trends

    # -- installing -----------------------------------------------------------------------------------------
    @uninterrupted
    def install(self) -> None:
        w = self.w
        self.dicts_ok = hook_dicts_work()
        self.root_tap = RootTap(w.model, w.root, self.root_pre, self.root_post)
        if is_compiled(w.model, w.root):
            self.compiled = CompiledStats(w.root, w.names)
        self.wrappers = self.compiled is None and wrappers_fit(w.model, w.root)

    @uninterrupted
    def sample(self, on: bool, outputs: bool = False) -> None:
        """Module statistics for the next step: eager hooks installed only for it (an unsampled step runs the
        model's fast path); a compiled model's hooks stay, switched by their flag at each root forward.
        ``outputs``: every module's outputs without their gradients (the forecast's dense window, eager only)."""
        self.grads_on = on
        self.all_modules = on or (outputs and self.compiled is None)
        if self.compiled is not None:
            if on:
                self.compiled.reset()
            return
        on = self.all_modules
        if on and not self.module_handles:
            self.remove_tracked()
            for module in self.w.root.modules():
                if module is not self.w.root:
                    self.module_handles.append(self.tap(module))
        elif not on:
            if self.module_handles:
                self.remove_modules()
            if self.tracked and not self.tracked_handles:
                modules = dict(self.w.root.named_modules())
                self.tracked_handles = [self.tap(modules[name]) for name in self.tracked if name in modules]

    def looked(self, tracked: Optional[list[str]], seen: dict[str, float], captures: list[Capture]) -> None:
        """After a step's forecast: the tracked modules (``tracked``: a new list, or None) and the followed ops (from
        a surveyed step's maxima ``seen``, and the hidden overflows of captures not seen before) for the next."""
        if self.compiled is not None:
            return
        if tracked is not None:
            self.track(tracked)
        if self.ops.surveyed:
            self.ops.flag_from_survey(seen)
        for capture in captures[self._captures_seen :]:
            self.ops.flag_ops([(o.module, o.op, o.occurrence) for o in capture.report.trace.op_overflows])
        self._captures_seen = len(captures)

    def track(self, names: list[str]) -> None:
        """Hook these modules on unsampled steps from the next one on (the forecast's watchlist)."""
        if names != self.tracked:
            self.remove_tracked()
            self.tracked = [n for n in names if n]

    @uninterrupted
    def remove_tracked(self) -> None:
        for handle in self.tracked_handles:
            handle.remove()
        self.tracked_handles.clear()

    @uninterrupted
    def remove_modules(self) -> None:
        for handle in self.module_handles:
            handle.remove()
        self.module_handles.clear()

    @uninterrupted
    def remove_probes(self) -> None:
        for handle in self.probes:
            handle.remove()
        self.probes.clear()

    def _measure_op(self, key: str, t: torch.Tensor) -> None:
        self.w.cur.collector.pair("op", key, t, t.dtype == self.w.low)

    @uninterrupted
    def remove(self) -> None:
        self.ops.close()
        self.remove_modules()
        self.remove_tracked()
        self.remove_probes()
        if self.compiled is not None:
            self.compiled.remove()
            self.compiled = None
        if self.root_tap is not None:
            self.root_tap.remove()
            self.root_tap = None
        self.open = False

    # -- the root -------------------------------------------------------------------------------------------
    def root_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        w = self.w
        # an evaluation forward is no training step, and ampdoctor's own passes are not training at all
        if not w.active or not torch.is_grad_enabled() or diagnosing() or in_transform():
            return  # (a model run by vmap: its values exist only inside the transform)
        try:
            if w.low is None:
                w.low = autocast_dtype(w.device_type)
                if w.low is None and not self.probed:
                    self._probe_autocast()
            with unseen():
                micro = MicroBatch.keep(module, args, kwargs, w.targets, weights=not w.scaler_on)
            cur = w.cur
            if len(cur.micro) >= MAX_MICRO_BATCHES:
                cur.micro.popleft()
                cur.dropped_micro += 1
            cur.micro.append(micro)
            cur.forwards += 1
            self.open = True
            if self.compiled is not None:
                self.compiled.on = self.grads_on
            elif self.grads_on and self.ops.survey is None and self.ops.survey_due(w._step):
                self.ops.start_survey(w._step)
        except Exception as exc:  # never raise inside the user's forward
            w.fail(exc)

    def root_post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        w = self.w
        if not self.open or not w.cur.micro:  # not a watched forward (evaluation, or ampdoctor's own pass)
            return
        self.open = False
        self.remove_probes()
        self.ops.end_survey()
        if self.compiled is not None:
            self.compiled.on = False
        with unseen():
            self._root_outputs(output)

    def _root_outputs(self, output: Any) -> None:
        w = self.w
        try:
            micro = w.cur.micro[-1]
            loss = own_loss(output)
            micro.own_loss = loss is not None
            if loss is not None and loss.is_floating_point():  # the step's loss, unless scaler.scale shows one
                value = loss_value(loss)
                if value is not None:
                    micro.loss_slot = w.cur.collector.add(value)
            for path, t in iter_tensors(output, "out"):
                if not t.is_floating_point() or t.numel() == 0:
                    continue
                micro.root_slots.append(w.cur.collector.pair("root", "", t.detach(), t.dtype == w.low))
                if t.requires_grad:
                    if self.grads_on:
                        self.grad_hook(t, "")
                    if not micro.own_loss:
                        self.keep_grad(micro, path, t)
        except Exception as exc:
            w.fail(exc)

    @uninterrupted
    def _probe_autocast(self) -> None:
        """Autocast switched on inside the model's own forward (accelerate wraps ``forward`` in it): the root's
        children see it. Pre-hooks on them for the first watched forward only (removed in :meth:`root_post`)."""
        w = self.w

        def look(module: nn.Module, args: Any) -> None:
            if w.low is None:
                w.low = autocast_dtype(w.device_type)

        self.probed = True
        self.probes = [child.register_forward_pre_hook(look) for child in w.root.children()]

    @uninterrupted
    def keep_grad(self, micro: MicroBatch, path: str, t: torch.Tensor) -> None:
        """Keep the gradient reaching this output (the real loss's, scaled) until the step ends, within the cap."""
        micro.expected_grads.add(path)
        nbytes = t.numel() * t.element_size()
        cur = self.w.cur
        if cur.kept_bytes + nbytes > self.w.max_output_grad_bytes:
            micro.not_kept[path] = nbytes  # expected, never kept: the capture says so
            return
        cur.kept_bytes += nbytes

        def receive(g: torch.Tensor) -> None:
            micro.out_grads[path] = g.detach()

        cur.tensor_handles.append(register_grad_hook(t, receive)[0])

    # -- modules (eager, sampled steps) ---------------------------------------------------------------------
    def tap(self, module: nn.Module) -> Tap:
        """Measure ``module``'s outputs from now on: by a forward wrapper (torch's fast call path kept), or by a
        forward hook after the module's own hooks (see :mod:`.forwards`)."""
        probe = self.probe(module)
        if self.wrappers and not has_forward_hooks(module) and wrappable_class(type(module)):
            return ForwardTap(module, probe.measure)
        return HookTap(module, post=probe)

    def probe(self, module: nn.Module) -> _ModuleProbe:
        """The forward hook of ``module`` (one per module, kept for the watch's life)."""
        probe = self._probes.get(id(module))
        if probe is None:
            probe = self._probes[id(module)] = _ModuleProbe(self, self.w.names.get(id(module), ""))
        return probe

    def receiver(self, name: str, low: bool) -> _GradReceiver:
        """The gradient receiver of one (module, dtype), made once and reused every step (no closure per tensor
        per step); the step's handles are removed when the step closes, so a receiver never sees a closed step's
        gradients."""
        receive = self._receivers.get((name, low))
        if receive is None:
            receive = self._receivers[(name, low)] = _GradReceiver(self, name, low)
        return receive

    @uninterrupted
    def grad_hook(self, t: torch.Tensor, name: str) -> None:
        """A gradient hook on ``t`` whose (lo, hi) goes to the current step (on ``t``'s autograd node: cheap)."""
        receive = self.receiver(name, t.dtype == self.w.low)
        self.w.cur.tensor_handles.append(hang_grad_hook(t, receive, receive.node0))


class _ModuleProbe:
    """What measures one module's outputs (called by its forward wrapper, or as its forward hook): its floating
    outputs' (lo, hi) into the current step, and gradient hooks on them on sampled steps. Made once per module,
    with its pair keys and gradient receivers: a call allocates nothing but Python ints and the gradient hook's
    handle."""

    __slots__ = ("hooks", "w", "name", "keys", "receivers")

    def __init__(self, hooks: WatchHooks, name: str) -> None:
        self.hooks, self.w, self.name = hooks, hooks.w, name
        self.keys: tuple[PairKey, PairKey] = (("out", name, False), ("out", name, True))  # by low dtype
        self.receivers: list[Optional[_GradReceiver]] = [None, None]  # by low dtype, made when first needed

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        """As a forward hook."""
        self.measure(output)

    def measure(self, output: Any) -> None:
        hooks = self.hooks
        if hooks.open and type(output) is torch.Tensor and self.name and not _mode_on() and not in_transform():
            # the hot path (a watched root forward, one tensor, no torch function mode): no call of our own but the
            # collector's put
            try:
                w = self.w
                dtype = output.dtype
                low = dtype is w.low
                if (low or dtype.is_floating_point) and output.numel():
                    cur = w.cur
                    cur.collector.put(self.keys[low], output.detach())
                    if hooks.grads_on:
                        self._hook_gradient(output, low, cur.tensor_handles)
            except Exception as exc:
                self.w.fail(exc)
            return
        # a watched root forward; else a training forward that calls the module directly, or a checkpoint
        # recomputing its region in the training backward; never an evaluation forward or ampdoctor's own pass
        if not hooks.open:
            if not self.w.active:
                return  # a wrapper someone wrapped in their own forward outlives the watch: it measures nothing
            if recomputing():
                if diagnosing():
                    return
            elif not torch.is_grad_enabled() or diagnosing(thorough=False):
                return
        if not self.name:
            return  # the root: recorded by root_post
        if in_transform():
            return  # called by vmap (torch.func): values that exist only inside the transform
        if _mode_on():  # a mode runs: our reads (properties too) are unseen()
            with torch._C.DisableTorchFunction():
                self._record(output)
        else:
            self._record(output)

    def _record(self, output: Any) -> None:
        try:
            tensors = (output,) if type(output) is torch.Tensor else [t for _, t in iter_tensors(output, "out")]
            w = self.w
            cur = w.cur
            for t in tensors:
                if not t.is_floating_point() or not t.numel():
                    continue
                low = t.dtype is w.low
                cur.collector.put(self.keys[low], t.detach())
                if self.hooks.grads_on:
                    self._hook_gradient(t, low, cur.tensor_handles)
        except Exception as exc:
            self.w.fail(exc)

    def _hook_gradient(self, t: torch.Tensor, low: bool, handles: list[Any]) -> None:
        """Hang this module's gradient receiver on output ``t`` (``handles``: the step's, taken out at its end)."""
        node = t.grad_fn
        if node is not None:
            receive = self.receivers[low] or self._receiver(low)
            if t._base is None and t._backward_hooks is None and self.hooks.dicts_ok:
                # the common case: our hook in the tensor's own hook dict, in C (fastpath's docstring), an
                # OrderedDict as register_hook makes (its handles keep a weakref to it). The dict goes straight into
                # the step's list (a Ctrl-C in between leaves a hook on this step's graph only, which dies with it)
                hooks_of_t: OrderedDict[int, Any] = OrderedDict()
                hooks_of_t[OWN_KEY] = receive
                t._backward_hooks = hooks_of_t  # type: ignore[assignment]
                node._register_hook_dict(t)
                handles.append(hooks_of_t)
            else:
                _hang(handles, t, receive)
        elif t.requires_grad:  # a leaf that asks for a gradient (a module handing back its input)
            _hang(handles, t, self.receivers[low] or self._receiver(low))

    def _receiver(self, low: bool) -> _GradReceiver:
        receive = self.receivers[low] = self.hooks.receiver(self.name, low)
        return receive


@uninterrupted
def _hang(handles: list[Any], t: torch.Tensor, receive: _GradReceiver) -> None:
    handles.append(hang_grad_hook(t, receive, receive.node0))


class _GradReceiver:
    """Records the (lo, hi) of one module's output gradients in the watch's current step."""

    __slots__ = ("hooks", "w", "key", "low", "node0")

    def __init__(self, hooks: WatchHooks, name: str, low: bool) -> None:
        self.hooks = hooks
        self.w = hooks.w
        self.key: PairKey = ("grad", name, low)
        self.low = low
        self.node0 = self.first  # the node pre-hook of a node's first output, made once

    def first(self, grads: tuple[Optional[torch.Tensor], ...]) -> None:
        """As a node pre-hook: the gradient of the node's first output (what :class:`NodeHook` does)."""
        g = grads[0] if grads else None
        if g is not None:
            self(g)

    def __call__(self, g: torch.Tensor) -> None:
        """As a tensor hook (this runs for every module output in every sampled backward)."""
        try:
            if g.numel():
                if g.requires_grad:  # a double backward (create_graph=True): the value, off the graph
                    g = g.detach()
                collector = self.w.cur.collector
                collector.put(self.key, g)
                if self.low and self.hooks.count_underflow:  # sampled steps: a sink wants the underflow share
                    collector.underflow(g)
        except Exception as exc:
            self.w.fail(exc)
