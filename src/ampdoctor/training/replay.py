"""Replaying a failure bundle: the failing batch diagnosed again, later, on a fresh model."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from ..api import diagnose
from ..capture.dtypes import low_dtype
from ..capture.model import unwrap_model
from ..capture.state import RngState
from ..errors import AmpDoctorError
from ..numbers import fmt_scale
from ..records import StepRecord
from ..report import Report
from ..serial import from_plain
from .bundle import PathLike, load_bundle
from .replay_step import MIN_REPLAY_SCALE, LossFn, add_notes, as_batch, bind_loss, output_grad_loss


def replay_bundle(
    path: PathLike,
    model_factory: Callable[[], nn.Module],
    loss_fn: Optional[LossFn] = None,
    *,
    device: Optional[Union[str, torch.device]] = None,
    backward: Optional[bool] = None,
) -> Report:
    """Diagnose the failing batch saved in a failure bundle, on a fresh model from ``model_factory()``.

    The model gets the bundle's state dict and training flag, every random stream (torch CPU and CUDA, Python,
    numpy) is set as it was before the failing forward, so dropout draws the same masks, and
    ``ampdoctor.diagnose`` runs at the scale the step used; the caller's random streams are put back afterwards.
    With ``loss_fn`` the backward is replayed too: ``loss_fn(output, targets)`` when the watch was given targets
    (``doctor.set_targets``), else ``loss_fn(output, batch)``. Without it, the backward is replayed only when the
    bundle holds the gradient the real loss sent into the model's outputs (watched without ``loss_fn``;
    ``backward=False`` skips it), or when ``backward=True`` (the loss then found as ``diagnose`` finds it).
    ``steps`` are the records in the bundle.
    """
    caller = RngState.capture()  # the factory draws (its init) and so does the replay: all put back after
    try:
        return _replay(load_bundle(path), path, model_factory, loss_fn, device, backward)
    finally:
        caller.restore()


def _replay(
    data: dict[str, Any],
    path: PathLike,
    model_factory: Callable[[], nn.Module],
    loss_fn: Optional[LossFn],
    device: Optional[Union[str, torch.device]],
    backward: Optional[bool],
) -> Report:
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
    batch = as_batch(root, _to_device(data.get("args") or (), target), _to_device(data.get("kwargs") or {}, target))
    scale = float(data.get("scale") or 1.0)
    notes: list[str] = []
    replay_loss = bind_loss(loss_fn, _to_device(data.get("targets"), target))
    asked = backward
    grads = data.get("output_grads")
    if loss_fn is None and backward is not False and isinstance(grads, dict) and grads:
        replay_loss = output_grad_loss(_to_device(grads, target), scale, data.get("loss_value"))
        backward = True
        notes.append("no loss_fn: the backward replays the gradient the real loss sent into the model's output")
    rng = RngState.from_plain(data.get("rng"))
    if rng is None:
        notes.append("the bundle holds no random state: dropout and other random ops drew new values")
    else:
        rng.restore()  # the failing forward's streams: dropout draws its masks (diagnose rewinds to them per pass)
    report = diagnose(
        root, batch, loss_fn=replay_loss, dtype=low_dtype(str(data.get("dtype"))), device_type=target.type,
        scale=max(scale, MIN_REPLAY_SCALE), backward=backward if backward is not None else loss_fn is not None,
    )
    run = dataclasses.replace(report.run, scale_source=_scale_source(data, scale))
    if loss_fn is None and not backward and asked is None:  # nobody set backward=False: say why there was none
        run = dataclasses.replace(run, backward_note=(
            "forward only: the bundle holds no gradient the step's loss sent into the model's outputs (not kept, "
            "or not finite) and no loss_fn was given; pass loss_fn (CLI: --loss pkg.mod:fn) to replay the backward"
        ))
    report = dataclasses.replace(report, run=run)
    steps = _step_records(data.get("records"), path)
    where = f"step {data.get('step')}" + (f", rank {data.get('rank')}" if int(data.get("world_size", 1)) > 1 else "")
    notes.insert(0, f"replayed failure bundle {os.fspath(path)} ({where}, scale {fmt_scale(scale)})")
    if data.get("inputs_changed"):
        notes.append("the inputs were modified in place after the failing forward; the bundle holds their later values")
    if loss_fn is None and not backward and asked is not None:
        notes.append("forward only: pass loss_fn (CLI: --loss pkg.mod:fn) to replay the backward too")
    return dataclasses.replace(add_notes(report, notes), steps=tuple(steps))


def _step_records(text: Optional[str], path: PathLike) -> list[StepRecord]:
    """The step records a bundle carries (its ``records`` JSON); a malformed one is bad input, said in one line."""
    try:
        records = json.loads(text or "{}")
        return [from_plain(StepRecord, s) for s in records.get("steps", [])]
    except (AttributeError, KeyError, TypeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise AmpDoctorError(f"{path} is a malformed ampdoctor failure bundle: its step records: {exc}") from exc


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


def _scale_source(data: dict[str, Any], scale: float) -> str:
    """Where the replay's loss scale came from, truthfully (replay passes it to diagnose as ``scale=``)."""
    if not data.get("scale"):
        return "none in the bundle: 1"
    source = "the failing step's GradScaler scale, from the bundle"
    return source + (f", raised to {fmt_scale(MIN_REPLAY_SCALE)}" if scale < MIN_REPLAY_SCALE else "")
