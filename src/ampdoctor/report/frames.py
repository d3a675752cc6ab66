"""``Report.to_dataframe()``: one row per module call and tensor, statistics as columns (pandas, imported lazily).

Rows, in this order:

- ``kind="input"`` / ``"output"``: the floating and non-floating tensors at each module call's boundary, calls in
  start order (``call_index``), ``end_order`` giving the order of completion;
- ``"grad_output"`` / ``"grad_input"`` / ``"param_grad"``: every gradient event of the backward, in execution
  order (``grad_order``); statistics are unscaled, ``abs_max_held`` and ``headroom_bits`` are what the scaled
  backward held (times the loss scale);
- ``headroom_bits`` is ``log2(max / abs_max_held)`` of the diagnosed format, ``-inf`` for a tensor holding
  inf/NaN (``abs_max`` is then its finite part's largest magnitude), NaN when not measured;
- ``"param"``: each module's own parameters.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Optional

from .._optional import require
from ..analysis import Origin, headroom_bits, origin_event
from ..records import FormatLimits, TensorStats

if TYPE_CHECKING:
    from .report import Report

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


def _stats_columns(stats: TensorStats, limits: FormatLimits, scale: float = 1.0) -> dict[str, Any]:
    row: dict[str, Any] = {name: getattr(stats, name) for name in STAT_COLUMNS}
    held = None if stats.abs_max is None else stats.abs_max * scale
    # Out of range already: no headroom (sorts first); the finite part's magnitude stays in abs_max.
    bits = -math.inf if stats.measured and not stats.is_finite else headroom_bits(held, limits)
    row.update(
        dtype=stats.dtype,
        shape=tuple(stats.shape),
        numel=stats.numel,
        abs_max=stats.abs_max,
        abs_max_held=held,
        headroom_bits=bits,
        finite=stats.is_finite if stats.measured else None,
        nonfinite_count=stats.nonfinite_count,
    )
    return row


def _is_origin(origin: Optional[Origin], module: str, call: int, tensor: str) -> bool:
    return origin is not None and (origin.module, origin.call, origin.tensor) == (module, call, tensor)


def frame_rows(report: Report) -> list[dict[str, Any]]:
    """The rows of :func:`to_dataframe` as plain dicts (no pandas needed)."""
    limits, trace = report.run.limits, report.trace
    fwd, bwd = report.forward_origin, report.backward_origin
    rows: list[dict[str, Any]] = []
    for c in trace.calls:
        base = {
            "section": "forward",
            "call_index": c.index,
            "end_order": c.end_order,
            "label": c.label,
            "module": c.module,
            "call": c.call,
            "class_name": c.class_name,
        }
        for kind, records in (("input", c.inputs), ("output", c.outputs)):
            for r in records:
                rows.append(
                    {
                        **base,
                        "kind": kind,
                        "tensor": r.path,
                        **_stats_columns(r.stats, limits),
                        "requires_grad": r.requires_grad,
                        "producer": r.producer,
                        "origin": kind == "output" and _is_origin(fwd, c.module, c.call, r.path),
                    }
                )
    marked = origin_event(trace, bwd)
    owners = {p.name: info for info in report.modules for p in info.params}
    for e in trace.grad_events:
        row: dict[str, Any] = {"section": "backward", "kind": f"grad_{e.kind}", "grad_order": e.order}
        if e.call is not None and 0 <= e.call < len(trace.calls):
            c = trace.calls[e.call]
            row.update(call_index=c.index, label=c.label, module=c.module, call=c.call, class_name=c.class_name)
        elif e.param is not None and e.param in owners:
            info = owners[e.param]
            row.update(module=info.name, class_name=info.class_name)
        tensor = f"grad:{e.param}" if e.kind == "param" else f"grad:{e.path}"
        row.update(
            tensor=tensor,
            param=e.param,
            **_stats_columns(e.stats, limits, trace.scale),
            via_base=e.via_base,
            origin=marked is not None and e.order == marked.order,
        )
        rows.append(row)
    for info in report.modules:
        for p in info.params:
            rows.append(
                {
                    "section": "parameters",
                    "kind": "param",
                    "module": info.name,
                    "class_name": info.class_name,
                    "tensor": p.name.rsplit(".", 1)[-1],
                    "param": p.name,
                    **_stats_columns(p.stats, limits),
                    "requires_grad": p.requires_grad,
                    "origin": False,
                }
            )
    return rows


def to_dataframe(report: Report) -> Any:
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
    return frame
