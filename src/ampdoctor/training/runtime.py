"""Training-time watch: ``ampdoctor.watch(model, scaler)`` around an unchanged autocast + GradScaler loop.

>>> with ampdoctor.watch(model, scaler, loss_fn=lambda out, targets: criterion(out, targets)) as doctor:
...     for inputs, targets in loader:
...         doctor.set_targets(targets)                 # optional: what loss_fn gets in a replay
...         with torch.autocast("cuda"):
...             loss = criterion(model(inputs), targets)
...         scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()
>>> report = doctor.report()        # same Report type as ampdoctor.diagnose, plus report.steps

How it works (ARCHITECTURE.md §1-§3):

* **Step boundaries** come from ``scaler.update``, which the watch wraps (an instance attribute; put back on
  exit, also after an exception). ``scaler.scale`` is wrapped too, to see the loss. Nothing of the scaler's
  behaviour changes.
* **Always on, every step** (cheap): the root module's inputs (kept by reference, for a replay), the torch RNG
  state before each forward, the loss, the root outputs' min/max, the scale before and after ``update`` and
  GradScaler's own found-inf flags. They stay on the device and are read back once per step, in ``update``,
  which already synchronises through ``scaler.step``.
* **Sampled** (every ``stats_every`` steps): forward hooks on every module and tensor hooks on what they return
  (abs max and non-finite flags of outputs and output gradients; hooks on a view's base, never a
  module-level backward hook). The hooks are installed only for sampled steps.
* **A skipped step is never left unexplained by sampling**: the first skipped step of every run of skipped
  steps, and the step where a run turns persistent, get a full ``ampdoctor.diagnose`` on the inputs of the
  failing forward, with the RNG state of that forward (the parameters are those of the failing forward: a
  skipped step does not update them). Later skips of the same run point at that capture (``explained_by``).
  The capture's backward uses ``loss_fn``; without it, the output's own loss, or else the gradient the real
  loss sent into the model's outputs (kept for the step), so the replayed backward is the real one.
* A run of skipped steps is **harmless** when it ends with a good step at a scale >= 1 and a finite forward,
  **persistent** when the forward is non-finite or the scale falls below 1 (ARCHITECTURE.md §2).
* On the first persistent failure a **failure bundle** is written atomically (one ``torch.save`` file that
  loads with ``weights_only=True``): inputs, model state, scaler state, RNG state and the records as JSON text.
  :func:`replay_bundle` diagnoses it again from a model factory.
* **DDP**: names come from the wrapped ``.module``; each rank records on its own (no collective per step);
  ``report()`` gathers the ranks once (``all_gather_object``, so every rank must call it) and says which rank
  and step first went non-finite, from that rank's own forward statistics and its own pre-reduction gradients.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import math
import os
import random
import tempfile
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Optional, Union

import numpy as np
import torch
from torch import nn

from .._version import __version__
from ..analysis import Findings, NearLimit, Origin, ScaleFinding, ScaleProbe, headroom_bits
from ..capture.dtypes import dtype_name
from ..capture.hooks import register_grad_hook
from ..capture.model import unwrap_model
from ..capture.stats import format_limits
from ..capture.walk import iter_tensors
from ..errors import AmpDoctorError
from ..records import FrozenMap, ModuleInfo, PassTrace, RunInfo, RunStatus, StepRecord, Verdict
from ..report import Report
from ..serial import from_plain, to_plain
from ..thresholds import HEADROOM_TIGHT_BITS, HEADROOM_WARN_BITS

LossFn = Callable[[Any, Any], torch.Tensor]
PathLike = Union[str, "os.PathLike[str]"]

# Per-module statistics every this many steps by default (every skipped step is captured regardless).
DEFAULT_STATS_EVERY = 50
# Steps kept in the ring buffer.
DEFAULT_HISTORY = 2048
# Full captures (a diagnose on the failing inputs) per kind of run: harmless-looking runs and persistent ones.
DEFAULT_MAX_CAPTURES = 8
# Root forwards kept per step for a replay (gradient accumulation); beyond this the oldest are dropped.
MAX_MICRO_BATCHES = 64
# Candidates tried per capture when no micro-batch had a non-finite loss (the overflow was in the backward).
MAX_REPLAYS_PER_CAPTURE = 4
# Without loss_fn, the gradient of the loss w.r.t. the root outputs is kept per step (to replay the real backward
# in a capture) while it takes at most this many bytes; beyond, a capture falls back to a surrogate loss.
MAX_KEPT_OUTPUT_GRAD_BYTES = 256 * 2**20
# A replay never runs below this scale (GradScaler's scale can underflow towards 0 in a persistent failure).
MIN_REPLAY_SCALE = 2.0**-24
# Runs of skipped steps remembered (the first persistent one is always kept).
MAX_RUNS_KEPT = 1000
# Headroom trend: warn when a layer's output headroom is under HEADROOM_TIGHT_BITS and fell at least this much
# across at least TREND_MIN_SAMPLES sampled steps.
TREND_DROP_BITS = 1.0
TREND_MIN_SAMPLES = 3
# Run states.
HARMLESS: RunStatus = "harmless"
PERSISTENT: RunStatus = "persistent"
OPEN: RunStatus = "open"
BUNDLE_FORMAT = "ampdoctor-bundle"
BUNDLE_VERSION = 1
_ERRORS_KEPT = 5
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


# -- small helpers -----------------------------------------------------------------------------------------


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype in force for ``device_type`` right now, or None when autocast is off."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return None
    except TypeError:  # torch < 2.4: no device argument
        if device_type == "cpu":
            return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _detach(obj: Any) -> Any:
    """The same structure with every tensor detached (no copy, no graph kept alive)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, tuple) and all(isinstance(v, torch.Tensor) for v in obj) and type(obj) is tuple:
        return tuple(v.detach() for v in obj)
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, obj)


def _weight_versions(model: nn.Module) -> int:
    """A cheap fingerprint of in-place updates to the parameters (optimizer steps bump ``_version``)."""
    return sum(p._version for p in model.parameters())


def _versions(args: Any, kwargs: Any) -> list[int]:
    return [t._version for _, t in iter_tensors((args, kwargs), "")]


def _bad_pair(lo: float, hi: float) -> bool:
    """Non-finite, unless the only non-finite values are ``-inf`` (an additive mask, not an overflow)."""
    return math.isnan(lo) or math.isnan(hi) or hi == math.inf


def as_batch(model: nn.Module, args: Any, kwargs: Mapping[str, Any]) -> Any:
    """The ``diagnose`` batch (Tensor, tuple or dict) that calls ``model`` like ``model(*args, **kwargs)``."""
    args = tuple(args)
    if not kwargs:
        if len(args) == 1 and isinstance(args[0], torch.Tensor):
            return args[0]
        return args
    if not args:
        return dict(kwargs)
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        raise AmpDoctorError(f"cannot replay a call with both positional and keyword inputs: {exc}") from exc
    out: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind == inspect.Parameter.VAR_POSITIONAL:
            raise AmpDoctorError("cannot replay a call that passes *args together with keyword inputs")
        if kind == inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


# -- per-step state ----------------------------------------------------------------------------------------


@dataclass
class _MicroBatch:
    """One root forward of the current step (several with gradient accumulation)."""

    args: Any
    kwargs: Any
    versions: list[int]
    cpu_rng: torch.Tensor
    cuda_rng: Optional[list[torch.Tensor]]
    targets: Any = None
    loss_slot: Optional[int] = None  # index into the step's values
    loss_value: Optional[float] = None  # after the step's readback
    root_slots: list[int] = field(default_factory=list)  # (lo, hi) pairs: first index of each pair
    own_loss: bool = False  # the output carries its loss (scalar, .loss, ['loss']): diagnose finds it
    weight_versions: int = 0  # sum of the parameters' in-place versions at the forward: did an optimizer step?
    expected_grads: set[str] = field(default_factory=set)  # output paths whose gradient is kept
    out_grads: dict[str, torch.Tensor] = field(default_factory=dict)  # scaled gradient w.r.t. each output


