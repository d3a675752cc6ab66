"""``diagnose``: orchestrates capture passes, analysis and recommendations on the user's model."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

import torch
from torch import nn

from ._version import __version__
from .analysis import ScaleFinding, ScaleWindow, UnderflowFinding, analyze, forward_origin, near_limit
from .analysis.scale import Runner, measure_window, probe_scales, underflow_reference
from .capture.dtypes import model_device_type
from .capture.model import unwrap_model
from .capture.passes import LossFn, PassSpec, capture_params, run_pass
from .capture.policy import autocast_note
from .capture.state import StateGuard
from .capture.stats import format_limits
from .errors import InvalidInput
from .fixes.recommend import recommend
from .fixes.verify import VerifyContext, verify_recommendations
from .records import BATCH, LOSS, PassTrace, RunInfo
from .report import Report
from .thresholds import DEFAULT_FP16_SCALE


def _resolve_scale(scaler: Any, scale: Optional[float], dtype: torch.dtype) -> tuple[float, str]:
    """The loss scale of the backward. The user's scaler is only read (``get_scale`` changes nothing)."""
    if scale is not None:
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise InvalidInput(f"scale must be a positive finite number, got {scale!r}")
        return float(scale), "scale= argument"
    if scaler is not None:
        if not callable(getattr(scaler, "get_scale", None)):
            raise InvalidInput(f"scaler must be a GradScaler (with get_scale()), got {type(scaler).__name__}")
        enabled = getattr(scaler, "is_enabled", lambda: True)()
        if not enabled:
            return 1.0, "the given scaler is disabled: unscaled backward"
        return float(scaler.get_scale()), "scaler.get_scale()"
    if dtype == torch.float16:
        return DEFAULT_FP16_SCALE, "GradScaler default; no scaler given"
    return 1.0, "unscaled; bfloat16 needs no scaler"


def _describe_device(root: nn.Module, device_type: str) -> str:
    param = next(root.parameters(), None)
    if device_type == "cuda" and param is not None and param.is_cuda:
        return f"cuda:{param.device.index} ({torch.cuda.get_device_name(param.device)})"
    return device_type


