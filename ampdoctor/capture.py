"""Capture: run one instrumented AMP step on a live model and turn what the hooks saw into records.

Only this module (and ``fixes``) touches a live model. Every hook handle is removed in ``finally``; hooks never
raise (they record the failure, and the pass raises after it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import math
import os
import random
import re
import traceback
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .errors import AmpDoctorError
from .records import (
    LOSS,
    Comparison,
    GradEvent,
    ModuleCall,
    ModuleInfo,
    OpFinding,
    ParamRecord,
    PassTrace,
    SourceLocation,
    TensorRecord,
    TensorStats,
)
from .stats import StatsCollector, dtype_name, measuring

LossFn = Callable[[Any, Any], torch.Tensor]

_MAX_WALK_DEPTH = 8
_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIR = os.path.dirname(__file__)
# ampdoctor's own model code (the demo) is user code for the zoom; the rest of the package is not.
_OWN_MODEL_FILES = frozenset({os.path.join(_OWN_DIR, "demo.py")})


# -- walking nested inputs and outputs ---------------------------------------------------------------------


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


def call_model(model: nn.Module, batch: Any) -> Any:
    """A Tensor → ``model(batch)``, a tuple/list → ``model(*batch)``, a dict → ``model(**batch)``."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


# -- the user's state: snapshot, rewind before every pass, restore at the end ------------------------------


class StateGuard:
    """Saves what a forward may change (RNG streams, buffers, train/eval flags) and puts it back exactly.

    Parameters and ``.grad`` are never written by a pass (gradients are taken with ``torch.autograd.grad``),
    so they need no copy.
    """

    def __init__(self, model: nn.Module) -> None:
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = (
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        )
        self.py_rng = random.getstate()
        self.np_rng = np.random.get_state()
        self.buffers: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []
        # Which buffer names each module had (None entries included): a forward that fills a lazy cache
        # (register_buffer("cache", None), then set in forward) or adds a buffer is undone too.
        self.buffer_names = [(m, dict(m._buffers)) for m in model.modules()]
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    self.buffers.append((module, name, buf, buf.detach().clone()))
        self.training = [(m, m.training) for m in model.modules()]

    def rewind(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.py_rng)
        np.random.set_state(self.np_rng)
        for module, before in self.buffer_names:
            for name in [n for n in module._buffers if n not in before]:
                del module._buffers[name]
            for name, value in before.items():
                if value is None:
                    module._buffers[name] = None
        with torch.no_grad():
            for module, name, original, saved in self.buffers:
                if module._buffers.get(name) is not original:  # a forward that re-assigned the buffer
                    module._buffers[name] = original
                original.copy_(saved)
        for module, flag in self.training:
            module.training = flag


# -- op-level zoom -----------------------------------------------------------------------------------------


def _frame_kind(filename: str) -> str:
    """"model" (user or library code: a candidate), "skip" (torch, <frozen ...>) or "stop" (ampdoctor itself)."""
    if filename.startswith(_OWN_DIR) and filename not in _OWN_MODEL_FILES:
        return "stop"
    if filename.startswith(_TORCH_DIR) or filename.startswith("<"):
        return "skip"
    return "model"


def _innermost_model_frame(frames: Iterable[tuple[str, int, str, str]]) -> Optional[SourceLocation]:
    """Walk (file, line, function, code) frames from the innermost outward; give up at ampdoctor's own frames.

    The innermost ampdoctor frames (the zoom asking) are passed over; an ampdoctor frame further out is the
    pass that called the model, and past it lies the caller of ``diagnose`` (a training loop), not model
    code: a model without a Python forward of its own (``nn.Sequential``) has no line to name.
    """
    leading = True
    for filename, line, function, code in frames:
        kind = _frame_kind(filename)
        if kind == "stop":
            if leading:
                continue
            return None
        leading = False
        if kind == "model":
            return SourceLocation(filename, line, function, code.strip())
    return None


def user_location() -> Optional[SourceLocation]:
    """The innermost stack frame of model code (outside torch and ampdoctor) that is running now."""
    stack = reversed(traceback.extract_stack())
    return _innermost_model_frame((f.filename, f.lineno or 0, f.name, f.line or "") for f in stack)


def _value_flags(t: torch.Tensor) -> tuple[int, int, int]:
    return int(torch.isnan(t).sum()), int(torch.isposinf(t).sum()), int(torch.isneginf(t).sum())


def _floats(values: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


class _Zoom(TorchDispatchMode):
    """Watches every aten op and keeps the first one that *created* a non-finite value.

    Active only on a deterministic re-run; it synchronises per op, which is fine there. Subclasses decide what
    counts as creation and where the op's source line is. ampdoctor's own statistics ops are ignored.
    """

    direction = "forward"

    def __init__(self, module: str, call: int) -> None:
        super().__init__()
        self.module = module
        self.call = call
        self.finding: Optional[OpFinding] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if self.finding is None and not measuring():
            try:
                self._inspect(func, args, kwargs or {}, out)
            except Exception:  # the zoom is best effort; never break the user's step
                pass
        return out

    def _inspect(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        outputs = _floats(out)
        out_flags = [_value_flags(t) for t in outputs]
        if not any(sum(f) for f in out_flags):
            return
        leaves = tree_flatten((args, kwargs))[0]
        inputs = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not self._creates(leaves, inputs, out_flags, outputs):
            return
        abs_max: list[Optional[float]] = []
        for t in inputs:
            finite = t[torch.isfinite(t)]
            abs_max.append(float(finite.abs().max()) if finite.numel() else None)
        nan, posinf, neginf = (sum(f[i] for f in out_flags) for i in range(3))
        node, location = self._where()
        self.finding = OpFinding(
            op=_op_name(func),
            module=self.module,
            call=self.call,
            input_dtypes=[dtype_name(t.dtype) for t in inputs],
            input_abs_max=abs_max,
            output_dtype=dtype_name(outputs[0].dtype),
            output_nan_count=nan,
            output_posinf_count=posinf,
            output_neginf_count=neginf,
            location=location,
            direction=self.direction,
            node=node,
            scalar_args=[float(v) for v in leaves if isinstance(v, (int, float)) and not isinstance(v, bool)],
        )

    def _creates(
        self, leaves: list[Any], inputs: list[torch.Tensor], out_flags: list[tuple[int, int, int]], outputs: Any
    ) -> bool:
        raise NotImplementedError

    def _where(self) -> tuple[Optional[str], Optional[SourceLocation]]:
        return None, user_location()


class OpZoom(_Zoom):
    """Forward, inside the origin call: the first op with a non-finite output whose inputs had no NaN or +inf.

    An op that fills an explicit ``-inf`` constant (``masked_fill(-inf)``) or passes a ``-inf`` mask on creates
    nothing; a finite constant too large for the format (``masked_fill(-1e9)`` in float16) does.
    """

    def _creates(
        self, leaves: list[Any], inputs: list[torch.Tensor], out_flags: list[tuple[int, int, int]], outputs: Any
    ) -> bool:
        if any(isinstance(v, float) and not math.isfinite(v) for v in leaves):
            return False
        in_flags = [_value_flags(t) for t in inputs]
        if any(nan or posinf for nan, posinf, _ in in_flags):
            return False  # propagation of an existing NaN/inf
        made_nan_or_posinf = any(nan or posinf for nan, posinf, _ in out_flags)
        return made_nan_or_posinf or not any(neginf for _, _, neginf in in_flags)


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>[^\n]+)\n(?:\s*(?P<code>[^\n]*))?')


def forward_location(node: Any) -> Optional[SourceLocation]:
    """The forward line that created an autograd node, from anomaly mode's recorded stack (innermost user frame)."""
    stack = getattr(node, "metadata", {}).get("traceback_") if node is not None else None
    if not stack:
        return None
    matches = (_FRAME.search(entry) for entry in reversed(list(stack)))
    return _innermost_model_frame(
        (m["file"], int(m["line"]), m["func"], m["code"] or "") for m in matches if m is not None
    )


class BackwardZoom(_Zoom):
    """Backward: the first op that makes a kind of non-finite value (NaN, or inf) that none of its inputs holds,
    and none of whose inputs was made non-finite by an earlier backward op.

    Saved forward values may hold inf (``exp`` in the untaken branch of a ``torch.where``): passing them on
    creates nothing, but multiplying them by a zero gradient *creates* the NaN. Needs anomaly mode in the
    forward for the forward line.
    """

    direction = "backward"

    def __init__(self) -> None:
        super().__init__("", 0)
        self._made_bad: dict[int, weakref.ref[torch.Tensor]] = {}

    def _creates(
        self, leaves: list[Any], inputs: list[torch.Tensor], out_flags: list[tuple[int, int, int]], outputs: Any
    ) -> bool:
        inherited = any((ref := self._made_bad.get(id(t))) is not None and ref() is t for t in inputs)
        in_flags = [_value_flags(t) for t in inputs]
        input_nan = any(nan for nan, _, _ in in_flags)
        input_inf = any(posinf or neginf for _, posinf, neginf in in_flags)
        made_nan = any(nan for nan, _, _ in out_flags)
        made_inf = any(posinf or neginf for _, posinf, neginf in out_flags)
        created = not inherited and ((made_nan and not input_nan) or (made_inf and not input_inf))
        if created or inherited:  # a saved inf merely passed on (detach, view) is not a bad gradient yet
            for t, flags in zip(outputs, out_flags):
                if sum(flags):
                    self._made_bad[id(t)] = weakref.ref(t)
        return created

    def _where(self) -> tuple[Optional[str], Optional[SourceLocation]]:
        node = torch._C._current_autograd_node()
        return (node.name() if node is not None else None), forward_location(node)


def _op_name(func: Any) -> str:
    schema = getattr(func, "_schema", None)
    name = str(schema.name) if schema is not None else str(func)  # "aten::bmm"
    overload = getattr(func, "_overloadname", "default")
    return name if overload in ("default", "") else f"{name}.{overload}"


# -- the hooks ---------------------------------------------------------------------------------------------


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
    kind: str
    slot: int
    call: Optional[int]
    path: str
    param: Optional[str]
    via_base: bool


def _hook_target(t: torch.Tensor) -> tuple[torch.Tensor, Optional[tuple[Any, Any, Any]]]:
    """Where to hang a gradient hook on ``t``.

    A hook on a view never fires once a later op modifies the view in place (``ReLU(inplace=True)`` after a
    ``Linear`` on 3-D input); one on the view's base does, with the base's gradient. When the view covers only
    part of the base, return what is needed to map the base gradient back onto the view.
    """
    base = t._base
    if base is None or not base.requires_grad:
        return t, None
    if base.numel() == t.numel():
        return base, None
    return base, (tuple(t.size()), tuple(t.stride()), t.storage_offset() - base.storage_offset())


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float32:
        return value.detach().float()
    return value.detach() if isinstance(value, torch.Tensor) else value


class FloatReference:
    """Re-runs chosen calls in float32 under ``no_grad`` on the call's own inputs and compares the outputs.

    Never the whole model in float32 (the users who need this run out of memory there): one call at a time,
    both outputs dropped after the comparison. The RNG and the module's buffers are put back after each
    re-run so the AMP pass goes on exactly as without it.
    """

    def __init__(self, collector: StatsCollector, depth: Optional[int], device_type: str) -> None:
        self.collector = collector
        self.depth = depth  # None: leaf modules; n: modules n levels below the root (and shallower leaves)
        self.device_type = device_type
        self.busy = False
        self.pending: dict[int, tuple[Any, Any, tuple[torch.Tensor, Optional[torch.Tensor]]]] = {}
        self.compared: list[tuple[str, int, str, int]] = []  # module, call, path, values group

    def wants(self, module: nn.Module, name: str) -> bool:
        is_leaf = next(module.children(), None) is None
        if self.depth is None:
            return is_leaf
        level = 0 if name == "" else name.count(".") + 1
        return level == self.depth or (is_leaf and level < self.depth)

    def rng_state(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return torch.get_rng_state(), torch.cuda.get_rng_state() if self.device_type == "cuda" else None

    def _set_rng(self, state: tuple[torch.Tensor, Optional[torch.Tensor]]) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1])

    def compare(
        self,
        module: nn.Module,
        name: str,
        number: int,
        inputs: tuple[Any, Any, tuple[torch.Tensor, Optional[torch.Tensor]]],
        output: Any,
    ) -> None:
        """``inputs``: the call's args, kwargs and the RNG state it started with (same dropout mask)."""
        args, kwargs, rng_before = inputs
        rng_after = self.rng_state()
        # The re-run updates copies of the buffers (BatchNorm statistics); the originals are swapped back
        # untouched, since the AMP forward may have saved them for its backward (an in-place restore would
        # bump their version and break that backward).
        swapped = []
        for owner in module.modules():
            for key, buf in owner._buffers.items():
                if buf is not None:
                    swapped.append((owner, key, buf))
                    owner._buffers[key] = buf.detach().clone()
        self.busy = True
        self._set_rng(rng_before)
        try:
            with torch.no_grad(), torch.autocast(self.device_type, enabled=False):
                reference = module(*tree_map(_to_fp32, args), **tree_map(_to_fp32, kwargs))
        finally:
            self.busy = False
            self._set_rng(rng_after)
            for owner, key, buf in swapped:
                owner._buffers[key] = buf
        low = dict(iter_tensors(output, "out"))
        for path, ref in iter_tensors(reference, "out"):
            got = low.get(path)
            if got is None or not ref.is_floating_point() or got.shape != ref.shape or not ref.numel():
                continue
            # Norms in float64: squares of tiny (subnormal) float32 values would underflow to 0 in float32.
            wide = torch.float32 if ref.device.type == "mps" else torch.float64
            signal = ref.to(wide).pow(2).sum()
            noise = (got.detach().to(wide) - ref.to(wide)).pow(2).sum()
            zero = torch.zeros((), dtype=wide, device=ref.device)
            inf = torch.full((), math.inf, dtype=wide, device=ref.device)
            # 0/0 (a call whose float32 output is all zero and matched exactly) is no error at all.
            relative = torch.where(signal > 0, (noise / signal).sqrt(), torch.where(noise > 0, inf, zero))
            sqnr = torch.where(noise > 0, 10 * torch.log10(signal / noise), inf)
            group = self.collector.add_values(
                [relative, sqnr, ((ref != 0) & (got == 0)).sum(), (ref != 0).sum()]
            )
            self.compared.append((name, number, path, group))

    def records(self) -> list[Comparison]:
        out = []
        for name, number, path, group in self.compared:
            rel, sqnr, underflow, nonzero = self.collector.values[group]
            out.append(Comparison(name, number, path, rel, sqnr, int(underflow), int(nonzero)))
        return out


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
                self.reference.pending[index] = (args, kwargs, self.reference.rng_state())
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
    def _grad_hook(self, t: torch.Tensor, kind: str, index: int, path: str) -> None:
        target, view = _hook_target(t)
        # Plain values only: the closure must not keep activations alive (it lives on the autograd graph).
        target_shape = target.shape
        via_base = target is not t

        def hook(grad: torch.Tensor) -> None:
            try:
                g = grad
                if view is not None and grad.is_contiguous() and grad.shape == target_shape:
                    g = grad.as_strided(view[0], view[1], grad.storage_offset() + view[2])
                slot = self.collector.add(g)
                self.grads.append(_GradSeen(next(self._grad_order), kind, slot, index, path, None, via_base))
            except Exception as exc:
                self.error = self.error or exc

        self._handles.append(target.register_hook(hook))

    def _param_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            try:
                slot = self.collector.add(grad)
                self.grads.append(_GradSeen(next(self._grad_order), "param", slot, None, "grad", name, False))
            except Exception as exc:
                self.error = self.error or exc

        return hook


