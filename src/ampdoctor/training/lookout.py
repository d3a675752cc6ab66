"""The watch's look ahead, after each step's read-back: headroom trends, the overflow forecast and its warning,
when to sample densely, which modules to track every step, and the scalars for ``log_to``.

* **Every step** the root's output range (read anyway) and the tracked modules' (the ``TRACKED_MODULES``
  tightest of the last sampled step, hooked on unsampled steps too) feed the :class:`~.forecast.Forecaster`;
  sampled steps feed every module.
* **Dense sampling**: when one of them trends upward significantly (:meth:`~.forecast.Forecaster.trending`), the
  next ``DENSE_STEPS_ON_TREND`` steps measure every module's outputs (not their gradients: the forecast needs only
  the forward; those steps count as sampled, with no gradient statistics), so a fast drift is seen by every
  module, not by one sample in fifty.
* **The warning**: one WARNING line on the ``ampdoctor`` logger naming the module, its headroom in bits, the rate
  in bits per step and the steps left; the report carries it (``findings.warnings``); it repeats only when the
  forecast changes materially.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, Optional

import torch

from ..capture.dtypes import dtype_name
from ..capture.stats import format_limits
from .forecast import Forecast, Forecaster
from .optrack import is_op_key
from .readback import Pair, bad_pair
from .sinks import PREFIX, Sink, Value, make_sink

log = logging.getLogger("ampdoctor")

# Modules hooked on every step (the tightest of the last sampled step, one per distinct |x|max), and the
# headroom scalars logged.
TRACKED_MODULES = 4
# Steps sampled after a significant upward trend of the root output or a tracked module.
DENSE_STEPS_ON_TREND = 24
# Forecast warnings the report keeps.
FORECASTS_KEPT = 10


def maxima(pairs: list[Pair]) -> dict[str, float]:
    """Largest finite |x| per module over its low-precision outputs (``""`` the root), in completion order."""
    out: dict[str, float] = {}
    for kind, module, lo, hi, low in pairs:
        if kind == "grad" or not low or bad_pair(lo, hi):
            continue
        value = max(abs(hi), abs(lo) if math.isfinite(lo) else 0.0)
        out[module] = max(out.get(module, 0.0), value)
    return out


class Lookout:
    """One watch's forecaster, dense-sampling window, tracked modules and sink."""

    def __init__(self, warn_bits: float, horizon: float, log_to: Any, rank: int, world_size: int) -> None:
        self.warn_bits = float(warn_bits)
        self.horizon = float(horizon)
        self.sink: Optional[Sink] = make_sink(log_to) if log_to is not None else None
        self.rank, self.world_size = rank, world_size
        self.forecaster: Optional[Forecaster] = None
        self.dense_until = -1
        self.skipped = 0
        self.unguarded = 0  # steps with non-finite gradients that no GradScaler skipped
        self.texts: list[str] = []  # the forecast warnings, for the report
        self.seen: dict[str, float] = {}  # the last step's |x|max per module (and per followed op)

    def _forecaster(self, low: Optional[torch.dtype]) -> Forecaster:
        if self.forecaster is None:
            dtype = low or torch.float16
            self.forecaster = Forecaster(self.warn_bits, self.horizon, format_limits(dtype).max, dtype_name(dtype))
        return self.forecaster

    def after_step(
        self, step: int, sampled: bool, pairs: list[Pair], low: Optional[torch.dtype], scale: Optional[float],
        skipped: bool, underflow: Optional[float], out_max: Optional[Mapping[str, float]] = None,
        track: bool = True, unguarded: bool = False,
    ) -> Optional[list[str]]:
        """Fold one step in (``out_max``: the step record's output maxima, when it has them: :func:`maxima` of its
        module pairs; read, never changed). Returns the new tracked-module list on a sampled step (else None;
        ``track=False``: the caller samples every step, so tracked modules would never be hooked)."""
        f = self._forecaster(low)
        if out_max is not None:  # the step record's maxima already: only the ops' are left to add
            ops = maxima([p for p in pairs if p[0] == "op"])
            seen = out_max if not ops and isinstance(out_max, dict) else {**out_max, **ops}
        else:
            seen = maxima(pairs)
        self.seen = seen
        forecast = f.observe(step, seen)
        if forecast is not None:
            self._warn(forecast)
        if f.trending() and step >= self.dense_until:
            self.dense_until = step + DENSE_STEPS_ON_TREND
        self.skipped += int(skipped)
        self.unguarded += int(unguarded)
        if self.sink is not None:
            self._log(step, scale, underflow, forecast)
        if sampled and track:
            # one module per value: a container returning its last child's output, or an in-place ReLU handing
            # back its input, measures the very same tensor again (children complete first and are kept)
            distinct: dict[float, str] = {}
            if out_max is not None:  # modules only, no op keys
                for m, value in out_max.items():
                    if m:
                        distinct.setdefault(value, m)
            else:
                for m, value in seen.items():
                    if m and not is_op_key(m):
                        distinct.setdefault(value, m)
            return f.tightest(TRACKED_MODULES, list(distinct.values()))
        return None

    def _warn(self, forecast: Forecast) -> None:
        text = forecast.text()
        if len(self.texts) < FORECASTS_KEPT:
            self.texts.append(text)
        prefix = f"[rank {self.rank}] " if self.world_size > 1 else ""
        log.warning("%sampdoctor: step %d: %s", prefix, forecast.step, text)

    def _log(self, step: int, scale: Optional[float], underflow: Optional[float], forecast: Optional[Forecast]) -> None:
        assert self.forecaster is not None and self.sink is not None
        values: dict[str, Value] = {}
        if scale is not None:
            values[PREFIX + "loss_scale"] = float(scale)
        values[PREFIX + "skipped_steps"] = float(self.skipped)
        if self.unguarded:  # bfloat16 or a disabled scaler: the steps whose NaN/inf gradients were applied
            values[PREFIX + "nonfinite_grad_steps"] = float(self.unguarded)
        latest = self.forecaster.latest()
        if latest:
            values[PREFIX + "headroom_bits_min"] = min(latest.values())
            for m in self.forecaster.tightest(TRACKED_MODULES):
                values[f"{PREFIX}headroom_bits/{m or 'root'}"] = latest[m]
        if underflow is not None:
            values[PREFIX + "underflow_share"] = underflow
        if forecast is not None:
            values[PREFIX + "forecast"] = forecast.text()
        self.sink.log(step, values)

    def close(self) -> Any:
        if self.sink is not None:
            self.sink.flush()
