"""``Report.plot()``: each call's range against the representable band of the format (matplotlib, lazily).

Per call, in order of completion (forward) and of execution (backward): log2 of the largest finite magnitude and
of the smallest nonzero magnitude, over the band of the diagnosed format taken from ``report.run.limits``:
inf from the overflow threshold up, subnormal below the smallest normal, zero at or below the flush threshold.
Gradients are drawn as the scaled backward held them (recorded values times the loss scale), with the loss
scale marked. No pyplot: the figure is a plain ``matplotlib.figure.Figure`` (Agg, no global state), which
displays itself in Jupyter.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from .._optional import require
from ..analysis import Origin
from ..records import BATCH, LOSS, FormatLimits, TensorStats
from .numbers import fmt_num
from .rows import ReportRows

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from .data import ReportData

# Non-finite tensors are drawn this many bits above the overflow threshold (inside the inf band) ...
NONFINITE_MARK_BITS = 1.5
# ... all-zero tensors this many bits below the flush threshold (inside the zero band).
ZERO_MARK_BITS = 1.5
# The band is shown with at least this margin (bits) beyond its edges.
BAND_MARGIN_BITS = 3.0
# ... or this share of the band's span, whichever is more (bfloat16's band spans 262 bits).
BAND_MARGIN_SHARE = 0.06
# At most this many call names on the x axis; beyond it, every k-th (and the origin's).
MAX_TICK_LABELS = 40
# Markers on each point up to this many points; lines only beyond (readable at 500+ calls).
MAX_MARKED_POINTS = 150
# Tick labels keep their last characters (the leaf module name).
MAX_LABEL_CHARS = 28
DPI = 100
WIDTH_IN = 11.0
PANEL_HEIGHT_IN = 3.4

_COLORS = {
    "inf": "#dc2626",
    "subnormal": "#f59e0b",
    "zero": "#6b7280",
    "max": "#1d4ed8",
    "min": "#059669",
    "unscaled": "#9ca3af",
    "origin": "#b91c1c",
    "scale": "#7c3aed",
}


@dataclass
class Series:
    """What one panel shows: per position, a label, log2 magnitudes (NaN where unknown) and flags."""

    labels: list[str] = field(default_factory=list)
    hi: list[float] = field(default_factory=list)  # log2 of the largest finite magnitude
    lo: list[float] = field(default_factory=list)  # log2 of the smallest nonzero magnitude
    hi_unscaled: list[float] = field(default_factory=list)
    nonfinite: list[bool] = field(default_factory=list)
    low_dtype: list[bool] = field(default_factory=list)  # held in the diagnosed format
    origin: Optional[int] = None
    origin_text: str = ""

    def add(self, label: str, stats: Iterable[TensorStats], limits: FormatLimits, scale: float = 1.0) -> None:
        measured = [s for s in stats if s.measured]
        maxima = [(s.abs_max, s) for s in measured if s.abs_max is not None]
        top = max(maxima, key=lambda m: m[0], default=None)
        smallest = [s.min_abs_nonzero for s in measured if s.min_abs_nonzero]
        self.labels.append(label)
        self.hi.append(_log2(top[0] * scale, limits) if top else math.nan)
        self.hi_unscaled.append(_log2(top[0], limits) if top else math.nan)
        self.lo.append(_log2(min(smallest) * scale, limits) if smallest else math.nan)
        self.nonfinite.append(any(not s.is_finite for s in measured))
        dtype = top[1].dtype if top else (measured[0].dtype if measured else "")
        self.low_dtype.append(dtype == limits.dtype)


def _log2(value: float, limits: FormatLimits) -> float:
    """log2 of a magnitude; zero is drawn inside the zero band."""
    if value <= 0:
        return math.log2(limits.flush_threshold) - ZERO_MARK_BITS
    return math.log2(value)


def _short(label: str) -> str:
    return label if len(label) <= MAX_LABEL_CHARS else "…" + label[-(MAX_LABEL_CHARS - 1) :]


def _scale_text(scale: float) -> str:
    exponent = math.log2(scale) if scale > 0 else math.nan
    return f"2^{fmt_num(exponent)}" if math.isfinite(exponent) and exponent == int(exponent) else f"{fmt_num(scale)}"


def forward_series(report: ReportData) -> Series:
    """Per completed call (in completion order) its outputs; the batch first and the loss last when measured."""
    trace, limits = report.trace, report.run.limits
    series = Series()
    origin = report.forward_origin
    if any(r.stats.measured for r in trace.batch):
        series.add(BATCH, (r.stats for r in trace.batch), limits)
        if origin is not None and origin.module == BATCH:
            series.origin = 0
    rows = ReportRows.of(report)
    for c in rows.calls:
        if c.role == "unfinished":
            continue
        if c.role == "origin":
            series.origin = len(series.labels)
        series.add(c.label, (r.stats for r in c.outputs), limits)
    if trace.loss is not None and trace.loss.measured:
        if origin is not None and origin.module == LOSS:
            series.origin = len(series.labels)
        series.add(LOSS, [trace.loss], limits)
    if origin is not None:
        series.origin_text = _origin_text(origin)
    return series


def backward_series(report: ReportData) -> Series:
    """Per gradient event (in execution order) the gradient as held: recorded values times the loss scale."""
    limits = report.run.limits
    series = Series()
    for r in ReportRows.of(report).grads:
        kind = r.kind.removeprefix("grad_")
        label = f"{r.label} ∂{kind[:3]}" if r.call is not None else (f"∂{r.param}" if r.param else "?")
        if r.origin:
            series.origin = len(series.labels)
        series.add(label, [r.stats], limits, r.scale)
    if series.origin is not None and report.backward_origin is not None:
        series.origin_text = _origin_text(report.backward_origin)
    return series


def _origin_text(origin: Origin) -> str:
    text = f"origin: {origin.label}"
    if origin.op is not None:
        text += f"\n{origin.op.op}"
    return text


@functools.cache
def _figure_class() -> type[Figure]:
    from matplotlib.figure import Figure

    class ReportFigure(Figure):
        """A Figure that displays itself in Jupyter as a PNG, without pyplot's global state."""

        def _repr_png_(self) -> bytes:
            buffer = io.BytesIO()
            self.savefig(buffer, format="png", dpi=DPI)
            return buffer.getvalue()

    return ReportFigure