# -- one pass ----------------------------------------------------------------------------------------------


@dataclass
class PassSpec:
    """What every pass of one diagnosis shares."""

    root: nn.Module
    names: dict[int, str]  # id(module) -> qualified name
    params: list[tuple[str, nn.Parameter]]  # unique, by canonical name
    batch: Any
    loss_fn: Optional[LossFn]
    device_type: str
    dtype: torch.dtype
    backward: bool


def resolve_loss(output: Any, batch: Any, loss_fn: Optional[LossFn]) -> tuple[torch.Tensor, str]:
    """The loss a training loop would back-propagate, and where it came from."""
    if loss_fn is not None:
        loss = loss_fn(output, batch)
        source = "loss_fn"
    elif isinstance(output, torch.Tensor) and output.numel() == 1:
        return output.reshape(()), "scalar output"
    elif isinstance(getattr(output, "loss", None), torch.Tensor):
        return output.loss.reshape(()), "output.loss"
    elif isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"].reshape(()), "output['loss']"
    else:
        floats = [t for _, t in iter_tensors(output, "out") if t.is_floating_point() and t.numel()]
        if not floats:
            raise AmpDoctorError(
                "the model returned no floating tensor to take a loss from; pass loss_fn=lambda output, batch: ..."
            )
        loss = torch.stack([t.float().mean() for t in floats]).sum()
        return loss, "surrogate"
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise AmpDoctorError(f"loss_fn must return a scalar tensor, got {shape}; reduce it (e.g. .mean())")
    return loss.reshape(()), source


