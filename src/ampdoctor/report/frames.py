"""``Report.to_dataframe()``: one row per module call and tensor, statistics as columns (pandas, imported lazily).

Rows, in this order:

- ``kind="input"`` / ``"output"``: the floating and non-floating tensors at each module call's boundary, calls in
  start order (``call_index``), ``end_order`` giving the order of completion;
- ``"grad_output"`` / ``"grad_input"`` / ``"param_grad"``: every gradient event of the backward, in execution
  order (``grad_order``); statistics are unscaled, ``abs_max_held`` and ``headroom_bits`` are what the scaled
  backward held (times the loss scale);
- ``headroom_bits`` is ``log2(max / abs_max_held)`` for tensors held in the diagnosed format, ``-inf`` for a
  tensor holding inf/NaN (``abs_max`` is then its finite part's largest magnitude), NaN when not measured or
  held in a wider format (a float32 tensor has no float16 headroom to lose);
- ``"param"``: each module's own parameters;
- ``op_peak``, ``op_peak_abs_max``, ``op_peak_headroom_bits`` (output rows only): the largest value the call's own
  low-precision ops made, when it is larger than the call's inputs and outputs show (the scores inside an
  attention), as in the headroom table's "inside: op peak" column; empty otherwise.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

from .._optional import require
from ..records import TensorStats
from .rows import CallRow, ReportRows, TensorRow

if TYPE_CHECKING:
    from .data import ReportData

STAT_COLUMNS = tuple(f.name for f in dataclasses.fields(TensorStats) if f.name not in ("dtype", "shape"))
COLUMNS = (
    "section",
    "kind",
    "call_index",
    "end_order",
    "grad_order",
    "label",
    "module",
    "call",
    "class_name",
    "tensor",
    "param",
    "dtype",
    "shape",
    "numel",
    *STAT_COLUMNS,
    "abs_max",
    "abs_max_held",
    "headroom_bits",
    "finite",
    "nonfinite_count",
    "requires_grad",
    "producer",
    "via_base",
    "origin",
    "op_peak",
    "op_peak_abs_max",
    "op_peak_headroom_bits",
)
_COUNT_COLUMNS = (
    "call_index",
    "end_order",
    "grad_order",
    "call",
    "numel",
    "zero_count",
    "nan_count",
    "posinf_count",
    "neginf_count",
    "subnormal_count",
    "cast_overflow_count",
    "cast_flush_count",
    "nonfinite_count",
    "producer",
)


def _row(row: TensorRow, call: Optional[CallRow] = None) -> dict[str, Any]:
    stats = row.stats
    out: dict[str, Any] = {name: getattr(stats, name) for name in STAT_COLUMNS}
    out.update(
        section=row.section,
        kind=row.kind,
        call_index=row.call_index,
        end_order=row.end_order,
        grad_order=row.grad_order,
        label=row.label,
        module=row.module,
        call=row.call,
        class_name=row.class_name,
        tensor=row.tensor,
        param=row.param,
        dtype=stats.dtype,
        shape=tuple(stats.shape),
        numel=stats.numel,
        abs_max=stats.abs_max,
        abs_max_held=row.abs_max_held,
        headroom_bits=row.headroom_bits,
        finite=stats.is_finite if stats.measured else None,
        nonfinite_count=stats.nonfinite_count,
        requires_grad=row.requires_grad,
        producer=row.producer,
        via_base=row.via_base,
        origin=row.origin,
    )
    peak = call.op_peak if call is not None else None
    out.update(
        op_peak=f"{peak.op}#{peak.occurrence}" if peak is not None else None,
        op_peak_abs_max=peak.abs_max if peak is not None else None,
        op_peak_headroom_bits=call.op_headroom_bits if peak is not None and call is not None else None,
    )
    return out


def frame_rows(report: ReportData) -> list[dict[str, Any]]:
    """The rows of :func:`to_dataframe` as plain dicts (no pandas needed)."""
    rows = ReportRows.of(report)
    inputs: dict[Optional[int], list[TensorRow]] = {}
    for r in rows.inputs:
        inputs.setdefault(r.call_index, []).append(r)
    forward = sorted(rows.calls, key=lambda c: c.call.index)
    out = []
    for c in forward:
        out += [_row(r) for r in inputs.get(c.call.index, [])]
        out += [_row(r, c) for r in c.outputs]
    out += [_row(r) for r in rows.grads]
    out += [_row(r) for r in rows.params]
    return out


def to_dataframe(report: ReportData) -> Any:
    """A ``pandas.DataFrame`` with one row per module call and tensor (see the module docstring for the rows).

    Needs pandas: ``pip install 'ampdoctor[notebook]'``.
    """
    pd = require("pandas", "report.to_dataframe()")
    frame = pd.DataFrame(frame_rows(report), columns=list(COLUMNS))
    for name in _COUNT_COLUMNS:
        frame[name] = frame[name].astype("Int64")
    for name in ("finite", "requires_grad", "via_base"):
        frame[name] = frame[name].astype("boolean")
    frame["origin"] = frame["origin"].fillna(False).astype(bool)
    for name in ("op_peak_abs_max", "op_peak_headroom_bits"):
        frame[name] = frame[name].astype("float64")
    return frame