def _band(ax: Axes, limits: FormatLimits, bottom: float, top: float) -> None:
    inf_from = math.log2(limits.overflow_threshold)
    tiny = math.log2(limits.tiny)
    flush = math.log2(limits.flush_threshold)
    ax.axhspan(
        inf_from, top, color=_COLORS["inf"], alpha=0.14, lw=0,
        label=f"inf (|x| ≥ {fmt_num(limits.overflow_threshold)})", gid="ampdoctor-band-inf",
    )
    ax.axhspan(
        flush, tiny, color=_COLORS["subnormal"], alpha=0.16, lw=0,
        label=f"subnormal (|x| < 2^{fmt_num(tiny)}, precision lost)", gid="ampdoctor-band-subnormal",
    )
    ax.axhspan(
        bottom, flush, color=_COLORS["zero"], alpha=0.22, lw=0,
        label=f"becomes 0 (|x| ≤ 2^{fmt_num(flush)})", gid="ampdoctor-band-zero",
    )
    ax.set_ylim(bottom, top)


def _limits_y(series: Sequence[Series], limits: FormatLimits) -> tuple[float, float]:
    values = [v for s in series for v in (*s.hi, *s.lo, *s.hi_unscaled) if math.isfinite(v)]
    low, high = math.log2(limits.flush_threshold), math.log2(limits.overflow_threshold)
    margin = max(BAND_MARGIN_BITS, BAND_MARGIN_SHARE * (high - low))
    bottom, top = low - margin, high + margin
    if values:
        bottom, top = min(bottom, min(values) - 1), max(top, max(values) + 1)
    return bottom, top


def _ticks(ax: Axes, series: Series) -> None:
    n = len(series.labels)
    step = max(1, math.ceil(n / MAX_TICK_LABELS))
    positions = set(range(0, n, step))
    if series.origin is not None:
        positions = {p for p in positions if abs(p - series.origin) >= step / 2} | {series.origin}
    ticks = sorted(positions)
    ax.set_xticks(ticks)
    ax.set_xticklabels([_short(series.labels[i]) for i in ticks], rotation=90, fontsize=6.5)
    if series.origin is not None:
        ax.get_xticklabels()[ticks.index(series.origin)].set_color(_COLORS["origin"])
    ax.set_xlim(-0.5, max(n - 0.5, 0.5))


