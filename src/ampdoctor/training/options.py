"""The options of a watch, as one frozen record: the one definition of their names, defaults and checks.

``Watch(model, scaler, **keywords)`` builds one :class:`WatchOptions` before anything is installed (``watch`` is
``Watch(...).start()`` with the same parameters). A keyword of the wrong type or range raises
:class:`~ampdoctor.errors.InvalidInput` naming the keyword, the value and what it takes.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, TypeVar, Union, cast

import torch

from ..capture.options import (
    LossFn,
    check_bool,
    check_callable,
    check_count,
    check_low_dtype,
    check_path,
    check_size,
    refuse,
)
from .bundle import PathLike
from .forecast import FORECAST_HORIZON, WARN_HEADROOM_BITS
from .sinks import accepts, make_sink

if sys.version_info >= (3, 10):
    from typing import ParamSpec
else:  # a dependency of torch
    from typing_extensions import ParamSpec

P = ParamSpec("P")
R = TypeVar("R")

# Per-module statistics every this many steps by default (every skipped step is captured regardless).
DEFAULT_STATS_EVERY = 50
# Steps kept in the ring buffer.
DEFAULT_HISTORY = 2048
# Full captures (a diagnose on the failing inputs) per kind: runs of skipped steps, and persistent failures.
DEFAULT_MAX_CAPTURES = 8
# The gradient of the loss w.r.t. the root outputs is kept per step (to replay the step's own backward in a
# capture) while it takes at most this many bytes; beyond, the capture says what was not kept.
MAX_KEPT_OUTPUT_GRAD_BYTES = 256 * 2**20


@dataclass(frozen=True)
class WatchOptions:
    """Every keyword of ``Watch``/``watch`` (same names, same defaults), checked once when built.

    ``max_output_grad_bytes`` is held in bytes (text such as ``"64MiB"`` is converted here). See
    :func:`ampdoctor.watch` for what each option does.
    """

    loss_fn: Optional[LossFn] = None
    dtype: Optional[torch.dtype] = None
    stats_every: int = DEFAULT_STATS_EVERY
    history: int = DEFAULT_HISTORY
    max_captures: int = DEFAULT_MAX_CAPTURES
    bundle_dir: Optional[PathLike] = None
    save_bundle: bool = True
    max_output_grad_bytes: Union[int, str] = MAX_KEPT_OUTPUT_GRAD_BYTES
    log_to: Any = field(default=None, compare=False)  # a SummaryWriter, a W&B run, a callable ... (.sinks)
    warn_headroom_bits: float = WARN_HEADROOM_BITS
    forecast_horizon: int = FORECAST_HORIZON

    def __post_init__(self) -> None:
        check_callable("loss_fn", self.loss_fn, "a function loss_fn(output, batch) -> scalar tensor, or None")
        object.__setattr__(self, "dtype", check_low_dtype("dtype", self.dtype, optional=True))
        check_count("stats_every", self.stats_every)
        check_count("history", self.history, minimum=1)
        check_count("max_captures", self.max_captures)
        check_path("bundle_dir", self.bundle_dir)
        check_bool("save_bundle", self.save_bundle)
        size = check_size("max_output_grad_bytes", self.max_output_grad_bytes)
        object.__setattr__(self, "max_output_grad_bytes", size)
        if isinstance(self.warn_headroom_bits, bool) or not isinstance(self.warn_headroom_bits, (int, float)) or not (
            0 < self.warn_headroom_bits < 64
        ):
            raise refuse("warn_headroom_bits", self.warn_headroom_bits, "a number of bits > 0 (about 6)")
        check_count("forecast_horizon", self.forecast_horizon, minimum=1)
        if self.log_to is not None and not accepts(self.log_to):
            make_sink(self.log_to)  # raises InvalidInput naming log_to

    @property
    def output_grad_bytes(self) -> int:
        """``max_output_grad_bytes`` in bytes."""
        assert not isinstance(self.max_output_grad_bytes, str)  # converted when built
        return self.max_output_grad_bytes


def check_scaler(scaler: Any) -> None:
    """The watched scaler: ``None`` or a GradScaler (its ``scale`` and ``update`` are tapped)."""
    if scaler is not None and not all(callable(getattr(scaler, m, None)) for m in ("scale", "update")):
        raise refuse("scaler", scaler, "a GradScaler (with scale() and update()), or None")


def parameters_of(make: Callable[P, Any]) -> Callable[[Callable[..., R]], Callable[P, R]]:
    """Give the decorated function ``make``'s parameters (for type checkers, ``help()`` and ``inspect``), so that
    they are defined once, on ``make``."""

    def decorate(function: Callable[..., R]) -> Callable[P, R]:
        signature = inspect.signature(make)
        return_annotation = inspect.signature(function).return_annotation
        function.__signature__ = signature.replace(return_annotation=return_annotation)  # type: ignore[attr-defined]
        return cast("Callable[P, R]", function)

    return decorate