@dataclass
class _Run:
    """A run of consecutive bad steps (skipped, or with a non-finite forward)."""

    start: int
    end: Optional[int] = None  # the last bad step, once the run has ended with a good step
    status: RunStatus = OPEN
    persistent_step: Optional[int] = None
    reason: str = ""
    skips: int = 0
    capture_step: Optional[int] = None  # the step whose capture explains the run so far
    harmless_scale: Optional[float] = None  # the scale of the good step that ended a harmless run


@dataclass
class _Capture:
    step: int
    report: Report
    micro: int
    local_nonfinite: bool


class _Collector:
    """0-d device tensors of one step, with what each one is; read back in one transfer per device."""

    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []
        self.layout: list[tuple[int, str, str, bool]] = []  # (index of lo, kind, module, low dtype) per pair

    def add(self, value: torch.Tensor) -> int:
        self.values.append(value)
        return len(self.values) - 1

    def pair(self, kind: str, module: str, t: torch.Tensor, low: bool) -> int:
        index = len(self.values)
        self.values += torch.aminmax(t)  # one pass; NaN and inf show up in the result
        self.layout.append((index, kind, module, low))
        return index

    def read(self) -> list[float]:
        """Every value as a Python float: one ``stack`` + ``tolist`` per device (all values are 0-d)."""
        if not self.values:
            return []
        try:
            # Mixed float16/bfloat16/float32 promote in stack; their values are exact in the result.
            out: list[float] = torch.stack(self.values).tolist()
            return out
        except RuntimeError:  # values on several devices (a model split across them)
            pass
        numbers: list[float] = [math.nan] * len(self.values)
        for device in {v.device for v in self.values}:
            positions = [i for i, v in enumerate(self.values) if v.device == device]
            read = torch.stack([self.values[i] for i in positions]).tolist()
            for i, value in zip(positions, read):
                numbers[i] = value
        return numbers


# -- the watch ---------------------------------------------------------------------------------------------


