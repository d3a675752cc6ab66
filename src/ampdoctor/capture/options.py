"""The options of a diagnosis and of one pass, as frozen records built once from the public keywords.

``ampdoctor.diagnose(...)`` turns its keywords into one :class:`DiagnoseOptions` before anything runs: every
keyword's type and range is checked there, and a bad one raises :class:`~ampdoctor.errors.InvalidInput` naming
the keyword, the value and what is expected (``scale=True`` is not a number; ``memory_limit=-1`` is not a size).
The passes get a :class:`PassOptions` each. The checks here are shared with the watch's options
(``ampdoctor.training.options``).
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from ..errors import InvalidInput
from ..thresholds import MARGIN_BITS
from .progress import Progress

LossFn = Callable[[Any, Any], torch.Tensor]
# progress(purpose, index, total): called as each pass starts (index from 0; total None: not known in advance).
ProgressFn = Callable[[str, int, Optional[int]], None]
ProgressOption = Union[None, bool, ProgressFn, Progress]

# Byte sizes given as text: a number, optional spaces, a unit. Decimal units count in powers of 1000, binary ones
# (KiB, MiB ...) in powers of 1024; the unit is case-sensitive ("1Gb" is not a size) and required.
SIZE_UNITS = {
    "B": 1, "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([A-Za-z]+)")
SIZE_EXPECTED = 'a number of bytes (an int >= 0) or a size such as "512MiB" or "1GB"'


def refuse(keyword: str, value: Any, expected: str) -> InvalidInput:
    """The error for a bad keyword: its name, the value given (and its type), and what it takes."""
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return InvalidInput(f"{keyword} must be {expected}; got {keyword}={shown} ({type(value).__name__})")


def is_int(value: Any) -> bool:
    """An integer that is not a bool (``True`` is not the number 1 here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_bool(keyword: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise refuse(keyword, value, "True or False")
    return value


def check_count(keyword: str, value: Any, minimum: int = 0) -> int:
    """An int at least ``minimum``."""
    if not is_int(value) or value < minimum:
        raise refuse(keyword, value, f"an int >= {minimum}")
    return int(value)


def check_callable(keyword: str, value: Any, expected: str) -> Any:
    if value is not None and not callable(value):
        raise refuse(keyword, value, expected)
    return value


def check_size(keyword: str, value: Any) -> int:
    """Bytes: an int >= 0, or text such as ``"512MiB"``, ``"1.5 GB"`` (see ``SIZE_UNITS``), parsed strictly."""
    if isinstance(value, str):
        match = _SIZE.fullmatch(value.strip())
        if match is None or match.group(2) not in SIZE_UNITS:
            raise refuse(keyword, value, f"{SIZE_EXPECTED} (units: {', '.join(SIZE_UNITS)})")
        return int(float(match.group(1)) * SIZE_UNITS[match.group(2)])
    if not is_int(value) or value < 0:
        raise refuse(keyword, value, SIZE_EXPECTED)
    return int(value)


# The names people write for the two formats (the CLI's --dtype names included), read case-insensitively.
LOW_DTYPE_NAMES = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "torch.float16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "torch.bfloat16": torch.bfloat16,
}  # fmt: skip


def check_low_dtype(keyword: str, value: Any, optional: bool = False) -> Optional[torch.dtype]:
    """``torch.float16`` / ``torch.bfloat16`` (or one of ``LOW_DTYPE_NAMES``: ``"fp16"``, ``"bf16"``, ...)."""
    if isinstance(value, str) and value.strip().lower() in LOW_DTYPE_NAMES:
        return LOW_DTYPE_NAMES[value.strip().lower()]
    allowed = (torch.float16, torch.bfloat16) + ((None,) if optional else ())
    if not any(value is a for a in allowed):  # identity: dtypes are singletons, and any object may define ==
        expected = "torch.float16 or torch.bfloat16 (or 'float16', 'fp16', 'bfloat16', 'bf16')"
        raise refuse(keyword, value, expected + (", or None" if optional else ""))
    return value  # type: ignore[no-any-return]


def check_path(keyword: str, value: Any) -> Any:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise refuse(keyword, value, "a folder path (str or os.PathLike), or None")
    return value


# underflow_reference=: "auto" runs the reference backward unless the survey's own gradients show it could find
# nothing (analysis.survey_only); "always" runs it whenever a larger finite scale exists; "never" does not.
PASS_POLICIES = ("auto", "always", "never")


@dataclass(frozen=True)
class DiagnoseOptions:
    """Every keyword of ``ampdoctor.diagnose`` (same names, same defaults), checked once when built.

    ``memory_limit`` is held in bytes (text such as ``"1GB"`` is converted here); the rest as given. See
    ``diagnose`` for what each option does.
    """

    loss_fn: Optional[LossFn] = None
    dtype: torch.dtype = torch.float16
    device_type: Optional[str] = None
    scaler: Any = None
    backward: bool = True
    scale: Optional[float] = None
    fp32_reference: bool = False
    verify: bool = True
    scale_window: Union[bool, str] = "auto"
    reference: Union[bool, int] = False
    policy: Optional[str] = None
    memory_limit: Union[None, int, str] = None
    progress: ProgressOption = None
    margin_bits: float = MARGIN_BITS
    verify_steps: int = 0
    optimizer: Any = None
    underflow_reference: str = "auto"

    def __post_init__(self) -> None:
        if not (is_int(self.verify_steps) and 0 <= self.verify_steps <= 10_000):
            raise refuse("verify_steps", self.verify_steps, "an int from 0 (off) to 10000")
        if self.optimizer is not None and not isinstance(self.optimizer, torch.optim.Optimizer):
            raise refuse(
                "optimizer", self.optimizer, "a torch.optim.Optimizer (its type and defaults are reused), or None"
            )
        if self.verify_steps and self.optimizer is not None and _needs_closure(self.optimizer):
            raise refuse(
                "optimizer", self.optimizer,
                "an optimizer whose step() needs no closure: verify_steps trains under a GradScaler, which cannot step "
                f"a {type(inner_optimizer(self.optimizer)).__name__} (pass another optimizer=, or verify_steps=0)",
            )
        margin = self.margin_bits
        if not (isinstance(margin, numbers.Real) and not isinstance(margin, bool) and 0 <= margin <= 8):
            raise refuse("margin_bits", margin, "a number of bits from 0 to 8 (1 means 2x below the format's max)")
        check_callable("loss_fn", self.loss_fn, "a function loss_fn(output, batch) -> scalar tensor, or None")
        object.__setattr__(self, "dtype", check_low_dtype("dtype", self.dtype))  # "fp16" -> torch.float16
        if self.device_type is not None and not (isinstance(self.device_type, str) and self.device_type):
            raise refuse("device_type", self.device_type, 'a device type such as "cuda" or "cpu", or None')
        if self.scaler is not None and not callable(getattr(self.scaler, "get_scale", None)):
            raise refuse("scaler", self.scaler, "a GradScaler (torch.amp.GradScaler: with get_scale()), or None")
        for name in ("backward", "fp32_reference", "verify"):
            check_bool(name, getattr(self, name))
        window = self.scale_window
        if not (isinstance(window, bool) or (isinstance(window, str) and window == "auto")):
            raise refuse("scale_window", self.scale_window, '"auto", True or False')
        if not (isinstance(self.underflow_reference, str) and self.underflow_reference in PASS_POLICIES):
            raise refuse("underflow_reference", self.underflow_reference, '"auto", "always" or "never"')
        scale = self.scale
        if scale is not None and not (
            isinstance(scale, numbers.Real) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0
        ):
            raise refuse("scale", scale, "a positive finite number (int or float, not a bool), or None")
        if not isinstance(self.reference, bool) and not (is_int(self.reference) and self.reference >= 1):
            raise refuse("reference", self.reference, "True, False, or an int >= 1 (that many levels down)")
        if self.policy not in (None, "native", "cuda"):
            raise refuse("policy", self.policy, '"native", "cuda", or None')
        if self.memory_limit is not None:
            object.__setattr__(self, "memory_limit", check_size("memory_limit", self.memory_limit))
        progress = self.progress
        if not (progress is None or isinstance(progress, (bool, Progress)) or callable(progress)):
            raise refuse(
                "progress", progress,
                "True, False, None, an ampdoctor Progress, or a function progress(purpose, index, total)",
            )

    @property
    def memory_bytes(self) -> Optional[int]:
        """The memory limit in bytes (``None``: what the device has available)."""
        assert not isinstance(self.memory_limit, str)  # converted when built
        return self.memory_limit


@dataclass(frozen=True)
class PassOptions:
    """What one pass measures, besides its scale (and its dtype, which is the spec's).

    ``detailed``: every statistic instead of the survey's min/max; ``zoom``: the (module, call) the op zoom runs
    inside; ``autocast=False``: the same step in float32; ``backward_zoom``: anomaly mode and the backward op
    zoom; ``reference``: per-call float32 references (True: leaf calls; n: calls n levels down); ``histograms``:
    binade histograms of the parameter gradients (1), and of every low-precision gradient too (2); ``hidden``:
    ops the survey flagged as making inf/NaN, as (module, call, op, occurrence), to count, classify per element
    and locate on this pass (``capture.hidden``).
    """

    detailed: bool = False
    zoom: Optional[tuple[str, int]] = None
    autocast: bool = True
    backward_zoom: bool = False
    reference: Union[bool, int] = False
    histograms: int = 0
    hidden: frozenset[tuple[str, int, str, int]] = frozenset()

    @property
    def survey_level(self) -> bool:
        """A plain pass in the low precision: what the probes at other scales can share one forward of."""
        return self.autocast and not self.detailed and self.reference is False

    def forward_key(self) -> tuple[Any, ...]:
        """What makes two passes' forwards the same (histograms are taken per backward)."""
        # type() keeps reference=True and reference=1 apart (True == 1 in a tuple).
        reference = (type(self.reference), self.reference)
        return (self.detailed, self.zoom, self.autocast, self.backward_zoom, reference, self.hidden)


PLAIN_PASS = PassOptions()  # a survey-level pass without histograms


def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer a training framework wraps (accelerate's ``AcceleratedOptimizer``, Lightning's
    ``LightningOptimizer``: ``.optimizer``), or ``optimizer`` itself."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer else optimizer


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """``optimizer.step`` requires a closure (``LBFGS``), which GradScaler.step refuses."""
    optimizer = inner_optimizer(optimizer)
    try:
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty
