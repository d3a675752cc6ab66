"""Replaying a failing training step with ``ampdoctor.diagnose``: the capture of a skipped step.

The watch keeps each root forward's inputs and the RNG state before it (:class:`~.readback.MicroBatch`), and
the gradient the step's own loss sent into the model's outputs (up to a size cap). When a step fails,
:func:`capture` runs ``diagnose`` on those inputs with that RNG state, so dropout draws the masks the failing
forward drew. Its backward needs no extra call in the loop: it replays the recorded output gradient
(:class:`_GradReplay`), or the output's own loss (``output.loss``). With a ``loss_fn`` the replay re-runs the loss
too (so a loss that overflows is found), checked against the step's recorded loss value: a ``loss_fn`` that
raises on the replayed batch, or gives another value (no ``doctor.set_targets``: it got the batch as targets),
falls back to the recorded gradient (:class:`CheckedLoss`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, TypeVar

import torch
from torch import nn

from ..analysis import Origin, classify
from ..api import diagnose
from ..capture.state import RngState
from ..capture.stats import tensor_stats
from ..capture.walk import iter_tensors
from ..errors import AmpDoctorError, ModelRaised
from ..numbers import fmt_scale
from ..records import LOSS, StepRecord
from ..report import Report
from .readback import MicroBatch, weight_versions

LossFn = Callable[[Any, Any], torch.Tensor]
T = TypeVar("T")

# Candidates tried per capture when no micro-batch had a non-finite forward (the overflow was in the backward).
MAX_REPLAYS_PER_CAPTURE = 4
# A replay never runs below this scale (GradScaler's scale can underflow towards 0 in a persistent failure).
MIN_REPLAY_SCALE = 2.0**-24
# A replayed loss matches the step's recorded loss within this relative tolerance (the replay is the same
# computation on the same inputs, weights and random draws; only a nondeterministic kernel moves it).
LOSS_MATCH_RTOL = 1e-3


@dataclass(frozen=True)
class Capture:
    """A ``diagnose`` of a failing step's inputs."""

    step: int
    report: Report
    micro: int  # which micro-batch of the step it replayed
    local_nonfinite: bool  # the replay found an origin: this rank's own forward or backward made inf/NaN


ScalerKind = Literal["enabled", "disabled", "none"]  # the watched loop's GradScaler: on, enabled=False, none
# Where a report's scale came from, per kind of scaler (a capture adds its step; the watch's report, "after the
# last step" for an enabled one).
SCALER_TEXT: dict[ScalerKind, str] = {
    "enabled": "the watched GradScaler",
    "disabled": "the watched GradScaler, disabled (enabled=False)",
    "none": "no GradScaler",
}


@dataclass(frozen=True)
class StepReplayer:
    """What a capture needs to know of the watched model."""

    root: nn.Module
    low: torch.dtype
    device_type: str
    loss_fn: Optional[LossFn]
    notes: tuple[str, ...] = ()  # said in every capture's report (a compiled model replayed eagerly, FSDP, ...)
    scaler: ScalerKind = "enabled"  # the watched loop's GradScaler (else the scale is 1: bfloat16, disabled)


def with_rng(rng: RngState, run: Callable[[], T]) -> T:
    """``run()`` with every random stream set to ``rng``; the caller's streams are put back afterwards."""
    saved = RngState.capture()
    try:
        rng.restore()
        return run()
    finally:
        saved.restore()


def capture(
    replayer: StepReplayer, micro: list[MicroBatch], bad_micro: list[bool], step: int, scale: float,
    note: Callable[[str], None],
) -> Optional[Capture]:
    """Diagnose the failing step's kept forwards, those with a non-finite forward first, until one shows an
    origin; failures to replay become notes (a capture never raises into the training loop)."""
    order = sorted(range(len(micro)), key=lambda i: (not bad_micro[i], i))
    first: Optional[Capture] = None
    for index in order[:MAX_REPLAYS_PER_CAPTURE]:
        try:
            report = replay_micro(replayer, micro[index], scale, step)
        except Exception as exc:  # the user's loss_fn or model raised: say so, try the next candidate
            note(f"step {step}: the capture could not replay the batch ({type(exc).__name__}: {exc})")
            continue
        found = report.forward_origin is not None or report.backward_origin is not None
        result = Capture(step, report, index, found)
        first = first or result
        if found:
            return result
    return first


def replay_micro(replayer: StepReplayer, m: MicroBatch, scale: float, step: int) -> Report:
    """``diagnose`` on a kept forward's inputs, with every random stream as it was before that forward.

    A ``loss_fn`` that raises on the replayed batch when the recorded gradient cannot stand in for it (the
    gradient was already non-finite) costs the loss replay, not the capture: it runs again without it."""
    try:
        return _replay(replayer, m, scale, step, replayer.loss_fn)
    except ModelRaised as exc:
        if replayer.loss_fn is None or exc.stage != "loss" or m.output_grads() is None:
            raise
        report = _replay(replayer, m, scale, step, None)
        cause = exc.__cause__ or exc
        return add_notes(report, [
            f"loss_fn raised on the replayed batch ({type(cause).__name__}: {cause}; without doctor.set_targets it "
            "gets the batch as its second argument): the capture replayed the step from its own record instead"
        ])


def _replay(replayer: StepReplayer, m: MicroBatch, scale: float, step: int, loss_fn: Optional[LossFn]) -> Report:
    batch = as_batch(replayer.root, m.args, m.kwargs)
    loss, backward, notes, bad_grad = capture_loss(loss_fn, m, scale, given=replayer.loss_fn is not None)
    notes += replayer.notes
    if m.weight_versions is not None and weight_versions(replayer.root) != m.weight_versions:
        notes.append(
            "the weights changed between the failing forward and this capture (the optimizer stepped on the "
            "non-finite gradients first): the replay ran on the updated weights; close bfloat16 steps with "
            "doctor.step() before optimizer.step()"
        )
    if m.inputs_changed():
        notes.append("the batch tensors were modified in place after the forward; the capture replayed their "
                     "current contents")
    report = with_rng(m.rng, lambda: diagnose(
        replayer.root, batch, loss_fn=loss, dtype=replayer.low, device_type=replayer.device_type,
        scale=max(scale, MIN_REPLAY_SCALE), backward=backward, progress=None,  # a line on a terminal only
    ))
    if bad_grad is not None:
        report = loss_gradient_origin(
            report, bad_grad[0], bad_grad[1], scale, replayer.low, loss_fn_given=replayer.loss_fn is not None
        )
    at = " at" if replayer.scaler == "enabled" else ","
    scale_source = f"{SCALER_TEXT[replayer.scaler]}{at} step {step}"
    run = dataclasses.replace(report.run, scale_source=scale_source)
    if loss is not None and loss_fn is None:  # the recorded gradient of the outputs stood in for the loss
        run = dataclasses.replace(run, loss_source="the step's recorded output gradient")
    if not backward and report.run.backward_note:  # the capture chose the forward only, not the user
        run = dataclasses.replace(run, backward_note="")
    return add_notes(dataclasses.replace(report, run=run), notes)


def capture_loss(
    loss_fn: Optional[LossFn], m: MicroBatch, scale: float, given: bool = False
) -> tuple[Optional[LossFn], bool, list[str], Optional[tuple[str, torch.Tensor]]]:
    """The loss a capture back-propagates: the user's (checked, with the recorded gradient as its fallback), the
    output's own, or the real one replayed through the kept gradient w.r.t. the outputs.

    Returns (loss_fn, backward, notes, non-finite output gradient); the notes list also receives what a
    :class:`CheckedLoss` decides while ``diagnose`` runs. ``given``: the watch has a ``loss_fn`` (this replay runs
    without it because it raised): the notes never ask for one."""
    notes: list[str] = []
    grads = m.output_grads()
    bad = next(((path, g) for path, g in (grads or {}).items() if not bool(torch.isfinite(g).all())), None)
    recorded = output_grad_loss(grads, scale, m.loss_value) if grads is not None and bad is None else None
    if loss_fn is not None:
        return CheckedLoss(with_targets(loss_fn, m.targets), m.loss_value, recorded, notes), True, notes, None
    if m.own_loss or not m.expected_grads:
        return None, True, notes, None
    if grads is None:
        return None, True, [not_kept_note(m, given)], None
    if bad is not None:
        return None, False, notes, bad
    notes.append("the capture replayed the step's backward from the gradient its loss sent into the model's "
                 "output" + ("" if given else " (pass loss_fn= to watch to replay the loss itself too)"))
    return recorded, True, notes, None


def not_kept_note(m: MicroBatch, given: bool = False) -> str:
    """Why the capture's backward used a surrogate loss: what was not kept of the output gradient."""
    if m.not_kept:
        sizes = ", ".join(f"{path} ({n / 2**20:.1f} MiB)" for path, n in m.not_kept.items())
        why = f"over the size cap of the step ({sizes}; watch(..., max_output_grad_bytes=) raises it)"
    else:
        why = "it never arrived before scaler.update (the output did not reach the loss's backward)"
    return (f"the gradient w.r.t. the model's output was not kept: {why}; the capture's backward used a "
            "surrogate loss" + ("" if given else "; pass loss_fn= to watch to replay the real loss"))


def _matches(value: float, recorded: Optional[float]) -> bool:
    if recorded is None:
        return True
    if not (math.isfinite(value) and math.isfinite(recorded)):
        return math.isfinite(value) == math.isfinite(recorded)
    return abs(value - recorded) <= LOSS_MATCH_RTOL * max(abs(value), abs(recorded), 1e-30)


