"""Tensor statistics computed on the tensor's own device and read back once per pass.

Each statistic is kept as a 0-d tensor on the device; :meth:`StatsCollector.read` stacks them and copies
them to the host in a single transfer per device, so a pass costs one host synchronisation, not one per
tensor or per statistic. No reference to a measured tensor is kept.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from ..records import FormatLimits, TensorStats
from .dtypes import dtype_name

# Statistic names in the order they are stacked. The survey level takes one fused min/max and a zero count.
SURVEY_FIELDS = ("min", "max", "zero_count")
DETAIL_FIELDS = SURVEY_FIELDS + (
    "nan_count",
    "posinf_count",
    "neginf_count",
    "finite_min",
    "finite_max",
    "min_abs_nonzero",
    "subnormal_count",
    "cast_overflow_count",
    "cast_flush_count",
)
_COUNT_FIELDS = {name for name in DETAIL_FIELDS if name.endswith("_count")}


def format_limits(dtype: torch.dtype) -> FormatLimits:
    """Limits of a floating format, with the exact round-to-nearest-even edges used when casting to it."""
    info = torch.finfo(dtype)
    mantissa_bits = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23, torch.float64: 52}[dtype]
    top_exponent = math.floor(math.log2(info.max))
    smallest_subnormal = info.tiny * 2.0**-mantissa_bits
    return FormatLimits(
        dtype=str(dtype).replace("torch.", ""),
        max=float(info.max),
        tiny=float(info.tiny),
        smallest_subnormal=smallest_subnormal,
        # Half an ulp above max rounds (to even) to inf; exactly half of the smallest subnormal rounds to 0.
        overflow_threshold=float(info.max) + 2.0 ** (top_exponent - mantissa_bits - 1),
        flush_threshold=smallest_subnormal / 2,
    )


_internal = threading.local()


def measuring() -> bool:
    """True while ampdoctor itself is computing statistics (op zooms must not mistake those ops for the model's)."""
    return getattr(_internal, "depth", 0) > 0


@dataclass
class _Slot:
    dtype: str
    shape: tuple[int, ...]
    device: Optional[torch.device]  # None: nothing measured (not floating, or empty)
    position: int  # index among the measured tensors of its device
    detailed: bool


class StatsCollector:
    """Collects statistics of many tensors during a pass; ``read()`` returns them all at once.

    ``add`` returns a slot number; the same tensor object at the same version is measured once.
    """

    def __init__(self, low_dtype: torch.dtype, detailed: bool) -> None:
        self.low_dtype = low_dtype
        self.detailed = detailed
        self._tiny = torch.finfo(low_dtype).tiny
        self._slots: list[_Slot] = []
        self._values: dict[torch.device, dict[str, list[torch.Tensor]]] = {}
        self._positions: dict[torch.device, dict[bool, int]] = {}
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int, bool, int]] = {}
        self._value_groups: list[tuple[torch.device, int, int]] = []
        self.values: list[list[float]] = []
        self.readbacks = 0

    def add(self, tensor: torch.Tensor, detailed: Optional[bool] = None) -> int:
        want_detail = self.detailed if detailed is None else detailed
        key = id(tensor)
        seen = self._seen.get(key)
        version = tensor._version
        if seen is not None and seen[0]() is tensor and seen[1] == version and seen[2] == want_detail:
            return seen[3]
        _internal.depth = getattr(_internal, "depth", 0) + 1
        try:
            slot = self._measure(tensor.detach(), want_detail)
        finally:
            _internal.depth -= 1
        try:
            self._seen[key] = (weakref.ref(tensor), version, want_detail, slot)
        except TypeError:  # a tensor subclass without weakref support: measure again next time
            pass
        return slot

    def _measure(self, x: torch.Tensor, detailed: bool) -> int:
        shape = tuple(x.shape)
        if not x.is_floating_point() or x.numel() == 0 or x.is_complex():
            self._slots.append(_Slot(dtype_name(x.dtype), shape, None, -1, False))
            return len(self._slots) - 1
        dtype = dtype_name(x.dtype)
        if x.element_size() == 1:  # float8: few kernels support it; its values are exact in float32
            x = x.float()
        device = x.device
        per_device = self._values.setdefault(device, {})
        values = self._detail(x) if detailed else self._survey(x)
        # Survey and detail slots are stacked separately, so each has its own running position.
        positions = self._positions.setdefault(device, {True: 0, False: 0})
        position = positions[detailed]
        positions[detailed] += 1
        prefix = "d:" if detailed else "s:"
        for name, value in zip(DETAIL_FIELDS if detailed else SURVEY_FIELDS, values):
            per_device.setdefault(prefix + name, []).append(value)
        self._slots.append(_Slot(dtype, shape, device, position, detailed))
        return len(self._slots) - 1

    @staticmethod
    def _survey(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        low, high = torch.aminmax(x)  # one pass; NaN and inf show up in the result
        return low, high, torch.count_nonzero(x)  # turned into a zero count in read()

    def _detail(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inf = math.inf
        finite = torch.isfinite(x)
        low, high = torch.aminmax(x)
        magnitude = torch.where(finite, x.abs(), 0.0)
        nonzero_magnitude = torch.where(magnitude > 0, magnitude, inf)
        if x.dtype == self.low_dtype:
            cast_overflow = cast_flush = torch.zeros((), dtype=torch.int64, device=x.device)
        elif x.dtype == torch.float64:
            # torch casts float64 to float16/bfloat16 through float32, rounding twice: 65519.999999 would become
            # inf and 2**-25 * (1 + 2**-40) zero. Count with the exact single-rounding edges instead; they are
            # exact in float64. ``magnitude`` is already 0 for non-finite values.
            limits = format_limits(self.low_dtype)
            cast_overflow = (magnitude >= limits.overflow_threshold).sum()
            cast_flush = ((magnitude > 0) & (magnitude <= limits.flush_threshold)).sum()
        else:
            cast = x.to(self.low_dtype)
            cast_overflow = (torch.isinf(cast) & finite).sum()
            cast_flush = ((cast == 0) & (x != 0) & finite).sum()
            del cast
        return (
            low,
            high,
            torch.count_nonzero(x),  # turned into a zero count in read()
            torch.isnan(x).sum(),
            torch.isposinf(x).sum(),
            torch.isneginf(x).sum(),
            torch.where(finite, x, inf).amin(),
            torch.where(finite, x, -inf).amax(),
            nonzero_magnitude.amin(),
            (nonzero_magnitude < self._tiny).sum(),
            cast_overflow,
            cast_flush,
        )

    def add_values(self, values: list[torch.Tensor]) -> int:
        """Queue a group of 0-d tensors (same device) for the same single readback; see ``values``."""
        device = values[0].device
        per_device = self._values.setdefault(device, {})
        for k, value in enumerate(values):
            per_device.setdefault(f"x:{k}", []).append(value)
        position = len(per_device["x:0"]) - 1
        self._value_groups.append((device, position, len(values)))
        return len(self._value_groups) - 1

    def read(self) -> list[TensorStats]:
        """Copy every statistic to the host (one transfer per device) and build the records.

        Groups queued with ``add_values`` are in ``self.values`` afterwards, in the order they were added.
        """
        host: dict[tuple[torch.device, str], list[float]] = {}
        for device, fields in self._values.items():
            names = list(fields)
            # Mixed dtypes promote in stack/cat: fp16/bf16/fp32 values are exact in float64.
            wide = torch.float32 if device.type == "mps" else torch.float64
            flat = torch.cat([torch.stack(fields[name]).to(wide) for name in names])
            numbers = flat.tolist()
            self.readbacks += 1
            start = 0
            for name in names:
                count = len(fields[name])
                host[(device, name)] = numbers[start : start + count]
                start += count
        out = []
        for slot in self._slots:
            if slot.device is None:
                out.append(TensorStats(dtype=slot.dtype, shape=slot.shape))
                continue
            prefix = "d:" if slot.detailed else "s:"
            wanted: tuple[str, ...] = DETAIL_FIELDS if slot.detailed else SURVEY_FIELDS
            values: dict[str, float | int | None] = {}
            for name in wanted:
                value = host[(slot.device, prefix + name)][slot.position]
                values[name] = int(value) if name in _COUNT_FIELDS else float(value)
            values["zero_count"] = math.prod(slot.shape) - int(values["zero_count"] or 0)  # stored as nonzero
            if slot.detailed:
                _drop_empty_extremes(values)
            out.append(TensorStats(dtype=slot.dtype, shape=slot.shape, **values))  # type: ignore[arg-type]
        self.values = [
            [host[(device, f"x:{k}")][position] for k in range(count)] for device, position, count in self._value_groups
        ]
        return out

    def __len__(self) -> int:
        return len(self._slots)


def _drop_empty_extremes(values: dict[str, float | int | None]) -> None:
    """Reductions over an empty selection return ±inf: there is no finite (nonzero) value to report."""
    for name in ("finite_min", "finite_max", "min_abs_nonzero"):
        value = values[name]
        if isinstance(value, float) and math.isinf(value):
            values[name] = None


def tensor_stats(tensor: torch.Tensor, low_dtype: torch.dtype = torch.float16, detailed: bool = True) -> TensorStats:
    """Statistics of a single tensor (one host synchronisation). Convenient for tests and one-off checks."""
    collector = StatsCollector(low_dtype, detailed)
    collector.add(tensor)
    return collector.read()[0]