class Watch:
    """Watches an unchanged AMP training loop; see :func:`watch`. Use as a context manager."""

    def __init__(
        self,
        model: nn.Module,
        scaler: Any = None,
        *,
        loss_fn: Optional[LossFn] = None,
        dtype: Optional[torch.dtype] = None,
        stats_every: int = DEFAULT_STATS_EVERY,
        history: int = DEFAULT_HISTORY,
        max_captures: int = DEFAULT_MAX_CAPTURES,
        bundle_dir: Optional[PathLike] = None,
        save_bundle: bool = True,
    ) -> None:
        if dtype not in (None, torch.float16, torch.bfloat16):
            raise AmpDoctorError(f"dtype must be torch.float16, torch.bfloat16 or None, got {dtype}")
        if scaler is not None and not all(callable(getattr(scaler, m, None)) for m in ("scale", "update")):
            raise AmpDoctorError(
                f"scaler must be a GradScaler (with scale() and update()), got {type(scaler).__name__}"
            )
        if history < 1:
            raise AmpDoctorError(f"history must be at least 1, got {history}")
        self.model = model
        self.root, wrappers = unwrap_model(model)
        self._wrap_notes = [
            f"{type(model).__name__} wrapper peeled: module names are those of the wrapped model; a capture re-runs "
            "it on its own rank, outside the wrapper"
        ] if wrappers else []
        self.scaler = scaler
        self.loss_fn = loss_fn
        self.stats_every = max(0, int(stats_every))
        self.max_captures = max(0, int(max_captures))
        self.bundle_dir = bundle_dir
        self.save_bundle = save_bundle
        self.bundle_path: Optional[Path] = None
        self._low: Optional[torch.dtype] = dtype
        param = next(self.root.parameters(), None)
        self.device_type = param.device.type if param is not None else "cpu"
        self.rank, self.world_size = _rank_and_world()
        self._names = {id(m): name for name, m in self.root.named_modules()}
        self._steps: deque[StepRecord] = deque(maxlen=history)
        self._runs: list[_Run] = []
        self._open_run: Optional[_Run] = None
        self._failure: Optional[_Capture] = None
        self._captures: list[_Capture] = []
        self._captures_used = {HARMLESS: 0, PERSISTENT: 0}
        self._first_local: Optional[int] = None
        self._step = 0
        self._errors: list[str] = []
        self._notes: list[str] = []
        self._busy = False
        self._active = False
        self._root_handles: list[Any] = []
        self._module_handles: list[Any] = []
        self._tensor_handles: list[Any] = []
        self._patched: list[tuple[str, bool, Any]] = []
        self._targets: Any = None
        self._new_step_state()

    # -- lifecycle ------------------------------------------------------------------------------------------
    def __enter__(self) -> Watch:
        self.start()
        return self

    def __exit__(
        self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.close()

    def start(self) -> Watch:
        """Install the root hooks and wrap the scaler (``__enter__`` does this)."""
        if self._active:
            return self
        self._active = True
        try:
            self._root_handles.append(self.root.register_forward_pre_hook(self._root_pre, with_kwargs=True))
            self._root_handles.append(self.root.register_forward_hook(self._root_post, with_kwargs=True))
            if self.scaler is not None:
                self._patch("scale", self._wrap_scale(self.scaler.scale))
                self._patch("update", self._wrap_update(self.scaler.update))
            self._sample_hooks(self._sampled(self._step))
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Remove every hook and put the scaler's methods back; the records stay (``__exit__`` does this)."""
        for handle in itertools.chain(self._tensor_handles, self._module_handles, self._root_handles):
            handle.remove()
        self._tensor_handles.clear()
        self._module_handles.clear()
        self._root_handles.clear()
        for name, had_own, original in reversed(self._patched):
            if had_own:
                setattr(self.scaler, name, original)
            else:
                self.scaler.__dict__.pop(name, None)
        self._patched.clear()
        self._micro.clear()  # no reference to the user's inputs (or targets) after the block
        self._targets = None
        self._collector = _Collector()
        self._active = False

    def _patch(self, name: str, wrapper: Callable[..., Any]) -> None:
        had_own = name in self.scaler.__dict__
        self._patched.append((name, had_own, self.scaler.__dict__.get(name)))
        setattr(self.scaler, name, wrapper)

    # -- public verbs ----------------------------------------------------------------------------------------
    def set_targets(self, targets: Any) -> None:
        """Targets of the current batch (call it before ``scaler.scale(loss)``): a capture and a replay call
        ``loss_fn(output, targets)`` with them (without targets, ``loss_fn(output, batch)``)."""
        self._targets = _detach(targets)
        if self._micro and self._micro[-1].loss_slot is None:  # between its forward and scaler.scale(loss)
            self._micro[-1].targets = self._targets

    def step(self) -> None:
        """Close a step by hand, for loops without a GradScaler (bfloat16): after the backward, before
        ``optimizer.step()``, so a capture replays the weights of the failing forward. With a scaler, ``update``
        does it."""
        self._end_step(None, None, [])

    @property
    def steps(self) -> list[StepRecord]:
        """The recorded steps still in the ring buffer, oldest first (without the ``run`` verdicts)."""
        return list(self._steps)

    def headroom_trends(self) -> dict[str, list[tuple[int, float]]]:
        """Per module, ``(step, headroom bits)`` of its low-precision outputs on each sampled step kept."""
        return _trends(list(self._steps), format_limits(self._low or torch.float16).max)

    def report(self, merge: Optional[bool] = None) -> Report:
        """The Report of the run so far (same type as ``diagnose``), with ``.steps``.

        ``verdict``/``forward_origin``/``backward_origin`` describe the first persistent failure;
        ``"scale_overflow"`` when only harmless (or still open) runs of skipped steps happened. In a distributed
        run (``merge=None`` and a process group of more than one rank) this gathers every rank's records once:
        every rank must call it.
        """
        payload = self._payload()
        rank, world = _rank_and_world()
        if merge is None:
            merge = world > 1
        payloads = [payload]
        if merge and world > 1:
            import torch.distributed as dist

            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, payload)
            payloads = [p for p in gathered if p is not None]
        return compose_report(payloads, rank)

    # -- hooks: root ----------------------------------------------------------------------------------------
    def _root_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._busy or not torch.is_grad_enabled():  # an evaluation forward is no training step
            return
        try:
            if self._low is None:
                self._low = _autocast_dtype(self.device_type)
            cuda_rng = (
                torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
            )
            kept_args, kept_kwargs = _detach(args), _detach(kwargs) if kwargs else {}
            micro = _MicroBatch(
                kept_args, kept_kwargs, _versions(kept_args, kept_kwargs), torch.get_rng_state(), cuda_rng,
                targets=self._targets, weight_versions=_weight_versions(module),
            )
            if len(self._micro) >= MAX_MICRO_BATCHES:
                self._micro.popleft()
                self._dropped_micro += 1
            self._micro.append(micro)
            self._forwards += 1
        except Exception as exc:  # never raise inside the user's forward
            self._fail(exc)

    def _root_post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._busy or not torch.is_grad_enabled() or not self._micro:
            return
        try:
            micro = self._micro[-1]
            low = self._low
            micro.own_loss = _has_own_loss(output)
            keep = self.loss_fn is None and not micro.own_loss
            for path, t in iter_tensors(output, "out"):
                if not t.is_floating_point() or t.numel() == 0:
                    continue
                micro.root_slots.append(self._collector.pair("root", "", t.detach(), t.dtype == low))
                if t.requires_grad:
                    if self._grads_on:
                        self._grad_hook(t, "")
                    if keep:
                        self._keep_grad(micro, path, t)
        except Exception as exc:
            self._fail(exc)

    def _keep_grad(self, micro: _MicroBatch, path: str, t: torch.Tensor) -> None:
        """Keep the gradient reaching this output (the real loss's, scaled) until the step ends."""
        nbytes = t.numel() * t.element_size()
        if self._kept_bytes + nbytes > MAX_KEPT_OUTPUT_GRAD_BYTES:
            micro.expected_grads.add(path)  # expected, never kept: the capture falls back to a surrogate
            return
        self._kept_bytes += nbytes
        micro.expected_grads.add(path)

        def receive(g: torch.Tensor) -> None:
            if not self._busy:
                micro.out_grads[path] = g.detach()

        self._tensor_handles.append(register_grad_hook(t, receive)[0])

    # -- hooks: sampled steps -------------------------------------------------------------------------------
    def _module_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._busy:
            return
        try:
            name = self._names.get(id(module), "")
            if not name:
                return  # the root: recorded by _root_post
            low = self._low
            if isinstance(output, torch.Tensor):
                tensors: Any = ((None, output),)
            else:
                tensors = iter_tensors(output, "out")
            for _, t in tensors:
                if not t.is_floating_point() or t.numel() == 0:
                    continue
                self._collector.pair("out", name, t.detach(), t.dtype == low)
                if t.requires_grad and self._grads_on:
                    self._grad_hook(t, name)
        except Exception as exc:
            self._fail(exc)

    def _grad_hook(self, t: torch.Tensor, name: str) -> None:
        low = t.dtype == self._low
        collector = self._collector

        def receive(g: torch.Tensor) -> None:
            if self._busy or collector is not self._collector:
                return
            try:
                if g.numel():
                    collector.pair("grad", name, g.detach(), low)
            except Exception as exc:
                self._fail(exc)

        self._tensor_handles.append(register_grad_hook(t, receive)[0])

    def _sampled(self, step: int) -> bool:
        return self.stats_every > 0 and step % self.stats_every == 0

    def _sample_hooks(self, on: bool) -> None:
        """Module hooks only while a sampled step runs; an unsampled step runs the model's fast path."""
        self._grads_on = on
        if on and not self._module_handles:
            for module in self.root.modules():
                if module is not self.root:
                    self._module_handles.append(module.register_forward_hook(self._module_post))
        elif not on and self._module_handles:
            for handle in self._module_handles:
                handle.remove()
            self._module_handles.clear()

    # -- the scaler -----------------------------------------------------------------------------------------
    def _wrap_scale(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def scale(outputs: Any) -> Any:
            result = original(outputs)
            if self._active and not self._busy:
                try:
                    self._see_loss(outputs)
                except Exception as exc:
                    self._fail(exc)
            return result

        scale.__wrapped__ = original  # type: ignore[attr-defined]
        return scale

    def _see_loss(self, outputs: Any) -> None:
        tensors = [t for _, t in iter_tensors(outputs, "loss") if t.is_floating_point() and t.numel()]
        if not tensors:
            return
        value = tensors[0].detach()
        value = value.reshape(()) if value.numel() == 1 else value.float().sum()
        for extra in tensors[1:]:
            value = value.float() + extra.detach().float().sum()
        slot = self._collector.add(value)
        if self._micro:
            micro = self._micro[-1]
            micro.loss_slot = slot
            if self._targets is not None:
                micro.targets = self._targets
        else:
            self._orphan_losses.append(slot)
        self._targets = None  # targets belong to one micro-batch

    def _wrap_update(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def update(*args: Any, **kwargs: Any) -> Any:
            before: Any = None
            found: list[torch.Tensor] = []
            if self._active:
                try:
                    before = self._scale_value()
                    found = self._found_inf()
                except Exception as exc:
                    self._fail(exc)
            try:
                result = original(*args, **kwargs)
            except BaseException:
                self._new_step_state()
                raise
            if self._active:
                try:
                    after = self._scale_value()
                except Exception as exc:
                    self._fail(exc)
                    after = None
                self._end_step(before, after, found)
            return result

        update.__wrapped__ = original  # type: ignore[attr-defined]
        return update

    def _scale_value(self) -> Union[torch.Tensor, float]:
        """The scale as a device tensor (no sync), or 1.0 for a disabled scaler."""
        scaler = self.scaler
        if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
            return 1.0
        tensor = getattr(scaler, "_scale", None)
        if isinstance(tensor, torch.Tensor):
            return tensor.detach().clone().reshape(())
        return float(scaler.get_scale())

    def _found_inf(self) -> list[torch.Tensor]:
        """GradScaler's own found-inf flags of this step (read before ``update`` clears them)."""
        states = getattr(self.scaler, "_per_optimizer_states", None)
        if not isinstance(states, Mapping):
            return []
        found = []
        for state in states.values():
            per_device = state.get("found_inf_per_device", {}) if isinstance(state, Mapping) else {}
            found += [v.reshape(()) for v in per_device.values() if isinstance(v, torch.Tensor)]
        return found

    # -- the step boundary ----------------------------------------------------------------------------------
    def _new_step_state(self) -> None:
        self._micro: deque[_MicroBatch] = deque()
        self._collector = _Collector()
        self._orphan_losses: list[int] = []
        self._forwards = 0
        self._dropped_micro = 0
        self._kept_bytes = 0
        for handle in getattr(self, "_tensor_handles", []):
            handle.remove()
        self._tensor_handles = []
        self._grads_on = bool(getattr(self, "_module_handles", None))

    def _end_step(self, before: Any, after: Any, found: list[torch.Tensor]) -> None:
        """One readback, then records, run bookkeeping, captures and the bundle. Never raises."""
        step = self._step
        collector, micro = self._collector, list(self._micro)
        sampled = bool(self._module_handles)
        forwards, orphans = self._forwards, self._orphan_losses
        if self._dropped_micro:
            self._note(f"step {step}: {self._dropped_micro} early forward(s) of {forwards} not kept for a replay "
                       f"(at most {MAX_MICRO_BATCHES} per step)")
        for handle in self._tensor_handles:
            handle.remove()
        self._tensor_handles = []
        try:
            base = len(collector.values)
            head = [v for v in (before, after) if isinstance(v, torch.Tensor)]
            for v in head + found:
                collector.add(v)
            numbers = collector.read()  # the one host transfer of this step
            tail = iter(numbers[base:])
            scale_before = next(tail) if isinstance(before, torch.Tensor) else float(before or 1.0)
            scale_after = next(tail) if isinstance(after, torch.Tensor) else float(after or scale_before)
            found_sum = sum(tail) if found else None
            record, bad_micro = self._record(
                step, numbers, collector, micro, orphans, sampled, forwards, scale_before, scale_after, found_sum
            )
            self._steps.append(self._track(record, micro, bad_micro))
        except Exception as exc:
            self._fail(exc)
        finally:
            self._step += 1
            self._new_step_state()
            try:
                self._sample_hooks(self._active and self._sampled(self._step))
            except Exception as exc:
                self._fail(exc)

    def _record(
        self,
        step: int,
        numbers: list[float],
        collector: _Collector,
        micro: list[_MicroBatch],
        orphans: list[int],
        sampled: bool,
        forwards: int,
        scale_before: float,
        scale_after: float,
        found_sum: Optional[float],
    ) -> tuple[StepRecord, list[bool]]:
        """The step's record from the numbers read back, and which micro-batches had a non-finite forward."""
        for m in micro:
            m.loss_value = numbers[m.loss_slot] if m.loss_slot is not None else None
        losses = [m.loss_value for m in micro if m.loss_value is not None] + [numbers[i] for i in orphans]
        bad_micro = [
            (m.loss_slot is not None and not math.isfinite(numbers[m.loss_slot]))
            or any(_bad_pair(numbers[i], numbers[i + 1]) for i in m.root_slots)
            for m in micro
        ]
        forward_finite = not any(bad_micro) and all(math.isfinite(numbers[i]) for i in orphans)
        skipped = found_sum > 0 if found_sum is not None else scale_after < scale_before
        out_max: dict[str, float] = {}
        grad_max: dict[str, float] = {}
        bad_out: list[str] = []
        bad_grad: list[str] = []
        if sampled:
            for index, kind, module, low in collector.layout:
                lo, hi = numbers[index], numbers[index + 1]
                maxima, bad = (grad_max, bad_grad) if kind == "grad" else (out_max, bad_out)
                if _bad_pair(lo, hi):
                    if module not in bad:
                        bad.append(module)
                    continue
                if not low:
                    continue  # only tensors in the low-precision format can overflow it
                value = max(abs(hi), abs(lo) if math.isfinite(lo) else 0.0)  # -inf masks: the finite side
                if kind == "grad" and scale_before:
                    value /= scale_before  # gradients are stored unscaled, like everywhere else
                maxima[module] = max(maxima.get(module, 0.0), value)
        record = StepRecord(
            step=step,
            scale=scale_before,
            skipped=skipped,
            loss=(sum(losses) / len(losses)) if losses else None,
            rank=self.rank,
            forward_finite=forward_finite,
            new_scale=scale_after,
            micro_batches=forwards,
            sampled=sampled,
            out_abs_max=FrozenMap(out_max),
            grad_abs_max=FrozenMap(grad_max),
            nonfinite_outputs=tuple(bad_out),
            nonfinite_grads=tuple(bad_grad),
            # this rank's own forward, or its own gradients before any all-reduce, went non-finite
            local_nonfinite=not forward_finite or bool(bad_out) or bool(bad_grad),
        )
        return record, bad_micro

    # -- runs, captures, bundle -----------------------------------------------------------------------------
    def _track(self, record: StepRecord, micro: list[_MicroBatch], bad_micro: list[bool]) -> StepRecord:
        """Run bookkeeping (harmless / persistent), captures and the bundle for one step."""
        bad = record.skipped or not record.forward_finite
        run = self._open_run
        if not bad:
            if run is not None:
                run.end = record.step - 1
                if run.status == OPEN:
                    run.status = HARMLESS  # ended by a good step at a scale >= 1 with a finite forward
                    run.harmless_scale = record.scale
                self._open_run = None
            return record
        capture_kind: Optional[RunStatus] = None
        if run is None:
            run = self._open_run = _Run(start=record.step)
            if len(self._runs) >= MAX_RUNS_KEPT:
                self._runs.pop(1 if self._runs[0].status == PERSISTENT else 0)
            self._runs.append(run)
            capture_kind = HARMLESS
        run.skips += int(record.skipped)
        if run.status != PERSISTENT:
            reason = ""
            if not record.forward_finite:
                reason = "the forward was non-finite (loss or model output)"
            elif record.skipped and record.new_scale is not None and record.new_scale < 1:
                reason = f"the scale fell below 1 ({record.new_scale:g}): gradients are non-finite even unscaled"
            if reason:
                run.status = PERSISTENT
                run.persistent_step = record.step
                run.reason = reason
                capture_kind = PERSISTENT
        capture: Optional[_Capture] = None
        if capture_kind is not None and micro and self._captures_used[capture_kind] < self.max_captures:
            self._captures_used[capture_kind] += 1
            capture = self._capture(record, micro, bad_micro)
            if capture is not None:
                self._captures.append(capture)
                run.capture_step = record.step
                record = _with_capture(record, capture.report, capture.local_nonfinite)
                if capture_kind == PERSISTENT:
                    self._failure = self._failure or capture
        elif run.capture_step is not None:
            explained = next((c for c in reversed(self._captures) if c.step == run.capture_step), None)
            if explained is not None:
                record = dataclasses.replace(
                    _with_capture(record, explained.report, None), captured=False, explained_by=explained.step
                )
        if capture_kind == PERSISTENT and micro and self.save_bundle and self.bundle_path is None:
            # the batch that failed, captured or not: it can be replayed later (``replay_bundle``)
            index = capture.micro if capture is not None else _first_bad(bad_micro)
            self._write_bundle(record, micro[index], capture)
        if record.local_nonfinite and self._first_local is None:
            self._first_local = record.step
        return record

    def _capture(self, record: StepRecord, micro: list[_MicroBatch], bad_micro: list[bool]) -> Optional[_Capture]:
        """Diagnose the failing forward's inputs: a micro-batch with a non-finite forward first."""
        from ..api import diagnose

        order = sorted(range(len(micro)), key=lambda i: (not bad_micro[i], i))
        first: Optional[_Capture] = None
        for index in order[:MAX_REPLAYS_PER_CAPTURE]:
            try:
                report = self._replay(diagnose, micro[index], record.scale, record.step)
            except Exception as exc:
                self._note(f"step {record.step}: the capture could not replay the batch ({type(exc).__name__}: {exc})")
                continue
            found = report.forward_origin is not None or report.backward_origin is not None
            capture = _Capture(record.step, report, index, found)
            first = first or capture
            if found:
                return capture
        return first

    def _replay(self, diagnose: Callable[..., Report], m: _MicroBatch, scale: float, step: int) -> Report:
        """``diagnose`` on a kept micro-batch, with the RNG state of its forward; the watch's hooks stay quiet."""
        batch = as_batch(self.root, m.args, m.kwargs)
        low = self._low or torch.float16
        loss_fn, backward, notes, bad_grad = self._capture_loss(m, scale)
        if _weight_versions(self.root) != m.weight_versions:
            notes.append(
                "the weights changed between the failing forward and this capture (the optimizer stepped on the "
                "non-finite gradients first): the replay ran on the updated weights; close bfloat16 steps with "
                "doctor.step() before optimizer.step()"
            )
        if _versions(m.args, m.kwargs) != m.versions:
            notes.append("the batch tensors were modified in place after the forward; the capture replayed their "
                         "current contents")
        saved_cpu = torch.get_rng_state()
        saved_cuda = (
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        )
        self._busy = True
        try:
            torch.set_rng_state(m.cpu_rng)  # the failing forward's dropout masks
            if m.cuda_rng is not None:
                torch.cuda.set_rng_state_all(m.cuda_rng)
            report = diagnose(
                self.root, batch, loss_fn=loss_fn, dtype=low, device_type=self.device_type,
                scale=max(scale, MIN_REPLAY_SCALE), backward=backward,
            )
        finally:
            self._busy = False
            torch.set_rng_state(saved_cpu)
            if saved_cuda is not None:
                torch.cuda.set_rng_state_all(saved_cuda)
        if bad_grad is not None:
            report = _loss_gradient_origin(report, bad_grad[0], bad_grad[1], scale, low)
        run = dataclasses.replace(report.run, scale_source=f"the watched GradScaler at step {step}")
        return _add_notes(dataclasses.replace(report, run=run), notes)

    def _capture_loss(
        self, m: _MicroBatch, scale: float
    ) -> tuple[Optional[LossFn], bool, list[str], Optional[tuple[str, torch.Tensor]]]:
        """The loss a capture back-propagates: the user's, the output's own, or the real one replayed through
        the kept gradient w.r.t. the outputs. Returns (loss_fn, backward, notes, non-finite output gradient)."""
        if self.loss_fn is not None:
            return _bind_loss(self.loss_fn, m.targets), True, [], None
        if m.own_loss or not m.expected_grads:
            return None, True, [], None
        if set(m.out_grads) != m.expected_grads:
            return None, True, [
                "the gradient w.r.t. the model's output was not kept (too large, or never computed): the capture's "
                "backward used a surrogate loss; pass loss_fn= to watch for the real gradients"
            ], None
        for path, g in m.out_grads.items():
            if not bool(torch.isfinite(g).all()):
                return None, False, [], (path, g)
        notes = ["no loss_fn given: the capture replayed the loss through its recorded gradient w.r.t. the model's "
                 "output"]
        return output_grad_loss(m.out_grads, scale, m.loss_value), True, notes, None

    def _write_bundle(self, record: StepRecord, m: _MicroBatch, capture: Optional[_Capture]) -> None:
        try:
            records = {
                "steps": [to_plain(s) for s in itertools.chain(self._steps, [record])],
                "capture": capture.report.to_dict() if capture is not None else None,
            }
            data = {
                "format": BUNDLE_FORMAT,
                "version": BUNDLE_VERSION,
                "ampdoctor_version": __version__,
                "torch_version": str(torch.__version__),
                "step": record.step,
                "rank": self.rank,
                "world_size": self.world_size,
                "model_class": type(self.root).__name__,
                "args": _plain_tree(m.args),
                "kwargs": _plain_tree(m.kwargs),
                "targets": _plain_tree(m.targets),
                "output_grads": _kept_output_grads(m),
                "loss_value": m.loss_value if m.loss_value is not None and math.isfinite(m.loss_value) else None,
                "inputs_changed": _versions(m.args, m.kwargs) != m.versions,
                "training": self.root.training,
                "dtype": dtype_name(self._low or torch.float16),
                "device_type": self.device_type,
                "scale": record.scale,
                "model_state": {k: v.detach() for k, v in self.root.state_dict().items()},
                "scaler_state": dict(self.scaler.state_dict()) if self.scaler is not None else {},
                "rng": _rng_payload(m),
                "records": json.dumps(records, allow_nan=False),
            }
            directory = Path(self.bundle_dir) if self.bundle_dir is not None else Path.cwd()
            stem = f"ampdoctor-bundle-step{record.step}" + (f"-rank{self.rank}" if self.world_size > 1 else "")
            self.bundle_path = write_atomic(data, directory, stem)
        except Exception as exc:
            self._note(f"the failure bundle could not be written ({type(exc).__name__}: {exc})")

    # -- reporting ------------------------------------------------------------------------------------------
    def _payload(self) -> dict[str, Any]:
        """Everything ``report`` needs, as plain data (what ranks exchange)."""
        failure = self._failure
        first_skip = self._captures[0] if self._captures else None
        low = self._low or (torch.float16 if self._scaler_enabled() else torch.bfloat16)
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "steps": [to_plain(s) for s in self._steps],
            "runs": [dataclasses.asdict(r) for r in self._runs],
            "failure": failure.report.to_dict() if failure else None,
            "failure_step": failure.step if failure else None,
            "failure_local": failure.local_nonfinite if failure else False,
            "first_capture": first_skip.report.to_dict() if first_skip else None,
            "first_local": self._first_local,
            "bundle": str(self.bundle_path) if self.bundle_path else None,
            "notes": list(self._wrap_notes) + self._notes + [f"watch hook error: {e}" for e in self._errors],
            "modules": [(name, type(m).__name__) for name, m in self.root.named_modules()],
            "model_class": type(self.root).__name__,
            "device_type": self.device_type,
            "dtype": dtype_name(low),
            "stats_every": self.stats_every,
            "scale": self._steps[-1].new_scale if self._steps else None,
            "total_steps": self._step,
        }

    def _scaler_enabled(self) -> bool:
        return self.scaler is not None and bool(getattr(self.scaler, "is_enabled", lambda: True)())

    def _note(self, text: str) -> None:
        if len(self._notes) < 20:
            self._notes.append(text)

    def _fail(self, exc: BaseException) -> None:
        if len(self._errors) < _ERRORS_KEPT:
            self._errors.append(f"{type(exc).__name__}: {exc}")


# -- helpers shared by the watch, the report and the bundle ------------------------------------------------


def _kept_output_grads(m: _MicroBatch) -> Optional[dict[str, torch.Tensor]]:
    """The recorded gradient w.r.t. each output, when complete and finite (a bundle can replay the backward)."""
    if not m.expected_grads or set(m.out_grads) != m.expected_grads:
        return None
    if not all(bool(torch.isfinite(g).all()) for g in m.out_grads.values()):
        return None
    return {path: g.detach().clone() for path, g in m.out_grads.items()}


def _first_bad(flags: list[bool]) -> int:
    return next((i for i, bad in enumerate(flags) if bad), 0)


def _bind_loss(loss_fn: Optional[LossFn], targets: Any) -> Optional[LossFn]:
    """``loss_fn(output, targets)`` when targets were handed over, else ``loss_fn(output, batch)``."""
    if loss_fn is None or targets is None:
        return loss_fn
    bound: LossFn = loss_fn

    def with_targets(output: Any, batch: Any) -> torch.Tensor:
        return bound(output, targets)

    return with_targets


def _has_own_loss(output: Any) -> bool:
    """The output carries its loss, so ``diagnose`` back-propagates the real one without a loss_fn."""
    if isinstance(output, torch.Tensor):
        return output.numel() == 1
    if isinstance(getattr(output, "loss", None), torch.Tensor):
        return True
    return isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor)


