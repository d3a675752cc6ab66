"""One instrumented AMP step: forward under autocast, loss, scaled backward; what the hooks saw becomes records.

Only ``capture`` (and ``fixes``) touches a live model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from ..errors import AmpDoctorError, InternalError, InvalidInput, ModelRaised
from ..records import LOSS, GradEvent, ModuleCall, ModuleInfo, ParamRecord, PassTrace, TensorRecord, TensorStats
from .dtypes import autocast_enabled
from .emulate import cuda_autocast, installed_cuda_policy
from .hooks import Recorder
from .reference import FloatReference
from .state import StateGuard
from .stats import StatsCollector
from .walk import call_model, iter_tensors
from .zoom import BackwardZoom, OpZoom

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class PassSpec:
    """What every pass of one diagnosis shares."""

    root: nn.Module
    names: dict[int, str]  # id(module) -> qualified name
    params: list[tuple[str, nn.Parameter]]  # unique, by canonical name
    batch: Any
    loss_fn: Optional[LossFn]
    device_type: str  # where the tensors are (the autocast device, unless the policy is emulated)
    dtype: torch.dtype
    backward: bool
    # "native": torch.autocast(device_type); "cuda_emulated": CUDA's op policy on CPU tensors (capture.emulate)
    policy: str = "native"


def _autocast(spec: PassSpec, enabled: bool) -> Any:
    if spec.policy == "cuda_emulated":
        return cuda_autocast(spec.dtype, enabled=enabled)
    return torch.autocast(spec.device_type, dtype=spec.dtype, enabled=enabled)


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
            raise InvalidInput(
                "the model returned no floating tensor to take a loss from; pass loss_fn=lambda output, batch: ..."
            )
        loss = torch.stack([t.float().mean() for t in floats]).sum()
        return loss, "surrogate"
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise InvalidInput(f"loss_fn must return a scalar tensor, got {shape}; reduce it (e.g. .mean())")
    return loss.reshape(()), source


def run_pass(
    spec: PassSpec,
    scale: float,
    detailed: bool,
    zoom: Optional[tuple[str, int]] = None,
    autocast: bool = True,
    backward_zoom: bool = False,
    reference: Union[bool, int] = False,
    guard: Optional[StateGuard] = None,
) -> tuple[PassTrace, str]:
    """Run one autocast forward and one scaled backward with hooks; return the records and the loss source.

    ``autocast=False`` runs the same step in float32: the reference for counting underflowed gradients.
    ``backward_zoom`` records each autograd node's forward stack (anomaly mode) and finds the backward op that
    made the first non-finite gradient. ``reference`` (True: leaf modules; an int n: the modules n levels down)
    compares each chosen call against a float32 re-run of that call alone.

    The caller rewinds RNG and buffers before each pass (``guard``); the forward runs under the guard's
    copy-on-write of parameters. Gradients are taken with ``torch.autograd.grad`` so no ``.grad`` field is
    touched.
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
    writes = guard.guard_writes() if guard is not None else contextlib.nullcontext()
    # The emulated CUDA policy stays installed for the backward too (checkpoint recomputes run under it).
    emulation = installed_cuda_policy() if spec.policy == "cuda_emulated" else contextlib.nullcontext()
    autocast_on = False
    try:
        recorder.install(spec.params)
        with torch.enable_grad(), _anomaly(backward_zoom), emulation as emulated:
            with _autocast(spec, autocast), writes:
                autocast_on = autocast_enabled("cpu" if spec.policy == "cuda_emulated" else spec.device_type)
                try:
                    output = call_model(spec.root, spec.batch)
                except Exception as exc:
                    where = f" (last module that ran: '{recorder.last_module or '<root>'}'"
                    if recorder.stack:
                        inner = recorder.calls[recorder.stack[-1]].module
                        if inner != recorder.last_module:
                            where += f", inside '{inner or '<root>'}'"
                    where += ")"
                    raise ModelRaised(
                        f"the model's forward raised {type(exc).__name__}: {exc}{where}",
                        "forward",
                        recorder.last_module,
                    ) from exc
                finally:
                    recorder.close_zoom()
                try:
                    if loss_zoom is not None:
                        with loss_zoom:
                            loss, loss_source = resolve_loss(output, spec.batch, spec.loss_fn)
                            loss_zoom.finish(loss)
                    else:
                        loss, loss_source = resolve_loss(output, spec.batch, spec.loss_fn)
                except AmpDoctorError:
                    raise
                except Exception as exc:
                    raise ModelRaised(f"the loss raised {type(exc).__name__}: {exc}", "loss") from exc
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
                        if recorder.ran_without_grad:
                            # A reentrant checkpoint runs its region's backward with .backward() inside, which
                            # refuses autograd.grad: take the gradients with .backward() on set-aside .grads.
                            _backward_keeping_grads(scaled, [p for _, p in spec.params])
                        else:
                            torch.autograd.grad(scaled, inputs, allow_unused=True)
                except Exception as exc:
                    raise ModelRaised(f"the backward raised {type(exc).__name__}: {exc}", "backward") from exc
                backward_ran = True
            del output, loss
    finally:
        recorder.remove()
        if gc_was_enabled:
            gc.enable()
    if recorder.error is not None:
        raise InternalError(
            f"ampdoctor failed while recording ({type(recorder.error).__name__}: {recorder.error}); "
            "please report this with the model class"
        ) from recorder.error
    stats = collector.read()
    trace = _build_trace(recorder, stats, scale, detailed, batch_slots, output_slots, loss_slot, backward_ran)
    finding = loss_zoom.finding if loss_zoom is not None else (recorder.zoom.finding if recorder.zoom else None)
    backward_finding = back_zoom.finding if back_zoom is not None else None
    comparisons = tuple(float_reference.records()) if float_reference is not None else ()
    zooms = (("forward", loss_zoom or recorder.zoom), ("backward", back_zoom))
    notes = tuple(f"the {kind} op zoom could not inspect {z.error}" for kind, z in zooms if z is not None and z.error)
    if emulated is not None:
        notes += tuple(emulated.notes())
    trace = dataclasses.replace(
        trace, op_finding=finding, backward_op_finding=backward_finding, comparisons=comparisons, notes=notes,
        autocast=autocast_on,
    )
    return trace, loss_source


