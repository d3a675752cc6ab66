"""The per-call row model: every fact a renderer shows about a call or a tensor, computed once from a Report.

Text, markdown, HTML, the DataFrame and the plot all read these rows, so they cannot disagree on what is
non-finite, what the headroom is, or which row is the origin. Pure: records in, rows out.

Headroom and the colour levels below it apply only to tensors held in the diagnosed low-precision format (a
float32 tensor above 65504 is not close to any limit of its own, and never "non-finite" because it is large);
a tensor holding inf/NaN is ``nonfinite`` whatever its dtype.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Optional

from ..analysis import forward_creators, headroom_bits, is_mask, origin_event
from ..records import FormatLimits, ModuleCall, OpPeak, TensorRecord, TensorStats
from ..thresholds import HEADROOM_TIGHT_BITS, HEADROOM_WARN_BITS
from .document import RANKED
from .numbers import fmt_num

if TYPE_CHECKING:
    from .data import ReportData

Level = Literal["nonfinite", "warn", "tight", "fine", "none"]
# Worst first; renderers sort and colour by it (CSS class ``ad-<level>``).
LEVELS: tuple[Level, ...] = ("nonfinite", "warn", "tight", "fine", "none")
LEVEL_RANK = {level: i for i, level in enumerate(LEVELS)}

TensorKind = Literal["input", "output", "grad_output", "grad_input", "grad_param", "param"]
Section = Literal["forward", "backward", "parameters"]
CallRole = Literal["origin", "creator", "carries", "unfinished", ""]


def tensor_headroom(stats: TensorStats, limits: FormatLimits, scale: float = 1.0) -> Optional[float]:
    """Bits between the tensor's largest magnitude as held (``scale`` times the recorded values, for gradients)
    and the format's max: ``-inf`` when it holds inf/NaN, None when not measured or not in the low format."""
    if not stats.measured:
        return None
    if not stats.is_finite:
        return -math.inf
    if stats.dtype != limits.dtype or stats.abs_max is None:
        return None
    return headroom_bits(stats.abs_max * scale, limits)


def tensor_level(stats: TensorStats, limits: FormatLimits, scale: float = 1.0) -> Level:
    """Colour band: non-finite, under 1 bit, under 4 bits of headroom, fine, or not measured."""
    if not stats.measured:
        return "none"
    return _level(tensor_headroom(stats, limits, scale))


def _level(bits: Optional[float]) -> Level:
    """The band of a measured tensor with ``bits`` of headroom (``tensor_headroom``)."""
    if bits is None:
        return "fine"
    if bits == -math.inf:
        return "nonfinite"
    if bits < HEADROOM_WARN_BITS:
        return "warn"
    if bits < HEADROOM_TIGHT_BITS:
        return "tight"
    return "fine"


def left_out_line(left_out: int, shown: int, which: str = RANKED) -> str:
    """The line under a bounded table: how many rows it leaves out, which it shows, and where they all are."""
    rows = "row" if left_out == 1 else "rows"
    return (f"… {left_out} more {rows} left out (the {shown} {which} are shown); the JSON report "
            "(report.to_json()) has every row")


def bits_text(bits: Optional[float], measured: bool = True) -> str:
    """A headroom cell: "non-finite", "∞", "-" (not in the diagnosed format), "" (not measured)."""
    if not measured:
        return ""
    if bits is None:
        return "-"
    if bits == -math.inf:
        return "non-finite"
    return "∞" if math.isinf(bits) else f"{bits:.2f}"


@dataclass(frozen=True)
class TensorRow:
    """One tensor: a call's input or output, a gradient event, or a module's parameter."""

    section: Section
    kind: TensorKind
    tensor: str  # "out", "args[0]", "grad:out", "weight", ...
    stats: TensorStats
    label: Optional[str] = None  # the call's label (None for a parameter)
    module: Optional[str] = None  # "" is the root; None when unknown (a gradient of an unowned parameter)
    call: Optional[int] = None
    class_name: Optional[str] = None
    call_index: Optional[int] = None
    end_order: Optional[int] = None
    grad_order: Optional[int] = None
    param: Optional[str] = None
    scale: float = 1.0  # what the recorded values were multiplied by when held (the loss scale, for gradients)
    requires_grad: Optional[bool] = None
    producer: Optional[int] = None
    via_base: Optional[bool] = None
    origin: bool = False
    level: Level = "none"
    headroom_bits: Optional[float] = None

    @property
    def abs_max_held(self) -> Optional[float]:
        return None if self.stats.abs_max is None else self.stats.abs_max * self.scale


