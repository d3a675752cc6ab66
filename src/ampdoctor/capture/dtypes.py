"""Dtype and device helpers: the one place that names formats, casts to float32 and asks autocast what it does."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

# The formats ampdoctor diagnoses.
LOW_DTYPES = (torch.float16, torch.bfloat16)
DTYPES_BY_NAME = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``"float16"`` (the name records store)."""
    return str(dtype).replace("torch.", "")


def low_dtype(name: str, default: torch.dtype = torch.float16) -> torch.dtype:
    """The low-precision dtype a record names, or ``default`` for anything else."""
    return DTYPES_BY_NAME.get(name, default)


def upcast(value: Any) -> Any:
    """A low-precision floating tensor as float32, still on the autograd graph (a float32 fallback trains);
    anything else as it is."""
    if isinstance(value, torch.Tensor) and value.dtype in LOW_DTYPES:
        return value.float()
    return value


def to_fp32(value: Any) -> Any:
    """A detached float32 copy of a low-precision floating tensor; other tensors detached, other values as they are.

    Used wherever ampdoctor re-runs something in float32 (fallbacks, per-call references).
    """
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and value.dtype != torch.float32 and value.dtype != torch.float64:
            return value.detach().float()
        return value.detach()
    return value


def model_device_type(model: nn.Module, fallback: Any = None) -> str:
    """The device type of the model's first parameter, else of the first tensor in ``fallback``, else ``"cpu"``."""
    param = next(model.parameters(), None)
    if param is not None:
        return param.device.type
    if fallback is not None:
        from .walk import iter_tensors

        for _, t in iter_tensors(fallback, ""):
            return t.device.type
    return "cpu"


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is really on for ``device_type`` here (``torch.autocast("cuda")`` on a machine without
    CUDA warns once and stays off)."""
    return autocast_dtype(device_type) is not None


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The autocast dtype in force for ``device_type`` right now, or None when autocast is off."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return None
    except TypeError:  # torch < 2.4: no device argument
        if device_type == "cpu":
            return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
        return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