def diagnose(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: Optional[LossFn] = None,
    dtype: torch.dtype = torch.float16,
    device_type: Optional[str] = None,
    scaler: Any = None,
    backward: bool = True,
    scale: Optional[float] = None,
    fp32_reference: bool = True,
    verify: bool = True,
    scale_window: bool = True,
    reference: Union[bool, int] = False,
) -> Report:
    """Run instrumented AMP steps on ``model`` and ``batch`` and say where and why they break.

    Args:
        model: the model as trained (DDP and ``torch.compile`` wrappers are peeled; the original runs eagerly).
        batch: a Tensor (``model(batch)``), a tuple/list (``model(*batch)``) or a dict (``model(**batch)``).
        loss_fn: ``loss_fn(output, batch) -> scalar``. Without it: a scalar output, ``output.loss``, or a
            surrogate (the mean of the floating outputs), which the report names.
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        device_type: autocast device type; default: the parameters' device.
        scaler: a ``GradScaler`` (``torch.amp`` or the deprecated ``torch.cuda.amp``); only ``get_scale()`` is
            read. Without it, float16 uses GradScaler's default 2**16 and bfloat16 is unscaled.
        backward: also run and analyse the scaled backward.
        scale: an explicit loss scale (overrides ``scaler``).
        fp32_reference: to count gradient values lost to underflow, ampdoctor re-runs the backward at a much
            larger scale when the gradients leave room for one; when they do not (the usual case at GradScaler's
            2**16), it re-runs the step once with autocast off. Set False when float32 does not fit in memory.
        scale_window: measure the window of useful loss scales (largest without overflow, smallest losing
            < 1 % of gradient values) by re-running the step at candidate scales; needs ``fp32_reference``.
        reference: compare each leaf call (``True``) or each call ``n`` levels down (an int) against a float32
            re-run of that call alone on its own inputs: relative error, SQNR, forward underflow. Never runs the
            whole model in float32.
        verify: prove each recommendation by re-running the step with it applied (float32 fallback of the
            origin, growing the set when a new origin appears; bfloat16; the safe loss scale).

    Nothing the user owns changes: parameters, buffers, ``.grad`` fields, ``training`` flags, RNG states and
    the scaler are as before, and no hook stays behind. Each pass reads statistics back from the device once.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        raise InvalidInput(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    if not isinstance(batch, (torch.Tensor, tuple, list, Mapping)):
        raise InvalidInput(
            f"batch must be a Tensor, a tuple/list of positional inputs or a dict of keyword inputs, "
            f"got {type(batch).__name__}"
        )
    root, notes = unwrap_model(model)
    device_type = device_type or model_device_type(root, batch)
    used_scale, scale_source = _resolve_scale(scaler, scale, dtype)
    limits = format_limits(dtype)
    named = list(root.named_modules())
    spec = PassSpec(
        root=root,
        names={id(m): name for name, m in named},
        params=list(root.named_parameters()),
        batch=batch,
        loss_fn=loss_fn,
        device_type=device_type,
        dtype=dtype,
        backward=backward,
    )
    guard = StateGuard(root)
    try:
        modules = capture_params(spec, named)

        def run(
            at_scale: float,
            detailed: bool = False,
            zoom: Optional[tuple[str, int]] = None,
            autocast: bool = True,
            backward_zoom: bool = False,
            compare: Union[bool, int] = False,
        ) -> PassTrace:
            guard.rewind()  # the same RNG draws and buffers for every pass: re-runs are identical
            trace, source = run_pass(spec, at_scale, detailed, zoom, autocast, backward_zoom, compare)
            loss_sources.append(source)
            return trace

        loss_sources: list[str] = []
        survey = run(used_scale, compare=reference)
        origin = forward_origin(survey)
        runner = Runner(lambda at_scale, autocast: run(at_scale, autocast=autocast), fp32_reference)
        scale_finding: Optional[ScaleFinding] = None
        underflow: Optional[UnderflowFinding] = None
        window: Optional[ScaleWindow] = None
        if origin is None and survey.backward_ran:
            if not survey.gradients_finite():
                scale_finding = probe_scales(runner, survey, modules)
            else:
                underflow = underflow_reference(runner, survey, modules, limits)
            if scale_window and (scale_finding is None or scale_finding.largest_finite_scale is not None):
                window = measure_window(runner, survey, modules, limits)
        needs_detail = (
            origin is not None
            or scale_finding is not None
            or (underflow is not None and underflow.lost > 0)
            or bool(near_limit(survey, modules, limits))
        )
        final = survey
        if needs_detail:
            zoom = None
            if origin is not None and origin.module != BATCH:
                zoom = (LOSS, 0) if origin.module == LOSS else (origin.module, origin.call)
            at_scale = used_scale
            if scale_finding is not None and scale_finding.analysed_scale is not None:
                at_scale = scale_finding.analysed_scale
            final = run(at_scale, detailed=True, zoom=zoom, backward_zoom=scale_finding is not None)
        if loss_sources[0] == "surrogate":
            notes.append(
                "no loss_fn given and the output has no loss: the backward used a surrogate loss (mean of the "
                "floating outputs); pass loss_fn= for the real gradients"
            )
        notes += [n for n in final.notes if n not in notes]
        run_info = RunInfo(
            torch_version=torch.__version__,
            ampdoctor_version=__version__,
            device=_describe_device(root, device_type),
            device_type=device_type,
            limits=limits,
            scale=used_scale,
            scale_source=scale_source,
            loss_source=loss_sources[0],
            model_class=type(root).__name__,
            autocast_note=autocast_note(device_type),
            notes=tuple(notes),
            huggingface=hasattr(type(root), "_keep_in_fp32_modules") and hasattr(root, "config"),
        )
        findings = analyze(final, modules, limits, underflow, scale_finding, window, survey.comparisons)
        recommendations = recommend(findings, run_info, modules)
        if verify and recommendations:
            check_scale = used_scale
            if findings.forward_origin is None and scale_finding is not None and scale_finding.analysed_scale:
                check_scale = scale_finding.analysed_scale
            context = VerifyContext(
                root=root,
                modules=modules,
                baseline=survey,
                low_dtype=limits.dtype,
                run=lambda at_scale: run(at_scale),
                run_other_dtype=_bf16_runner(spec, guard, device_type) if dtype == torch.float16 else None,
            )
            recommendations = verify_recommendations(context, findings, recommendations, check_scale)
    finally:
        guard.rewind()
    return Report(run_info, tuple(modules), final, findings, tuple(recommendations))


def _bf16_runner(spec: PassSpec, guard: StateGuard, device_type: str) -> Optional[Callable[[float], PassTrace]]:
    """A survey pass in bfloat16 autocast, where the device supports it."""
    if device_type == "cuda" and not torch.cuda.is_bf16_supported():
        return None
    bf16_spec = dataclasses.replace(spec, dtype=torch.bfloat16)

    def run_bf16(at_scale: float) -> PassTrace:
        guard.rewind()
        return run_pass(bf16_spec, at_scale, detailed=False)[0]

    return run_bf16