def run_pass(
    spec: PassSpec,
    scale: float,
    detailed: bool,
    zoom: Optional[tuple[str, int]] = None,
    autocast: bool = True,
    backward_zoom: bool = False,
    reference: Union[bool, int] = False,
) -> tuple[PassTrace, str]:
    """Run one autocast forward and one scaled backward with hooks; return the records and the loss source.

    ``autocast=False`` runs the same step in float32: the reference for counting underflowed gradients.
    ``backward_zoom`` records each autograd node's forward stack (anomaly mode) and finds the backward op that
    made the first non-finite gradient. ``reference`` (True: leaf modules; an int n: the modules n levels down)
    compares each chosen call against a float32 re-run of that call alone.

    The caller rewinds RNG and buffers before each pass. Gradients are taken with ``torch.autograd.grad`` so no
    ``.grad`` field is touched.
    """
    collector = StatsCollector(spec.dtype, detailed)
    modules = [m for m in spec.root.modules()]
    float_reference = None
    if reference is not False:
        depth = None if reference is True else int(reference)
        float_reference = FloatReference(collector, depth, spec.device_type)
    recorder = Recorder(spec.names, modules, collector, spec.backward, zoom, float_reference)
    batch_slots = [(p, collector.add(t), bool(t.requires_grad)) for p, t in iter_tensors(spec.batch, "batch")]
    loss_zoom = OpZoom(LOSS, 0) if zoom == (LOSS, 0) else None
    backward_ran = False
    back_zoom = BackwardZoom() if backward_zoom else None
    # A pass makes many small Python objects; the cyclic collector running in the middle of it only costs
    # time (nothing here forms cycles that need it before the pass ends).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        recorder.install(spec.params)
        with torch.enable_grad(), _anomaly(backward_zoom):
            with torch.autocast(spec.device_type, dtype=spec.dtype, enabled=autocast):
                try:
                    output = call_model(spec.root, spec.batch)
                except Exception as exc:
                    where = f" (last module that ran: '{recorder.last_module or '<root>'}'"
                    if recorder.stack:
                        inner = recorder.calls[recorder.stack[-1]].module
                        if inner != recorder.last_module:
                            where += f", inside '{inner or '<root>'}'"
                    where += ")"
                    raise AmpDoctorError(f"the model's forward raised {type(exc).__name__}: {exc}{where}") from exc
                finally:
                    recorder.close_zoom()
                try:
                    if loss_zoom is not None:
                        with loss_zoom:
                            loss, loss_source = resolve_loss(output, spec.batch, spec.loss_fn)
                    else:
                        loss, loss_source = resolve_loss(output, spec.batch, spec.loss_fn)
                except AmpDoctorError:
                    raise
                except Exception as exc:
                    raise AmpDoctorError(f"the loss raised {type(exc).__name__}: {exc}") from exc
            output_slots = [(p, collector.add(t), bool(t.requires_grad)) for p, t in iter_tensors(output, "out")]
            loss_slot = collector.add(loss)
            inputs = [p for _, p in spec.params if p.requires_grad]
            if spec.backward and loss.requires_grad and inputs:
                # What GradScaler.scale does: multiply by a 0-d fp32 scale tensor (never call the user's scaler).
                # A 0-d CPU tensor works with a tensor on any device and needs no host-to-device copy.
                scaled = loss * torch.tensor(scale, dtype=torch.float32)
                recorder.in_backward = True
                try:
                    with back_zoom if back_zoom is not None else contextlib.nullcontext():
                        torch.autograd.grad(scaled, inputs, allow_unused=True)
                except Exception as exc:
                    raise AmpDoctorError(f"the backward raised {type(exc).__name__}: {exc}") from exc
                backward_ran = True
            del output, loss
    finally:
        recorder.remove()
        if gc_was_enabled:
            gc.enable()
    if recorder.error is not None:
        raise AmpDoctorError(
            f"ampdoctor failed while recording ({type(recorder.error).__name__}: {recorder.error}); "
            "please report this with the model class"
        ) from recorder.error
    stats = collector.read()
    trace = _build_trace(recorder, stats, scale, detailed, batch_slots, output_slots, loss_slot, backward_ran)
    finding = loss_zoom.finding if loss_zoom is not None else (recorder.zoom.finding if recorder.zoom else None)
    backward_finding = back_zoom.finding if back_zoom is not None else None
    comparisons = float_reference.records() if float_reference is not None else []
    trace = dataclasses.replace(
        trace, op_finding=finding, backward_op_finding=backward_finding, comparisons=comparisons
    )
    return trace, loss_source