class _GradReplay(torch.autograd.Function):
    """A loss term whose gradient w.r.t. ``output`` is a recorded (unscaled, float32) gradient.

    Times the replay's scale, autograd casts it to the output's dtype, as the real backward did.
    """

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(grad)
        return torch.zeros((), dtype=torch.float32, device=output.device)

    @staticmethod
    def backward(ctx: Any, upstream: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return upstream * grad, None


def output_grad_loss(grads: Mapping[str, torch.Tensor], scale: float, value: Optional[float]) -> LossFn:
    """A loss whose gradient w.r.t. each output is the recorded one (``grads`` are scaled by ``scale``), and
    whose value is the recorded loss value."""
    unscaled = {path: g.detach().float() / scale for path, g in grads.items()}

    def loss(output: Any, batch: Any) -> torch.Tensor:
        total: Optional[torch.Tensor] = None
        for path, t in iter_tensors(output, "out"):
            g = unscaled.get(path)
            if g is None or tuple(g.shape) != tuple(t.shape):
                continue
            term = _GradReplay.apply(t, g.to(t.device))
            total = term if total is None else total + term
        if total is None:
            raise AmpDoctorError("the recorded output gradients do not match the model's outputs")
        return total + (value if value is not None else 0.0)

    return loss


def _loss_gradient_origin(report: Report, path: str, grad: torch.Tensor, scale: float, low: torch.dtype) -> Report:
    """The gradient reaching the model's output was already non-finite: the backward origin is the loss/scale."""
    from ..analysis import classify
    from ..capture.stats import tensor_stats
    from ..records import LOSS

    stats = tensor_stats(grad, low).scaled_down(scale)
    origin = Origin("backward", LOSS, 0, "loss", f"grad:{path}", stats, None)
    verdict = report.verdict if report.verdict != "healthy" else classify(stats, None)
    findings = dataclasses.replace(report.findings, backward_origin=origin, verdict=verdict)
    note = (
        f"the gradient of the loss reaching the model's output ({path}) was already non-finite at scale {scale:g}: "
        "it overflowed before any layer ran backward; the capture replayed the forward only (pass loss_fn= to "
        "watch to replay the loss itself)"
    )
    return _add_notes(dataclasses.replace(report, findings=findings), [note])


def _with_capture(record: StepRecord, report: Report, local: Optional[bool]) -> StepRecord:
    """A step record with what a capture found: origins and the parameters with non-finite gradients."""
    fwd, bwd = report.forward_origin, report.backward_origin
    params = sorted(name for name, stats in report.trace.param_grads().items() if not stats.is_finite)
    return dataclasses.replace(
        record,
        forward_origin=fwd.label if fwd else None,
        backward_origin=bwd.label if bwd else None,
        nonfinite_params=tuple(params),
        captured=True,
        capture_verdict=report.verdict,
        local_nonfinite=record.local_nonfinite or bool(local),
    )


def _add_notes(report: Report, notes: list[str]) -> Report:
    if not notes:
        return report
    run = dataclasses.replace(report.run, notes=(*report.run.notes, *[n for n in notes if n not in report.run.notes]))
    return dataclasses.replace(report, run=run)


def _trends(steps: list[StepRecord], format_max: float) -> dict[str, list[tuple[int, float]]]:
    """Per module, (step, output headroom bits) on sampled steps; several ranks: the smallest headroom."""
    worst: dict[str, dict[int, float]] = {}
    for s in steps:
        for module, value in s.out_abs_max.items():
            per_step = worst.setdefault(module, {})
            per_step[s.step] = max(per_step.get(s.step, 0.0), value)
    out: dict[str, list[tuple[int, float]]] = {}
    for module, per_step in worst.items():
        series = []
        for step in sorted(per_step):
            value = per_step[step]
            bits = math.log2(format_max / value) if value > 0 else math.inf
            if math.isfinite(bits):
                series.append((step, bits))
        if series:
            out[module] = series
    return out


def _trend_warnings(steps: list[StepRecord], dtype: str) -> list[str]:
    """Layers whose output headroom is under HEADROOM_TIGHT_BITS and fell by TREND_DROP_BITS or more."""
    warnings = []
    for module, series in _trends(steps, format_limits(_DTYPES.get(dtype, torch.float16)).max).items():
        if len(series) < TREND_MIN_SAMPLES:
            continue
        (s0, b0), (s1, b1) = series[0], series[-1]
        if b1 >= HEADROOM_TIGHT_BITS or b0 - b1 < TREND_DROP_BITS or s1 <= s0:
            continue
        rate = (b0 - b1) / (s1 - s0)
        eta = f"; at this rate it overflows in about {b1 / rate:.0f} steps" if rate > 0 else ""
        warnings.append(
            f"{module or '<root>'} is losing headroom: its output went from {b0:.1f} to {b1:.1f} bits below the "
            f"{dtype} max between steps {s0} and {s1}{eta}"
        )
    return warnings


def _plain_tree(obj: Any, depth: int = 0) -> Any:
    """Tensors, numbers, strings, lists, tuples and dicts only: what ``torch.load(weights_only=True)`` reads."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()  # a view would save its whole storage
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if depth >= 8:
        return None
    if isinstance(obj, Mapping):
        return {str(k): _plain_tree(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain_tree(v, depth + 1) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_plain_tree(v, depth + 1) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain_tree(getattr(obj, f.name, None), depth + 1) for f in dataclasses.fields(obj)}
    return None


def _rng_payload(m: _MicroBatch) -> dict[str, Any]:
    """The torch RNG states before the failing forward; Python's and numpy's as they are now."""
    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
    return {
        "torch_cpu": m.cpu_rng.clone(),
        "torch_cuda": [s.clone() for s in m.cuda_rng] if m.cuda_rng is not None else [],
        "python": {"version": int(version), "state": [int(v) for v in state], "gauss": gauss},
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }


def write_atomic(obj: Any, directory: PathLike, stem: str) -> Path:
    """``torch.save`` to a temporary file, then link it to ``<stem>.pt`` (or ``<stem>-1.pt`` ...).

    The final name appears complete or not at all, and an existing file is never replaced.
    """
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        for n in itertools.count():
            final = folder / (f"{stem}.pt" if n == 0 else f"{stem}-{n}.pt")
            try:
                os.link(tmp, final)  # atomic, and fails rather than replace an existing file
            except FileExistsError:
                continue
            except OSError:  # a file system without hard links
                if final.exists():
                    continue
                os.rename(tmp, final)
            return final
        raise AssertionError("unreachable")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_bundle(path: PathLike) -> dict[str, Any]:
    """Read a failure bundle written by ``watch`` (``torch.load`` with ``weights_only=True``, on the CPU)."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise AmpDoctorError(f"no such file: {path}") from None
    except Exception as exc:
        raise AmpDoctorError(f"{path} is not an ampdoctor failure bundle ({type(exc).__name__}: {exc})") from exc
    if not isinstance(data, dict) or data.get("format") != BUNDLE_FORMAT:
        raise AmpDoctorError(f"{path} is not an ampdoctor failure bundle (no format marker {BUNDLE_FORMAT!r})")
    if int(data.get("version", 0)) > BUNDLE_VERSION:
        raise AmpDoctorError(
            f"{path} is a version {data.get('version')} bundle, newer than this ampdoctor reads ({BUNDLE_VERSION}); "
            "upgrade ampdoctor (pip install -U ampdoctor)"
        )
    return data


def is_bundle(path: PathLike) -> bool:
    """True when ``path`` is a failure bundle (a cheap check for front ends that accept several kinds of file)."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return False
    return isinstance(data, dict) and data.get("format") == BUNDLE_FORMAT


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_device(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_device(v, device) for v in obj)
    return obj


def replay_bundle(
    path: PathLike,
    model_factory: Callable[[], nn.Module],
    loss_fn: Optional[LossFn] = None,
    *,
    device: Optional[Union[str, torch.device]] = None,
    backward: Optional[bool] = None,
) -> Report:
    """Diagnose the failing batch saved in a failure bundle, on a fresh model from ``model_factory()``.

    The model gets the bundle's state dict, training flag and the torch RNG state of the failing forward, then
    ``ampdoctor.diagnose`` runs at the scale the step used. With ``loss_fn`` the backward is replayed too:
    ``loss_fn(output, targets)`` when the watch was given targets (``doctor.set_targets``), else
    ``loss_fn(output, batch)``. Without it, the backward is replayed only when the bundle holds the gradient the
    real loss sent into the model's outputs (watched without ``loss_fn``; ``backward=False`` skips it), or when
    ``backward=True`` (the loss then found as ``diagnose`` finds it). ``steps`` are the records in the bundle.
    """
    from ..api import diagnose

    data = load_bundle(path)
    model = model_factory()
    if not isinstance(model, nn.Module):
        raise AmpDoctorError(f"the model factory must return a torch.nn.Module, got {type(model).__name__}")
    root, _ = unwrap_model(model)
    try:
        root.load_state_dict(data["model_state"])
    except RuntimeError as exc:
        raise AmpDoctorError(
            f"the bundle's state dict (from a {data.get('model_class')}) does not fit the factory's "
            f"{type(root).__name__}: {exc}"
        ) from exc
    if device is None:
        wanted = str(data.get("device_type", "cpu"))
        device = wanted if wanted == "cpu" or (wanted == "cuda" and torch.cuda.is_available()) else "cpu"
    target = torch.device(device)
    root.to(target)
    root.train(bool(data.get("training", True)))
    args = _to_device(data.get("args") or (), target)
    kwargs = _to_device(data.get("kwargs") or {}, target)
    targets = _to_device(data.get("targets"), target)
    batch = as_batch(root, args, kwargs)
    dtype = _DTYPES.get(str(data.get("dtype")), torch.float16)
    scale = float(data.get("scale") or 1.0)
    rng = data.get("rng") or {}
    notes: list[str] = []
    replay_loss = _bind_loss(loss_fn, targets)
    grads = data.get("output_grads")
    if loss_fn is None and backward is not False and isinstance(grads, dict) and grads:
        replay_loss = output_grad_loss(_to_device(grads, target), scale, data.get("loss_value"))
        backward = True
        notes.append("no loss_fn: the backward replays the gradient the real loss sent into the model's output")
    saved_cpu = torch.get_rng_state()
    try:
        if isinstance(rng.get("torch_cpu"), torch.Tensor):
            torch.set_rng_state(rng["torch_cpu"])
        report = diagnose(
            root, batch, loss_fn=replay_loss, dtype=dtype, device_type=target.type,
            scale=max(scale, MIN_REPLAY_SCALE), backward=backward if backward is not None else loss_fn is not None,
        )
    finally:
        torch.set_rng_state(saved_cpu)
    records = json.loads(data.get("records") or "{}")
    steps = [from_plain(StepRecord, s) for s in records.get("steps", [])]
    where = f"step {data.get('step')}" + (f", rank {data.get('rank')}" if int(data.get("world_size", 1)) > 1 else "")
    notes.insert(0, f"replayed failure bundle {os.fspath(path)} ({where}, scale {scale:g})")
    if data.get("inputs_changed"):
        notes.append("the inputs were modified in place after the failing forward; the bundle holds their later values")
    if loss_fn is None and not backward:
        notes.append("forward only: pass loss_fn (CLI: --loss pkg.mod:fn) to replay the backward too")
    return dataclasses.replace(_add_notes(report, notes), steps=tuple(steps))


# -- composing the report (from plain payloads: the same code merges ranks) --------------------------------


def _runs_of(payload: Mapping[str, Any]) -> list[_Run]:
    return [_Run(**r) for r in payload.get("runs", [])]


_SEVERITY: dict[RunStatus, int] = {HARMLESS: 0, OPEN: 1, PERSISTENT: 2}


def _annotate(steps: list[StepRecord], runs: list[_Run]) -> list[StepRecord]:
    """Each step of a run of bad steps gets the run's verdict; with several ranks, the gravest one."""
    status: dict[int, RunStatus] = {}
    bad_steps = {s.step for s in steps if s.skipped or not s.forward_finite}
    for run in runs:
        last = run.end if run.end is not None else math.inf
        for step in bad_steps:
            if run.start <= step <= last and (step not in status or _SEVERITY[run.status] >= _SEVERITY[status[step]]):
                status[step] = run.status
    return [dataclasses.replace(s, run=status.get(s.step)) if s.step in status else s for s in steps]


def _first_local(payloads: list[dict[str, Any]]) -> Optional[tuple[int, int]]:
    """(step, rank) where a rank's own forward or pre-reduction gradients first went non-finite."""
    found = [(p["first_local"], p["rank"]) for p in payloads if p.get("first_local") is not None]
    return min(found) if found else None


def _empty_trace(scale: float) -> PassTrace:
    return PassTrace(
        scale=scale, detailed=False, calls=(), grad_events=(), batch=(), output=(), loss=None, backward_ran=False
    )


def compose_report(payloads: list[dict[str, Any]], me: int = 0) -> Report:
    """The watch's Report from one or several ranks' payloads (plain data; see ``Watch._payload``)."""
    payloads = sorted(payloads, key=lambda p: p["rank"])
    merged = len(payloads) > 1
    own = next((p for p in payloads if p["rank"] == me), payloads[0])
    runs = [r for p in payloads for r in _runs_of(p)]
    steps = sorted(
        (from_plain(StepRecord, s) for p in payloads for s in p["steps"]), key=lambda s: (s.step, s.rank)
    )
    steps = _annotate(steps, runs)
    first_local = _first_local(payloads)
    persistent = [r for r in runs if r.status == PERSISTENT]
    dtype = str(own["dtype"])
    warnings: list[str] = []
    notes: list[str] = []

    base: Optional[Report] = None
    failure_rank: Optional[int] = None
    if persistent:
        failures = [p for p in payloads if p.get("failure")]
        if first_local is not None:
            failures.sort(key=lambda p: (p["rank"] != first_local[1], not p["failure_local"], p["failure_step"]))
        else:
            failures.sort(key=lambda p: (not p["failure_local"], p["failure_step"], p["rank"]))
        if failures:
            base = Report.from_dict(failures[0]["failure"])
            failure_rank = failures[0]["rank"]
    elif runs:
        captures = [p for p in payloads if p.get("first_capture")]
        if first_local is not None:
            captures.sort(key=lambda p: p["rank"] != first_local[1])
        if captures:
            base = Report.from_dict(captures[0]["first_capture"])
            failure_rank = captures[0]["rank"]

    findings = _findings(base, steps, runs, persistent, dtype, warnings)
    findings = dataclasses.replace(findings, warnings=(*findings.warnings, *warnings, *_trend_warnings(steps, dtype)))
    notes += _summary(own, steps, runs)
    if merged:
        notes.append(_rank_note(payloads, steps, first_local, me))
    elif failure_rank is not None and own["world_size"] > 1:
        notes.append(f"rank {failure_rank} of {own['world_size']} (ranks not merged)")
    for p in payloads:
        if p.get("bundle"):
            where = f" (rank {p['rank']})" if merged else ""
            notes.append(f"failure bundle{where}: {p['bundle']}")
    ranks_of: dict[str, list[int]] = {}
    for p in payloads:
        for n in p.get("notes", []):
            ranks_of.setdefault(n, []).append(p["rank"])
    for text, ranks in ranks_of.items():
        if merged and len(ranks) < len(payloads):
            text = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {text}"
        notes.append(text)

    if base is not None:
        run_info = dataclasses.replace(base.run, notes=(*base.run.notes, *notes))
        return Report(run_info, base.modules, base.trace, findings, base.recommendations, steps=tuple(steps))
    limits = format_limits(_DTYPES.get(dtype, torch.float16))
    scale = float(own.get("scale") or 1.0)
    run_info = RunInfo(
        torch_version=torch.__version__,
        ampdoctor_version=__version__,
        device=str(own["device_type"]),
        device_type=str(own["device_type"]),
        limits=limits,
        scale=scale,
        scale_source="the watched GradScaler, after the last step",
        loss_source="scaler.scale(loss)",
        model_class=str(own["model_class"]),
        autocast_note="",
        notes=tuple(notes),
    )
    modules = tuple(ModuleInfo(name, cls) for name, cls in own["modules"])
    return Report(run_info, modules, _empty_trace(scale), findings, (), steps=tuple(steps))


def _findings(
    base: Optional[Report],
    steps: list[StepRecord],
    runs: list[_Run],
    persistent: list[_Run],
    dtype: str,
    warnings: list[str],
) -> Findings:
    """Findings of the first persistent failure; ``scale_overflow`` when only harmless (or open) runs happened."""
    if persistent:
        first = min(persistent, key=lambda r: (r.persistent_step or 0))
        if base is not None and (base.forward_origin is not None or base.backward_origin is not None):
            return base.findings
        failing = next((s for s in steps if s.step == first.persistent_step), None)
        nan_loss = failing is not None and failing.loss is not None and math.isnan(failing.loss)
        verdict: Verdict = "nan" if nan_loss else "overflow"
        why = (
            "the capture did not reproduce it"
            if base is not None
            else "it was not captured (the capture budget was spent, or the replay failed: see the notes)"
        )
        warnings.append(f"persistent failure from step {first.persistent_step}: {first.reason}; {why}")
        if base is not None:
            return dataclasses.replace(base.findings, verdict=verdict)
        return Findings(verdict, None, None, (), (), None, None, ())
    if runs:
        open_runs = [r for r in runs if r.status == OPEN]
        for r in open_runs:
            warnings.append(
                f"a run of skipped steps from step {r.start} was still going at report time ({r.skips} skipped): "
                "not yet harmless (no good step at a scale >= 1 since)"
            )
        if base is not None:
            scale = base.findings.scale or _scale_from_runs(runs)
            return dataclasses.replace(base.findings, verdict="scale_overflow", scale=scale)
        return Findings("scale_overflow", None, None, (), (), None, _scale_from_runs(runs), ())
    near: list[NearLimit] = []
    sampled = [s for s in steps if s.sampled]
    if sampled:
        last = max(s.step for s in sampled)
        limits = format_limits(_DTYPES.get(dtype, torch.float16))
        for s in sampled:
            if s.step != last:
                continue
            for module, value in s.out_abs_max.items():
                bits = headroom_bits(value, limits)
                if bits is not None and bits < HEADROOM_WARN_BITS:
                    near.append(NearLimit(module, 0, "out", value, bits))
        near.sort(key=lambda n: n.headroom_bits)
    return Findings("healthy", None, None, (), tuple(near), None, None, ())


def _scale_from_runs(runs: list[_Run]) -> Optional[ScaleFinding]:
    """A loss-scale finding from training alone: skipped at one scale, good again at a lower one."""
    ended = [r for r in runs if r.status == HARMLESS and r.harmless_scale is not None]
    if not ended:
        return None
    r = ended[0]
    good = float(r.harmless_scale or 1.0)
    used = good * 2.0 ** max(1, r.skips)
    return ScaleFinding(used, (ScaleProbe(good, True), ScaleProbe(used, False)), good, None, used)


def _merged_runs(runs: list[_Run]) -> list[_Run]:
    """Ranks skip together (the gradients are reduced): one run per start step, with the gravest verdict."""
    by_start: dict[int, _Run] = {}
    for r in runs:
        seen = by_start.get(r.start)
        if seen is None or _SEVERITY[r.status] > _SEVERITY[seen.status]:
            by_start[r.start] = r
    return [by_start[k] for k in sorted(by_start)]


def _summary(own: Mapping[str, Any], steps: list[StepRecord], runs: list[_Run]) -> list[str]:
    own_steps = [s for s in steps if s.rank == own["rank"]]
    skipped = sum(1 for s in own_steps if s.skipped)
    merged = _merged_runs(runs)
    count = {status: sum(1 for r in merged if r.status == status) for status in (HARMLESS, PERSISTENT, OPEN)}
    every = own.get("stats_every") or 0
    lines = [
        f"watch: {own['total_steps']} step(s), {len(own_steps)} kept"
        + (f", module statistics every {every} step(s)" if every else ", no module statistics")
        + f"; {skipped} skipped in {len(merged)} run(s) of skipped steps: {count[HARMLESS]} harmless, "
        f"{count[PERSISTENT]} persistent" + (f", {count[OPEN]} still open" if count[OPEN] else "")
    ]
    scales = [s.scale for s in own_steps]
    if scales:
        last = own_steps[-1].new_scale or scales[-1]
        lines.append(
            f"loss scale: {scales[0]:g} at step {own_steps[0].step} -> {last:g} after step {own_steps[-1].step} "
            f"(lowest used {min(scales):g})"
        )
    for r in [r for r in merged if r.status == PERSISTENT][:3]:
        lines.append(f"persistent failure from step {r.persistent_step}: {r.reason}")
    for r in [r for r in merged if r.status == HARMLESS][:3]:
        lines.append(
            f"harmless run of skipped steps: steps {r.start}-{r.end}, good again at scale {r.harmless_scale:g}"
        )
    return lines


def _rank_note(
    payloads: list[dict[str, Any]], steps: list[StepRecord], first_local: Optional[tuple[int, int]], me: int
) -> str:
    head = f"distributed run: {len(payloads)} ranks merged on rank {me}"
    if first_local is None:
        return head + (
            "; no rank's own forward or pre-reduction gradients were seen non-finite (the skips come from the "
            "reduced gradients, or were not captured)"
        )
    step, rank = first_local
    record = next((s for s in steps if s.step == step and s.rank == rank), None)
    how = "its own gradients (before the all-reduce) were non-finite"
    if record is not None and not record.forward_finite:
        how = "its own forward was non-finite"
    if record is not None and (record.forward_origin or record.backward_origin):
        origin = record.forward_origin or record.backward_origin
        how += f" (origin {origin})"
    return f"{head}; rank {rank} first went non-finite, at step {step}: {how}"


# -- the front end -----------------------------------------------------------------------------------------


def watch(
    model: nn.Module,
    scaler: Any = None,
    *,
    loss_fn: Optional[LossFn] = None,
    dtype: Optional[torch.dtype] = None,
    stats_every: int = DEFAULT_STATS_EVERY,
    history: int = DEFAULT_HISTORY,
    max_captures: int = DEFAULT_MAX_CAPTURES,
    bundle_dir: Optional[PathLike] = None,
    save_bundle: bool = True,
) -> Watch:
    """Watch an unchanged autocast + GradScaler training loop; returns a started :class:`Watch`.

    >>> with ampdoctor.watch(model, scaler) as doctor:
    ...     train()                      # your loop: scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
    >>> print(doctor.report())

    Args:
        model: the model as trained (a DDP or ``torch.compile`` wrapper is peeled for the names).
        scaler: the loop's ``GradScaler``: each ``scaler.update()`` closes a step. Without one (bfloat16), call
            ``doctor.step()`` after the backward and before ``optimizer.step()`` (a capture after the optimizer
            applied non-finite gradients would replay the updated weights; the report says so when it happens).
        loss_fn: ``loss_fn(output, batch)`` (or ``(output, targets)`` after ``doctor.set_targets``) for the
            backward of a capture; without it, a scalar output, ``output.loss`` or a surrogate (as ``diagnose``).
        dtype: the autocast dtype; default: what autocast uses at the first forward.
        stats_every: per-module statistics (hooks on every module) every this many steps; 0 for never. Skipped
            steps are captured whatever this is.
        history: steps kept in the ring buffer.
        max_captures: full captures (a ``diagnose`` of the failing inputs) for runs of skipped steps, and as
            many again for persistent failures.
        bundle_dir: where the failure bundle goes (default: the current directory).
        save_bundle: write a failure bundle on the first persistent failure.

    Each step reads its statistics back from the device once, in ``scaler.update``. Use it as a context
    manager (or call ``close()``): the hooks and the wrapped scaler methods go away on exit, also after an
    exception. ``report()`` works inside and after the block.
    """
    return Watch(
        model, scaler, loss_fn=loss_fn, dtype=dtype, stats_every=stats_every, history=history,
        max_captures=max_captures, bundle_dir=bundle_dir, save_bundle=save_bundle,
    ).start()
