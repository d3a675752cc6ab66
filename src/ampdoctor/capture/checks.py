"""What ``diagnose`` checks before and after its first pass: inputs it cannot instrument, and whether autocast
and the user's scaler really do on this machine what the report would claim."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..errors import InvalidInput
from ..numbers import fmt_scale
from ..records import PassTrace
from ..thresholds import DEFAULT_FP16_SCALE
from .walk import iter_tensors


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def check_model(
    root: nn.Module,
    named: Optional[list[tuple[str, nn.Module]]] = None,
    params: Optional[list[tuple[str, nn.Parameter]]] = None,
) -> None:
    """TorchScript and uninitialised lazy modules cannot be instrumented: say so before touching anything.
    ``named`` and ``params``: ``root``'s ``named_modules()`` and ``named_parameters()`` when the caller has them."""
    named = list(root.named_modules()) if named is None else named
    params = list(root.named_parameters()) if params is None else params
    scripted = [name or "<root>" for name, m in named if isinstance(m, torch.jit.ScriptModule)]
    if scripted:
        raise InvalidInput(
            f"{', '.join(scripted[:3])} {'is a' if len(scripted) == 1 else 'are'} TorchScript module(s): their "
            "forward cannot be hooked; diagnose the eager model (before torch.jit.script / torch.jit.trace)"
        )
    lazy = [name for name, p in params if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise InvalidInput(
            f"{', '.join(lazy[:3])}{' ...' if len(lazy) > 3 else ''} {'is an' if len(lazy) == 1 else 'are'} "
            "uninitialized lazy parameter(s) (nn.LazyLinear, ...): run one forward on a real batch first so their "
            "shapes are known, then diagnose"
        )


def check_batch(batch: Any) -> None:
    if not isinstance(batch, (torch.Tensor, tuple, list, Mapping)):
        raise InvalidInput(
            f"batch must be a Tensor, a tuple/list of positional inputs or a dict of keyword inputs, "
            f"got {type(batch).__name__}"
        )
    tensors = [t for _, t in iter_tensors(batch, "batch")]
    empty_container = not isinstance(batch, torch.Tensor) and len(batch) == 0
    if empty_container or (tensors and all(t.numel() == 0 for t in tensors)):
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors[:3]) or "nothing"
        raise InvalidInput(
            f"the batch is empty (it holds {shapes}): a diagnosis needs at least one sample; pass the batch that "
            "the training step got"
        )


def usable_batch(batch: Any) -> Any:
    """The batch with inference tensors (made under ``torch.inference_mode()``) cloned into normal tensors,
    which autograd can save; everything else as it is. Call with inference mode off."""
    if not any(t.is_inference() for _, t in iter_tensors(batch, "batch")):
        return batch
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and t.is_inference() else t, batch)


def check_device(device_type: str) -> None:
    if device_type == "meta":
        raise InvalidInput(
            "device_type='meta': tensors on the meta device hold no values, so there is nothing to measure; "
            "materialise the model (model.to_empty(device='cpu') and load its weights) first"
        )
    if device_type not in ("cpu", "cuda"):
        try:
            torch.autocast(device_type)
        except (RuntimeError, ValueError) as exc:
            raise InvalidInput(
                f"device_type={device_type!r}: torch has no autocast for it here ({first_line(exc)}); use 'cpu' "
                "or 'cuda'"
            ) from exc
    if device_type == "cuda" and not torch.cuda.is_available():
        raise InvalidInput(
            "device_type='cuda' with policy='native' but this machine has no CUDA device: torch turns "
            "autocast('cuda') off here (with one warning), so everything would run in float32; leave policy unset "
            "(or policy='cuda') to emulate CUDA's autocast policy on this CPU, or diagnose with device_type='cpu'"
        )


def resolve_scale(scaler: Any, scale: Optional[float], dtype: torch.dtype) -> tuple[float, str, list[str]]:
    """The loss scale of the backward, where it came from, and facts about the user's scaler on this machine.

    The user's scaler is only read (``get_scale`` changes nothing).
    """
    environment: list[str] = []
    if scale is not None:
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise InvalidInput(f"scale must be a positive finite number, got {scale!r}")
        return float(scale), "scale= argument", environment
    if scaler is not None:
        if not callable(getattr(scaler, "get_scale", None)):
            raise InvalidInput(f"scaler must be a GradScaler (with get_scale()), got {type(scaler).__name__}")
        enabled = getattr(scaler, "is_enabled", lambda: True)()
        if not enabled:
            device = str(getattr(scaler, "_device", ""))
            if device == "cuda" and not torch.cuda.is_available():
                # torch.cuda.amp.GradScaler() (the old spelling) on a machine without CUDA disables itself.
                environment.append(
                    "your GradScaler is for CUDA and disabled itself on this machine (no CUDA device), and "
                    "torch.cuda.amp.autocast / autocast('cuda') are off here too: your own loop runs in float32 "
                    "without loss scaling on this machine. This report shows what float16 autocast does, at "
                    f"GradScaler's default scale {fmt_scale(DEFAULT_FP16_SCALE)}, as a scaler on a CUDA machine would "
                    "start"
                )
                if dtype == torch.float16:
                    return DEFAULT_FP16_SCALE, "GradScaler default (the given scaler is disabled here)", environment
                return 1.0, "unscaled (the given scaler is disabled here)", environment
            environment.append("your GradScaler is disabled (enabled=False): your loop's backward is not scaled")
            return 1.0, "the given scaler is disabled: unscaled backward", environment
        given = float(scaler.get_scale())
        if math.isfinite(given) and given > 0:
            return given, "scaler.get_scale()", environment
        # A scale that collapsed (halved at every step whose gradients held inf/NaN, down to 0) or went inf/NaN
        # is no scale to run a backward at: the diagnosis runs where a fresh scaler would start, and says so.
        default = DEFAULT_FP16_SCALE if dtype == torch.float16 else 1.0
        if given == 0:
            why = ("it collapsed: halved at each step whose gradients held inf/NaN, it reached 0 and stays there, so "
                   "every scaled gradient is 0 and nothing is learned")
        elif given < 0:
            why = "not a loss scale"
        else:
            why = "no scale a backward can run at: every scaled gradient is inf/NaN and every step is skipped"
        environment.append(
            f"your GradScaler's scale is {fmt_scale(given)} ({why}); diagnosed at {fmt_scale(default)}, where a fresh "
            "GradScaler starts. If this batch comes out healthy there, what drove the scale down is in other batches "
            "or steps: ampdoctor.watch finds the step during training"
        )
        return default, f"GradScaler default (the given scaler's scale is {fmt_scale(given)})", environment
    if dtype == torch.float16:
        return DEFAULT_FP16_SCALE, "GradScaler default; no scaler given", environment
    return 1.0, "unscaled; bfloat16 needs no scaler", environment


def check_autocast_effect(survey: PassTrace, dtype_name: str, device_type: str) -> None:
    """Refuse to report on a low dtype that never ran: autocast off, or nothing cast to it (wrong device)."""
    if not survey.autocast:
        raise InvalidInput(
            f"torch.autocast({device_type!r}, dtype={dtype_name}) was not in effect during the step (torch "
            f"switched it off for this device); nothing ran in {dtype_name}, so there is nothing to diagnose; "
            "check device_type"
        )
    seen = [r for c in survey.calls for r in (*c.inputs, *c.outputs)] + list(survey.output)
    if not survey.low_ops and not any(r.stats.dtype == dtype_name for r in seen) and not any(
        e.stats.dtype == dtype_name for e in survey.grad_events
    ):  # (ops inside modules count: ``x @ W + b`` with a float32 bias returns float32 from a float16 matmul)
        raise InvalidInput(
            f"autocast({device_type!r}, dtype={dtype_name}) changed nothing: no module produced {dtype_name}. "
            f"Either the model and batch live on another device than {device_type!r} (pass device_type= for "
            "the device they are on), or the model has no op that autocast runs in low precision"
        )


def backward_note(trace: PassTrace, requested: bool, params: list[tuple[str, nn.Parameter]]) -> str:
    """Why no gradient was computed, or "" when the backward ran."""
    if trace.backward_ran:
        return ""
    if not requested:
        return "backward=False: only the forward was diagnosed"
    if not any(p.requires_grad for _, p in params):
        return "no parameter requires grad (all frozen): no gradient was computed or checked"
    return "the loss does not require grad (detached from the parameters): no gradient was computed or checked"