@dataclass(frozen=True)
class CallRow:
    """One module call of the forward, with its worst output (least headroom, non-finite first)."""

    call: ModuleCall
    depth: int
    role: CallRole
    worst: Optional[TensorRow]
    outputs: tuple[TensorRow, ...]
    inputs_abs_max: Optional[float]  # over measured inputs (fill masks aside)
    inputs_measured: int
    nonfinite_input: bool  # a non-finite input that is not a mask
    mask_input: bool
    # The largest value the call's own ops made, when larger than its inputs and outputs show (the scores inside
    # an attention): None otherwise. ``op_headroom_bits`` is its headroom.
    op_peak: Optional[OpPeak] = None
    op_headroom_bits: Optional[float] = None

    @property
    def level(self) -> Level:
        return self.worst.level if self.worst is not None else "none"

    @property
    def headroom_bits(self) -> Optional[float]:
        return self.worst.headroom_bits if self.worst is not None else None

    @property
    def label(self) -> str:
        return self.call.label


def _key(row: TensorRow) -> tuple[int, float]:
    bits = row.headroom_bits
    return LEVEL_RANK[row.level], bits if bits is not None else math.inf


def worst(rows: Sequence[TensorRow]) -> Optional[TensorRow]:
    """The measured row with the least headroom, non-finite first."""
    measured = [r for r in rows if r.stats.measured]
    return min(measured, key=_key) if measured else None


def _tensor_row(stats: TensorStats, limits: FormatLimits, scale: float, fields: dict[str, Any]) -> TensorRow:
    bits = tensor_headroom(stats, limits, scale)  # once: the level is its band
    return TensorRow(
        stats=stats,
        scale=scale,
        level=_level(bits) if stats.measured else "none",
        headroom_bits=bits,
        **fields,
    )


def _call_fields(c: ModuleCall) -> dict[str, Any]:
    return {"label": c.label, "module": c.module, "call": c.call, "class_name": c.class_name, "call_index": c.index}


def _depths(calls: Sequence[ModuleCall]) -> dict[int, int]:
    by_index = {c.index: c for c in calls}
    depth: dict[int, int] = {}
    for c in calls:
        d, p = 0, c.parent
        while p is not None and p in by_index:
            d, p = d + 1, by_index[p].parent
        depth[c.index] = d
    return depth


@dataclass(frozen=True)
class ReportRows:
    """All rows of one report: build once with :meth:`of`, then let each renderer pick what it shows."""

    calls: tuple[CallRow, ...]  # completed calls in order of completion, then unfinished ones
    inputs: tuple[TensorRow, ...]  # every call's inputs, calls in start order
    grads: tuple[TensorRow, ...]  # every gradient event, in execution order
    params: tuple[TensorRow, ...]

    @property
    def outputs(self) -> tuple[TensorRow, ...]:
        return tuple(r for c in sorted(self.calls, key=lambda c: c.call.index) for r in c.outputs)

    def by_headroom(self) -> list[TensorRow]:
        """Every measured call output, the least headroom first (non-finite ones first of all)."""
        return sorted((r for c in self.calls for r in c.outputs if r.stats.measured), key=_key)

    @classmethod
    def of(cls, report: ReportData) -> ReportRows:
        """The rows of ``report``, built once: every renderer of the same report object shares them (the last
        report's rows are kept, by identity, while that report lives)."""
        cached = _LAST.get("rows")
        if cached is not None and cached[0]() is report:
            return cached[1]
        rows = cls._build(report)
        try:
            _LAST["rows"] = (weakref.ref(report), rows)
        except TypeError:
            pass
        return rows

    @classmethod
    def _build(cls, report: ReportData) -> ReportRows:
        trace, limits = report.trace, report.run.limits
        return cls(
            calls=tuple(_call_rows(report)),
            inputs=tuple(
                _tensor_row(
                    r.stats, limits, 1.0,
                    {"section": "forward", "kind": "input", "tensor": r.path, "end_order": c.end_order,
                     "requires_grad": r.requires_grad, "producer": r.producer, **_call_fields(c)},
                )
                for c in trace.calls
                for r in c.inputs
            ),
            grads=tuple(_grad_rows(report)),
            params=tuple(
                _tensor_row(
                    p.stats, limits, 1.0,
                    {"section": "parameters", "kind": "param", "tensor": p.name.rsplit(".", 1)[-1],
                     "module": info.name, "class_name": info.class_name, "param": p.name,
                     "requires_grad": p.requires_grad},
                )
                for info in report.modules
                for p in info.params
            ),
        )