def _leaves(root: torch.Tensor) -> list[torch.Tensor]:
    """Every leaf tensor the graph of ``root`` accumulates a gradient into (parameters, inputs, others)."""
    leaves, seen, todo = [], set(), [root.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _backward_keeping_grads(scaled: torch.Tensor, params: list[nn.Parameter]) -> None:
    """``scaled.backward()`` with every ``.grad`` it could write (the graph's leaves, and the parameters, which
    a checkpointed region reaches only when it re-runs) set aside first and put back by assignment after."""
    saved = [(t, t.grad) for t in {id(t): t for t in [*_leaves(scaled), *params]}.values()]
    for t, _ in saved:
        t.grad = None
    try:
        scaled.backward()
    finally:
        for t, grad in saved:
            t.grad = grad


@contextlib.contextmanager
def _anomaly(enabled: bool) -> Iterator[None]:
    """Anomaly mode exactly as the pass needs it, whatever the user set: on (forward stacks recorded) only for
    the backward zoom, and never ``check_nan``, which would raise on the very gradients being diagnosed. The
    user's setting (``check_nan`` included) is back afterwards."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        with torch.autograd.set_detect_anomaly(enabled, check_nan=False):
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
            grad_enabled=c.grad_enabled,
            inputs=tuple(TensorRecord(p, stats[s], rg, prod, s, prod_path) for p, s, rg, prod, prod_path in c.inputs),
            outputs=tuple(TensorRecord(p, stats[s], rg, None, s) for p, s, rg in c.outputs),
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
        calls=tuple(calls),
        grad_events=tuple(events),
        batch=tuple(TensorRecord(p, stats[s], rg) for p, s, rg in batch_slots),
        output=tuple(TensorRecord(p, stats[s], rg) for p, s, rg in output_slots),
        loss=stats[loss_slot],
        backward_ran=backward_ran,
        uncaptured=tuple(dict.fromkeys(recorder.uncaptured)),
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
        ModuleInfo(name, class_name, tuple(ParamRecord(pname, stats[slot], rg) for pname, slot, rg in params))
        for name, class_name, params in layout
    ]