def _panel(ax: Axes, series: Series, limits: FormatLimits, y_range: tuple[float, float], what: str) -> None:
    bottom, top = y_range
    _band(ax, limits, bottom, top)
    x = list(range(len(series.labels)))
    marked = len(x) <= MAX_MARKED_POINTS
    ax.plot(x, series.hi, color=_COLORS["max"], lw=1.1, label=f"log2 |{what}| max", gid="ampdoctor-max")
    if any(math.isfinite(v) for v in series.lo):
        ax.plot(x, series.lo, color=_COLORS["min"], lw=1.1, label=f"log2 smallest nonzero |{what}|",
                gid="ampdoctor-min")
    elif x:
        ax.text(0.01, 0.03, "smallest nonzero magnitudes not measured (survey-level statistics)",
                transform=ax.transAxes, fontsize=7, color=_COLORS["zero"], gid="ampdoctor-min-missing")
    if marked:
        for low, fill in ((True, True), (False, False)):
            for values, color in ((series.hi, _COLORS["max"]), (series.lo, _COLORS["min"])):
                xs = [i for i in x if series.low_dtype[i] == low and math.isfinite(values[i])]
                ax.scatter(
                    xs, [values[i] for i in xs], s=14, zorder=3, linewidths=1,
                    facecolors=color if fill else "none", edgecolors=color,
                )
        ax.scatter([], [], s=14, facecolors="none", edgecolors="#444", label=f"hollow: wider than {limits.dtype}")
    bad = [i for i in x if series.nonfinite[i]]
    if bad:
        y_bad = math.log2(limits.overflow_threshold) + NONFINITE_MARK_BITS
        ax.scatter(bad, [y_bad] * len(bad), marker="X", s=30 if marked else 12, color=_COLORS["inf"], zorder=4,
                   label="holds inf/NaN", gid="ampdoctor-nonfinite")
    if series.origin is not None:
        ax.axvline(series.origin, color=_COLORS["origin"], lw=1.6, ls="--", label="origin", gid="ampdoctor-origin",
                   zorder=5)
        right = series.origin > 0.6 * len(x)
        ax.annotate(  # just below the inf band, clear of the inf/NaN markers
            series.origin_text, xy=(series.origin, math.log2(limits.overflow_threshold)),
            xytext=(-5 if right else 5, -4), textcoords="offset points", ha="right" if right else "left", va="top",
            fontsize=8, color=_COLORS["origin"], fontweight="bold", gid="ampdoctor-origin-label",
        )
    ax.set_ylabel("log2 |value|")
    ax.grid(axis="y", alpha=0.3)
    _ticks(ax, series)


def plot_report(report: ReportData, path: Optional[str] = None, *, dpi: int = DPI) -> Figure:
    """Forward (and backward) panels of each call's range against the format's band; the origin marked.

    Returns the figure (it displays itself in Jupyter); with ``path``, also saves it as a PNG there.
    Needs matplotlib: ``pip install 'ampdoctor[notebook]'``.
    """
    require("matplotlib", "report.plot()")
    limits, trace = report.run.limits, report.trace
    panels = [("forward: module outputs, in order of completion", forward_series(report), "x")]
    if trace.backward_ran and trace.grad_events:
        scale = trace.scale
        title = "backward: gradients as held, in execution order" + (
            f" (recorded × loss scale {_scale_text(scale)})" if scale != 1.0 else ""
        )
        panels.append((title, backward_series(report), "g"))
    y_range = _limits_y([p[1] for p in panels], limits)
    fig = _figure_class()(figsize=(WIDTH_IN, PANEL_HEIGHT_IN * len(panels) + 0.9), dpi=dpi, layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (title, series, what) in zip(axes, panels):
        _panel(ax, series, limits, y_range, what)
        ax.set_title(title, fontsize=9, loc="left")
    if len(panels) > 1:
        ax, series = axes[1], panels[1][1]
        if trace.scale != 1.0:
            x = list(range(len(series.labels)))
            ax.plot(x, series.hi_unscaled, color=_COLORS["unscaled"], lw=0.9, ls=":", label="log2 |g| max unscaled",
                    gid="ampdoctor-unscaled")
        used = report.run.scale
        label = f"loss scale {_scale_text(trace.scale)}" + (
            f" (this re-run; the run used {_scale_text(used)})" if used != trace.scale else ""
        )
        ax.axhline(math.log2(trace.scale), color=_COLORS["scale"], lw=1.2, ls="-.", label=label,
                   gid="ampdoctor-loss-scale")
    for ax in axes:
        ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False)
    origin = report.forward_origin or report.backward_origin
    head = f"ampdoctor: {report.verdict.upper()}" + (f", {origin.direction} origin {origin.label}" if origin else "")
    fig.suptitle(f"{head}  ·  {limits.dtype} on {report.run.device}  ·  {report.run.model_class}", fontsize=10)
    if path is not None:
        fig.savefig(path, format="png", dpi=dpi)
    return fig