class CheckedLoss:
    """The user's ``loss_fn`` in a capture, decided once at its first call (the survey, which replays the failing
    forward exactly): kept when it runs and gives the step's recorded loss; else the recorded gradient stands in
    for it (when there is one) and a note says why."""

    def __init__(
        self, loss_fn: LossFn, recorded: Optional[float], fallback: Optional[LossFn], notes: list[str]
    ) -> None:
        self.loss_fn = loss_fn
        self.recorded = recorded
        self.fallback = fallback
        self.notes = notes
        self.use_fallback: Optional[bool] = None

    def __call__(self, output: Any, batch: Any) -> torch.Tensor:
        if self.use_fallback is None:
            return self._decide(output, batch)
        if self.use_fallback and self.fallback is not None:
            return self.fallback(output, batch)
        return self.loss_fn(output, batch)

    def _decide(self, output: Any, batch: Any) -> torch.Tensor:
        try:
            loss = self.loss_fn(output, batch)
        except Exception as exc:
            if self.fallback is None:
                raise
            self.notes.append(
                f"loss_fn raised on the replayed batch ({type(exc).__name__}: {exc}; without doctor.set_targets it "
                "gets the batch as its second argument): the capture replayed the gradient the step's loss sent "
                "into the model's output instead"
            )
            return self._fall_back(output, batch)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and self.fallback is not None:
            value = float(loss.detach().reshape(-1)[0])
            if not _matches(value, self.recorded):
                self.notes.append(
                    f"loss_fn on the replayed batch gave {value:.6g} where the step's loss (seen by scaler.scale) was "
                    f"{self.recorded:.6g} (without doctor.set_targets it gets the batch as its second argument): the "
                    "capture replayed the gradient the step's loss sent into the model's output instead"
                )
                return self._fall_back(output, batch)
        self.use_fallback = False
        return loss

    def _fall_back(self, output: Any, batch: Any) -> torch.Tensor:
        self.use_fallback = True
        assert self.fallback is not None
        return self.fallback(output, batch)


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


def bind_loss(loss_fn: Optional[LossFn], targets: Any) -> Optional[LossFn]:
    """``loss_fn(output, targets)`` when targets were handed over, else ``loss_fn(output, batch)``."""
    return None if loss_fn is None else with_targets(loss_fn, targets)


def with_targets(loss_fn: LossFn, targets: Any) -> LossFn:
    """``loss_fn(output, targets)`` when targets were handed over, else ``loss_fn`` itself."""
    if targets is None:
        return loss_fn

    def bound(output: Any, batch: Any) -> torch.Tensor:
        return loss_fn(output, targets)

    return bound


def own_loss(output: Any) -> Optional[torch.Tensor]:
    """The loss the output carries (a scalar output, ``output.loss``, ``output['loss']``): ``diagnose``
    back-propagates the real one without a loss_fn."""
    if isinstance(output, torch.Tensor):
        return output if output.numel() == 1 else None
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    loss = output.get("loss") if isinstance(output, Mapping) else None
    return loss if isinstance(loss, torch.Tensor) else None


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


def loss_gradient_origin(
    report: Report, path: str, grad: torch.Tensor, scale: float, low: torch.dtype, loss_fn_given: bool = False
) -> Report:
    """The gradient reaching the model's output was already non-finite: the backward origin is the loss/scale.
    ``loss_fn_given``: the watch has a loss_fn (it could not run on the replayed batch): never ask for one."""
    stats = tensor_stats(grad, low).scaled_down(scale)
    origin = Origin("backward", LOSS, 0, "loss", f"grad:{path}", stats, None)
    verdict = report.verdict if report.verdict != "healthy" else classify(stats, None)
    findings = dataclasses.replace(report.findings, backward_origin=origin, verdict=verdict)
    how = (
        "the watch's loss_fn could not replay the loss (see the note on it)" if loss_fn_given
        else "pass loss_fn= to watch to replay the loss itself"
    )
    note = (
        f"the gradient of the loss reaching the model's output ({path}) was already non-finite at scale "
        f"{fmt_scale(scale)}: it overflowed before any layer ran backward; the capture replayed the forward only "
        f"({how})"
    )
    return add_notes(dataclasses.replace(report, findings=findings), [note])


def with_capture(record: StepRecord, report: Report, local: Optional[bool]) -> StepRecord:
    """A step record with what a capture found: origins and the parameters with non-finite gradients."""
    fwd, bwd = report.forward_origin, report.backward_origin
    params = sorted(name for name, stats in report.trace.param_grads().items() if not stats.is_finite)
    # the capture's own backward names them before any clipping spread the NaN; one that did not reproduce it
    # leaves the names of the step's gradient check (bfloat16, no GradScaler)
    return dataclasses.replace(
        record,
        forward_origin=fwd.label if fwd else None,
        backward_origin=bwd.label if bwd else None,
        nonfinite_params=tuple(params) or record.checked_params,
        captured=True,
        capture_verdict=report.verdict,
        local_nonfinite=record.local_nonfinite or bool(local),
    )


def add_notes(report: Report, notes: list[str]) -> Report:
    """The report with ``notes`` added to its run notes (each once)."""
    if not notes:
        return report
    run = dataclasses.replace(report.run, notes=(*report.run.notes, *[n for n in notes if n not in report.run.notes]))
    return dataclasses.replace(report, run=run)