_LAST: dict[str, tuple[weakref.ref[Any], ReportRows]] = {}


def _call_rows(report: ReportData) -> list[CallRow]:
    trace, limits = report.trace, report.run.limits
    origin = report.forward_origin
    creators = {c.index for c in forward_creators(trace)}
    depth = _depths(trace.calls)
    done = sorted((c for c in trace.calls if c.end_order >= 0), key=lambda c: c.end_order)
    unfinished = [c for c in trace.calls if c.end_order < 0]
    peaks = {p.call_index: p for p in trace.op_peaks}
    rows = []
    for c in [*done, *unfinished]:
        is_origin = origin is not None and (origin.module, origin.call) == (c.module, c.call)
        origin_tensor = origin.tensor if origin is not None and is_origin else None
        outputs = tuple(
            _tensor_row(
                r.stats, limits, 1.0,
                {"section": "forward", "kind": "output", "tensor": r.path, "end_order": c.end_order,
                 "requires_grad": r.requires_grad, "origin": r.path == origin_tensor, **_call_fields(c)},
            )
            for r in c.outputs
        )
        top = worst(outputs)
        if c.end_order < 0:
            role: CallRole = "unfinished"
        elif is_origin:
            role = "origin"
        elif c.index in creators:
            role = "creator"
        elif top is not None and top.level == "nonfinite":
            role = "carries"
        else:
            role = ""
        measured = [r for r in c.inputs if r.stats.measured]
        peak = _shown_peak(peaks.get(c.index), measured, outputs)
        rows.append(
            CallRow(
                call=c,
                depth=depth[c.index],
                role=role,
                worst=top,
                outputs=outputs,
                inputs_abs_max=_inputs_abs_max(measured),
                inputs_measured=len(measured),
                nonfinite_input=any(not r.stats.is_finite and not is_mask(r) for r in measured),
                mask_input=any(is_mask(r) for r in c.inputs),
                op_peak=peak,
                op_headroom_bits=headroom_bits(peak.abs_max, limits) if peak is not None else None,
            )
        )
    return rows


def _shown_peak(
    peak: Optional[OpPeak], inputs: Sequence[TensorRecord], outputs: Sequence[TensorRow]
) -> Optional[OpPeak]:
    """The call's op peak when it is larger than its measured inputs and outputs suggest (masks aside)."""
    if peak is None:
        return None
    boundary = [r.stats.abs_max for r in inputs if not is_mask(r)] + [r.stats.abs_max for r in outputs]
    largest = max((v for v in boundary if v is not None), default=0.0)
    return peak if peak.abs_max > largest else None


def op_peak_text(row: CallRow) -> str:
    """'matmul 58,160 (0.17 bits)': the op peak inside a call, for a table cell or a note ("" when none)."""
    if row.op_peak is None:
        return ""
    return f"{row.op_peak.op} {fmt_num(row.op_peak.abs_max)} ({bits_text(row.op_headroom_bits)} bits)"


def _inputs_abs_max(records: Sequence[TensorRecord]) -> Optional[float]:
    values = [r.stats.abs_max for r in records if r.stats.abs_max is not None]
    return max(values) if values else None


def _grad_rows(report: ReportData) -> list[TensorRow]:
    trace, limits = report.trace, report.run.limits
    marked = origin_event(trace, report.backward_origin)
    owners = {p.name: info for info in report.modules for p in info.params}
    rows = []
    for e in sorted(trace.grad_events, key=lambda e: e.order):
        fields: dict[str, Any] = {}
        if e.call is not None and 0 <= e.call < len(trace.calls):
            fields.update(_call_fields(trace.calls[e.call]))
        elif e.param is not None and e.param in owners:
            fields.update(module=owners[e.param].name, class_name=owners[e.param].class_name)
        fields.update(
            section="backward", kind=f"grad_{e.kind}", grad_order=e.order, param=e.param, via_base=e.via_base,
            tensor=f"grad:{e.param}" if e.kind == "param" else f"grad:{e.path}",
            origin=marked is not None and e.order == marked.order,
        )
        rows.append(_tensor_row(e.stats, limits, trace.scale, fields))
    return rows
