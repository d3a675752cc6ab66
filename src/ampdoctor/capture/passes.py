"""One instrumented AMP step: forward under autocast, loss, scaled backward; what the hooks saw becomes records.

Only ``capture`` (and ``fixes``) touches a live model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..errors import AmpDoctorError, InternalError, InvalidInput, ModelRaised
from ..records import (
    LOSS,
    ModuleInfo,
    OpOverflow,
    OpPeak,
    ParamRecord,
    PassTrace,
)
from ..thresholds import GRADIENT_KEY
from .cleanup import cleaned, on_cleanup, pause_gc, uninterrupted
from .dtypes import autocast_enabled
from .emulate import cuda_autocast, installed_cuda_policy
from .hidden import HiddenWatch, watching
from .hidden_ops import LOW_NAMES
from .hooks import Recorder
from .internal import INTERNAL
from .op_peaks import op_peaks
from .options import PLAIN_PASS, LossFn, PassOptions
from .reference import FloatReference
from .room import RecursionRoom, module_depth
from .state import StateGuard
from .stats import StatsCollector
from .trace_build import build_trace, grad_events
from .walk import call_model, iter_tensors, transform_note
from .zoom import BackwardZoom, OpZoom

# A survey keeps its graph for the probes when the parameters' gradients are at least this many times the largest
# recorded tensor (see _Step.cheap_to_keep).
KEEP_FACTOR = 4


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
    # ``root.modules()``, walked once (empty: by the first pass; a diagnosis hands over its own walk)
    modules: list[nn.Module] = field(default_factory=list)


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


class SharedForward:
    """Lets backwards at other loss scales reuse one forward and its graph instead of running the step again.

    Exact: the backward is linear in the loss gradient, so a backward at another power-of-two scale sees every
    gradient multiplied by that power of two, and the forward (same RNG draws, same weights) would be identical.
    ``run_pass(..., share=...)`` keeps the graph of a survey-level pass here; the next compatible pass runs its
    backward only, any other pass releases it first (never two passes' graphs alive at once).
    """

    def __init__(self) -> None:
        self.step: Optional[_Step] = None
        self.histograms: Mapping[str, list[int]] = {}  # of the last pass run through ``run_pass(share=...)``

    def release(self) -> None:
        step, self.step = self.step, None
        if step is not None:
            step.close()


def run_pass(
    spec: PassSpec,
    scale: float,
    options: PassOptions = PLAIN_PASS,
    guard: Optional[StateGuard] = None,
    *,
    share: Optional[SharedForward] = None,
    keep: bool = True,
) -> tuple[PassTrace, str]:
    """Run one autocast forward and one scaled backward with hooks; return the records and the loss source.

    ``options`` (:class:`PassOptions`) says what the pass measures: ``autocast=False`` runs the same step in
    float32, the reference for counting underflowed gradients; ``backward_zoom`` records each autograd node's
    forward stack (anomaly mode) and finds the backward op that made the first non-finite gradient;
    ``reference`` (True: leaf modules; an int n: the modules n levels down) compares each chosen call against a
    float32 re-run of that call alone; ``histograms``: binade histograms of the parameter gradients (1), and of
    every gradient held in the low precision too (2): ``share.histograms`` afterwards, by parameter name, and
    the sum of the others' under ``GRADIENT_KEY``. Every autocast forward flags the ops that make
    inf/NaN from finite inputs (``trace.op_overflows``, :mod:`.hidden`); ``hidden`` names flagged ops (module,
    call, op, occurrence) to count, classify and locate on this pass.

    With ``share``, a survey-level pass keeps its graph there (unless ``keep`` is False), and a later
    survey-level pass of the same spec at another scale runs only its backward on it; any other pass first
    releases the graph kept there. The guard rewinds RNG, parameters and buffers before each
    forward; the forward runs under the guard's copy-on-write of parameters. Gradients are taken with
    ``torch.autograd.grad`` so no ``.grad`` field is touched.
    """
    # Same spec, same options, and no module's forward replaced since (a float32 fallback under verification).
    modules = spec.modules = spec.modules or list(spec.root.modules())
    overrides = tuple(id(m.__dict__.get("forward")) for m in modules)
    key = (id(spec), spec.dtype, options.forward_key(), overrides)
    if share is not None and share.step is not None:
        if keep and share.step.key == key and share.step.repeatable:
            trace = share.step.backward(scale, keep=True, histograms=options.histograms)
            share.histograms = share.step.histograms
            return trace, share.step.loss_source
        share.release()
    step = _Step(spec, modules, key, options, guard)
    kept = False
    try:
        step.forward()
        kept = share is not None and keep and step.repeatable and step.cheap_to_keep()
        trace = step.backward(scale, keep=kept, histograms=options.histograms)
    finally:
        if not kept:
            step.close()
    if share is not None:
        share.histograms = step.histograms
        if kept:
            step.recorder.drop_forward_hooks()  # later backwards run no forward: their bookkeeping can go
            share.step = step
    return trace, step.loss_source


class _Step:
    """One instrumented forward (hooks, autocast, copy-on-write of parameters), then one or more backwards."""

    def __init__(
        self,
        spec: PassSpec,
        modules: list[nn.Module],
        key: tuple[Any, ...],
        options: PassOptions,
        guard: Optional[StateGuard],
    ) -> None:
        self.spec, self.key, self.detailed, self.guard = spec, key, options.detailed, guard
        self.autocast, self.backward_zoom = options.autocast, options.backward_zoom
        # Activations and their gradients: min and max at the survey level (zeros only where analysis counts them).
        self.collector = StatsCollector(spec.dtype, options.detailed, zeros=False)
        self.float_reference = None
        reference, zoom = options.reference, options.zoom
        if reference is not False:
            depth = None if reference is True else int(reference)
            self.float_reference = FloatReference(self.collector, depth, spec.device_type)
        self.recorder = Recorder(spec.names, modules, self.collector, spec.backward, zoom, self.float_reference)
        self.loss_zoom = OpZoom(LOSS, 0) if zoom == (LOSS, 0) else None
        # Ops that make inf/NaN from finite inputs, hidden later or not: watched in every low-precision forward.
        self.hidden = HiddenWatch(self.recorder, options.hidden) if options.autocast else None
        if self.hidden is not None:
            self.recorder.paused = self.hidden.paused
        self.back_zoom = BackwardZoom(self.recorder) if options.backward_zoom else None
        self.contexts = contextlib.ExitStack()  # installed for the whole pass (closed by close())
        self.region = contextlib.ExitStack()  # the forward's autocast and copy-on-write region
        self._undo: Optional[Callable[[], None]] = None
        self.output: Any = None
        self.loss: Optional[torch.Tensor] = None
        self.loss_source = ""
        self.autocast_on = False
        self.emulated: Any = None
        self.first: Optional[PassTrace] = None
        self.backwards = 0
        self.histograms: Mapping[str, list[int]] = {}
        self.slots: tuple[list[tuple[str, int, bool]], list[tuple[str, int, bool]], int] = ([], [], -1)
        self._resume_gc: Optional[Callable[[], None]] = None
        self.depth = module_depth(spec.root)  # for the room its forward and its backward each hold

    @property
    def repeatable(self) -> bool:
        """Another backward on this graph gives what a new pass would: a survey-level pass whose graph holds no
        reentrant checkpoint (its re-run matching is per backward), no anomaly zoom, no parameter written."""
        return (
            self.loss is not None
            and not self.detailed
            and self.back_zoom is None
            and not self.recorder.ran_without_grad
            and (self.guard is None or not self.guard.saved)
        )

    def cheap_to_keep(self) -> bool:
        """Keeping the graph through the backward costs about the activation gradients in flight at its end (a
        backward frees saved tensors as it goes); a pass never holds the parameter gradients a training step does.
        Keep it when those outweigh a few of the largest recorded tensors; else re-run the forward."""
        largest = max((self.collector.nbytes(slot) for c in self.recorder.calls for _, slot, _ in c.outputs), default=0)
        grads = sum(p.numel() * 4 for _, p in self.spec.params if p.requires_grad)
        return KEEP_FACTOR * largest <= grads

    def forward(self) -> None:
        spec, recorder, collector = self.spec, self.recorder, self.collector
        if self.guard is not None:
            self.guard.rewind()  # the same RNG draws, parameters and buffers for every pass: re-runs are identical
        # Called inside the user's own autocast region, torch keeps its weight-cast cache across our passes (it
        # is cleared only when the outermost region exits): a pass would reuse another dtype's or pass's casts.
        torch.clear_autocast_cache()
        batch_slots = [(p, collector.add(t), bool(t.requires_grad)) for p, t in iter_tensors(spec.batch, "batch")]
        self._install()
        self._enter_region()
        try:
            self.autocast_on = autocast_enabled("cpu" if spec.policy == "cuda_emulated" else spec.device_type)
            try:
                output = call_model(spec.root, spec.batch)
            except Exception as exc:
                where = f" (last module that ran: '{recorder.last_module or '<root>'}'"
                inner = recorder.raised_inside
                if inner is not None and inner != recorder.last_module:
                    where += f", inside '{inner or '<root>'}'"
                where += ")"
                raise ModelRaised(
                    f"the model's forward raised {type(exc).__name__}: {exc}{where}", "forward", recorder.last_module
                ) from exc
            finally:
                recorder.close_zoom()
            try:
                with self.loss_zoom if self.loss_zoom is not None else contextlib.nullcontext():
                    loss, self.loss_source = resolve_loss(output, spec.batch, spec.loss_fn)
                    if self.loss_zoom is not None:
                        with INTERNAL:
                            self.loss_zoom.finish(loss)  # name the op behind the loss itself
            except AmpDoctorError:
                raise
            except Exception as exc:
                raise ModelRaised(f"the loss raised {type(exc).__name__}: {exc}", "loss") from exc
        finally:
            self._leave_region()
        output_slots = [(p, collector.add(t), bool(t.requires_grad)) for p, t in iter_tensors(output, "out")]
        if self.hidden is not None:
            self.hidden.queue(collector, output)
        self.slots = (batch_slots, output_slots, collector.add(loss))
        self.output, self.loss = output, loss

    @uninterrupted
    def _install(self) -> None:
        """Everything the pass keeps installed until :meth:`close`, installed at once (a Ctrl-C waits) and owned
        by the diagnosis's cleanup owner before it takes effect."""
        spec = self.spec
        self._undo = on_cleanup(self.close)
        # A pass makes many small Python objects; the cyclic collector running in the middle of it only costs
        # time (nothing here forms cycles that need it before the pass ends).
        self._resume_gc = pause_gc()
        self.recorder.install(spec.params)
        self.contexts.enter_context(torch.enable_grad())
        self.contexts.enter_context(_anomaly(self.backward_zoom))
        # The emulated CUDA policy stays installed for the backward too (checkpoint recomputes run under it).
        emulation = installed_cuda_policy() if spec.policy == "cuda_emulated" else contextlib.nullcontext()
        self.emulated = self.contexts.enter_context(emulation)

    @uninterrupted
    def _enter_region(self) -> None:
        """The forward and loss's autocast region and the copy-on-write of parameters (left after the loss)."""
        # Hooks cost torch one frame per nesting level: room for them, so a model that runs plain runs here
        # (held while the model's code runs, not while a kept graph waits for its next backward).
        self.region.enter_context(RecursionRoom(self.spec.root, self.depth))
        self.region.enter_context(_autocast(self.spec, self.autocast))
        if self.guard is not None:
            if self.hidden is not None:
                self.hidden.guarding(self.guard)  # one torch-function mode for both (each op crosses one)
            else:
                self.region.enter_context(self.guard.guard_writes())
        self.region.enter_context(watching(self.hidden))

    @uninterrupted
    def _leave_region(self) -> None:
        self.region.close()

    def backward(self, scale: float, keep: bool, histograms: int = 0) -> PassTrace:
        """The scaled backward on this forward's graph, and the pass's records (one readback)."""
        spec, recorder, loss = self.spec, self.recorder, self.loss
        assert loss is not None
        if self.backwards:
            self.collector = StatsCollector(spec.dtype, self.detailed, zeros=False)
            recorder.next_backward(self.collector)
        recorder.histograms = histograms
        inputs = [p for _, p in spec.params if p.requires_grad]
        backward_ran = False
        if spec.backward and loss.requires_grad and inputs:
            # What GradScaler.scale does: multiply by a 0-d fp32 scale tensor (never call the user's scaler).
            # A 0-d CPU tensor works with a tensor on any device and needs no host-to-device copy.
            scaled = loss * torch.tensor(scale, dtype=torch.float32)
            recorder.in_backward = True
            try:
                zoom = self.back_zoom if self.back_zoom is not None else contextlib.nullcontext()
                with RecursionRoom(spec.root, self.depth), zoom:  # checkpointed regions re-run their forward in here
                    if recorder.ran_without_grad or (self.hidden is not None and self.hidden.grad_disabled):
                        # A reentrant checkpoint runs its region's backward with .backward() inside, which
                        # refuses autograd.grad: take the gradients with .backward() on set-aside .grads.
                        _backward_keeping_grads(scaled, [p for _, p in spec.params])
                    else:
                        torch.autograd.grad(scaled, inputs, allow_unused=True, retain_graph=keep)
                recorder.flush_params()
            except Exception as exc:
                raise ModelRaised(f"the backward raised {type(exc).__name__}: {exc}", "backward") from exc
            finally:
                del scaled
            backward_ran = True
        if recorder.error is not None:
            raise InternalError(
                f"ampdoctor failed while recording ({type(recorder.error).__name__}: {recorder.error}); "
                "please report this with the model class"
            ) from recorder.error
        stats = self.collector.read()
        self.histograms = self.collector.named_histograms(
            ((g.param, g.histogram) for g in recorder.grads if g.histogram >= 0 and g.param is not None), GRADIENT_KEY)
        self.backwards += 1
        if self.first is not None:
            events = grad_events(recorder, stats, scale)
            return dataclasses.replace(
                self.first, scale=scale, grad_events=events, backward_ran=backward_ran, backward_op_finding=None
            )
        batch_slots, output_slots, loss_slot = self.slots
        trace = build_trace(recorder, stats, scale, self.detailed, batch_slots, output_slots, loss_slot, backward_ran)
        loss_zoom = self.loss_zoom
        finding = loss_zoom.finding if loss_zoom is not None else (recorder.zoom.finding if recorder.zoom else None)
        backward_finding = self.back_zoom.finding if self.back_zoom is not None else None
        float_reference = self.float_reference
        comparisons = tuple(float_reference.records()) if float_reference is not None else ()
        zooms = (("forward", loss_zoom or recorder.zoom), ("backward", self.back_zoom))
        notes = tuple(
            f"the {kind} op zoom could not inspect {z.error}" for kind, z in zooms if z is not None and z.error
        )
        overflows: tuple[OpOverflow, ...] = ()
        peaks: tuple[OpPeak, ...] = ()
        if self.hidden is not None:
            values = self.hidden.read_values(self.collector, stats)
            overflows = self.hidden.records(values, recorder.calls)
            peaks = op_peaks(self.hidden, values, trace.calls)
            if self.hidden.error:
                notes += (f"the hidden-overflow watch could not inspect {self.hidden.error}",)
        if self.emulated is not None:
            notes += tuple(self.emulated.notes())
        notes += transform_note(recorder.transformed_calls, self.hidden.transformed_ops if self.hidden else 0)
        self.first = dataclasses.replace(
            trace, op_finding=finding, backward_op_finding=backward_finding, comparisons=comparisons, notes=notes,
            autocast=self.autocast_on, op_overflows=overflows, op_peaks=peaks,
            low_ops=sum(n.dtype in LOW_NAMES for n in self.hidden.nodes) if self.hidden is not None else 0,
            unmeasured=recorder.transformed_calls + (self.hidden.transformed_ops if self.hidden else 0),
        )
        return self.first

    @uninterrupted
    def close(self) -> None:
        """Drop the graph and every hook; put global state (grad mode, anomaly, emulation) back; Ctrl-C waits."""
        self.output = self.loss = None
        try:
            self.recorder.remove()
            self.region.close()
            self.contexts.close()
            if self.hidden is not None:
                # The watch and its pause refer to each other: without that cycle the pass's host records go
                # by reference counting, even while the diagnosis keeps the cyclic collector off.
                self.recorder.paused = self.hidden.paused = None  # type: ignore[assignment]
        finally:
            if self._resume_gc is not None:
                self._resume_gc()
            if self._undo is not None:
                cleaned(self._undo)
                self._undo = None


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
    put_back = _set_grads_aside([*_leaves(scaled), *params])
    try:
        scaled.backward()
    finally:
        put_back()


@uninterrupted
def _set_grads_aside(tensors: list[torch.Tensor]) -> Callable[[], None]:
    """Set every ``.grad`` of ``tensors`` to None; returns the (idempotent, owned) undo that puts them back."""
    saved = [(t, t.grad) for t in {id(t): t for t in tensors}.values()]

    @uninterrupted
    def put_back() -> None:
        for t, grad in saved:
            t.grad = grad
        cleaned(put_back)

    on_cleanup(put_back)
    for t, _ in saved:
        t.grad = None
    return put_back


@contextlib.contextmanager
def _anomaly(enabled: bool) -> Iterator[None]:
    """Anomaly mode exactly as the pass needs it, whatever the user set: on (forward stacks recorded) only for
    the backward zoom, and never ``check_nan``, which would raise on the very gradients being diagnosed. The
    user's setting (``check_nan`` included) is back afterwards."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        with torch.autograd.set_detect_anomaly(enabled, check_nan=False):
            yield


def capture_params(spec: PassSpec, modules: list[tuple[str, nn.Module]], detailed: bool = True) -> list[ModuleInfo]:
    """Statistics of every module's own parameters, read back at once (they do not change per pass): min, max and
    zeros, or every detailed statistic."""
    collector = StatsCollector(spec.dtype, detailed=detailed)
    canonical = {id(p): name for name, p in spec.params}
    owned = [(name, module, _own_parameters(module)) for name, module in modules]
    slots: dict[int, int] = {}
    if not detailed:  # survey level: small parameters measured together, per device (a few ops, not a few each)
        unique = list({id(p): p for _, _, own in owned for _, p in own}.values())
        for device in {p.device for p in unique}:
            same: list[torch.Tensor] = [p for p in unique if p.device == device]
            slots.update((id(p), slot) for p, (slot, _) in zip(same, collector.add_many(same, False)))
    layout = []
    for name, module, own in owned:
        params = [(canonical.get(id(p), f"{name}.{local}"), p) for local, p in own]
        layout.append((name, type(module).__name__, [(pname, slots[id(p)] if id(p) in slots else collector.add(p),
                                                      p.requires_grad) for pname, p in params]))
    stats = collector.read()
    return [
        ModuleInfo(name, class_name, tuple(ParamRecord(pname, stats[slot], rg) for pname, slot, rg in params))
        for name, class_name, params in layout
    ]


_NAMED_PARAMETERS = nn.Module.named_parameters


def _own_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``list(module.named_parameters(recurse=False))`` without torch's generic walk (a few microseconds a module
    on a model of ten thousand): the module's own registered parameters, each once."""
    if type(module).named_parameters is not _NAMED_PARAMETERS:  # a wrapper with its own naming (FSDP): ask it
        return list(module.named_parameters(recurse=False))
    own = module._parameters
    if not own:
        return []
    seen: set[int] = set()
    out = []
    for name, p in own.items():
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out