@contextlib.contextmanager
def _anomaly(enabled: bool) -> Iterator[None]:
    """Anomaly mode records every autograd node's forward stack; only the backward zoom needs it."""
    if not enabled:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        with torch.autograd.detect_anomaly(check_nan=False):
            yield


def _build_trace(
    recorder: Recorder,
    stats: list[TensorStats],
    scale: float,
    detailed: bool,
    batch_slots: list[tuple[str, int, bool]],
    output_slots: list[tuple[str, int, bool]],
    loss_slot: int,
    backward_ran: bool,
) -> PassTrace:
    calls = [
        ModuleCall(
            index=c.index,
            module=c.module,
            call=c.call,
            class_name=c.class_name,
            parent=c.parent,
            end_order=c.end_order,
            inputs=[TensorRecord(p, stats[s], rg, prod, s, prod_path) for p, s, rg, prod, prod_path in c.inputs],
            outputs=[TensorRecord(p, stats[s], rg, None, s) for p, s, rg in c.outputs],
        )
        for c in recorder.calls
    ]
    unscaled: dict[int, TensorStats] = {}
    for g in recorder.grads:  # the same gradient seen by several hooks is divided once
        if g.slot not in unscaled:
            unscaled[g.slot] = stats[g.slot].scaled_down(scale)
    events = [
        GradEvent(
            order=g.order,
            kind=g.kind,
            stats=unscaled[g.slot],
            call=g.call,
            path=g.path,
            param=g.param,
            via_base=g.via_base,
        )
        for g in recorder.grads
    ]
    return PassTrace(
        scale=scale,
        detailed=detailed,
        calls=calls,
        grad_events=events,
        batch=[TensorRecord(p, stats[s], rg) for p, s, rg in batch_slots],
        output=[TensorRecord(p, stats[s], rg) for p, s, rg in output_slots],
        loss=stats[loss_slot],
        backward_ran=backward_ran,
    )


def capture_params(spec: PassSpec, modules: list[tuple[str, nn.Module]]) -> list[ModuleInfo]:
    """Detailed statistics of every module's own parameters, read back at once (they do not change per pass)."""
    collector = StatsCollector(spec.dtype, detailed=True)
    canonical = {id(p): name for name, p in spec.params}
    layout = []
    for name, module in modules:
        own = [(canonical.get(id(p), f"{name}.{local}"), p) for local, p in module.named_parameters(recurse=False)]
        layout.append((name, type(module).__name__, [(pname, collector.add(p), p.requires_grad) for pname, p in own]))
    stats = collector.read()
    return [
        ModuleInfo(name, class_name, [ParamRecord(pname, stats[slot], rg) for pname, slot, rg in params])
        for name, class_name, params in layout
    ]
