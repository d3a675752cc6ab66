"""report.plot(): each call's range against the format's band, the origin marked, a PNG saved."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from notebook_reports import DEMO_ORIGIN, backward_report, healthy_report, long_report, overflow_report

from ampdoctor import AmpDoctorError
from ampdoctor.records import FormatLimits
from ampdoctor.report import Report
from ampdoctor.report.plot import MAX_TICK_LABELS, plot_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def by_gid(ax: Axes, gid: str) -> list:  # type: ignore[type-arg]
    return [a for a in ax.get_children() if a.get_gid() == gid]


def band_edges(ax: Axes, gid: str) -> tuple[float, float]:
    (patch,) = by_gid(ax, gid)
    ys = [y for _, y in patch.get_path().transformed(patch.get_patch_transform()).vertices]
    return min(ys), max(ys)


def check_band(ax: Axes, limits: FormatLimits) -> None:
    """inf from the overflow threshold up; subnormal from the flush threshold to tiny; zero below the flush one."""
    bottom, top = ax.get_ylim()
    assert band_edges(ax, "ampdoctor-band-inf") == pytest.approx((math.log2(limits.overflow_threshold), top))
    assert band_edges(ax, "ampdoctor-band-subnormal") == pytest.approx(
        (math.log2(limits.flush_threshold), math.log2(limits.tiny))
    )
    assert band_edges(ax, "ampdoctor-band-zero") == pytest.approx((bottom, math.log2(limits.flush_threshold)))


def tick_labels(ax: Axes) -> list[str]:
    return [t.get_text() for t in ax.get_xticklabels()]


def test_overflow_plot_has_band_origin_and_loss_scale(tmp_path: Path) -> None:
    report = overflow_report()
    path = tmp_path / "ranges.png"
    fig = report.plot(str(path))
    assert isinstance(fig, Figure)
    assert path.read_bytes().startswith(PNG_MAGIC)
    forward, backward = fig.axes
    limits = report.run.limits
    assert limits.overflow_threshold == 65520 and limits.flush_threshold == 2.0**-25
    for ax in (forward, backward):
        check_band(ax, limits)
    (origin,) = by_gid(forward, "ampdoctor-origin")
    x = origin.get_xdata()[0]
    assert tick_labels(forward)[list(forward.get_xticks()).index(x)] == DEMO_ORIGIN
    assert "blocks.1.attn" in by_gid(forward, "ampdoctor-origin-label")[0].get_text()
    # One point per completed call plus the loss; the origin's output holds NaN: an X in the inf band.
    (line,) = by_gid(forward, "ampdoctor-max")
    assert len(line.get_xdata()) == len(report.trace.calls) + 1
    (marks,) = by_gid(forward, "ampdoctor-nonfinite")
    assert x in marks.get_offsets()[:, 0]
    assert all(y > math.log2(limits.overflow_threshold) for y in marks.get_offsets()[:, 1])
    (scale,) = by_gid(backward, "ampdoctor-loss-scale")
    assert scale.get_ydata()[0] == math.log2(report.trace.scale) == 16
    assert by_gid(backward, "ampdoctor-origin") == []  # the forward is at fault, nothing to mark backward
    (held,) = by_gid(backward, "ampdoctor-max")
    (unscaled,) = by_gid(backward, "ampdoctor-unscaled")
    finite = [(h, u) for h, u in zip(held.get_ydata(), unscaled.get_ydata()) if math.isfinite(h) and u > -25]
    assert finite and all(h - u == pytest.approx(16) for h, u in finite)  # held = recorded x 2**16


def test_backward_origin_is_marked_on_the_gradient_panel() -> None:
    report = backward_report()
    fig = plot_report(report)
    forward, backward = fig.axes
    assert by_gid(forward, "ampdoctor-origin") == []
    (origin,) = by_gid(backward, "ampdoctor-origin")
    x = origin.get_xdata()[0]
    # call 1's input gradient is recorded on call 0's output (the same tensor), so that point is marked
    assert tick_labels(backward)[list(backward.get_xticks()).index(x)] == "0 ∂out"


def test_survey_level_report_plots_what_exists() -> None:
    report = healthy_report()
    fig = report.plot()
    forward = fig.axes[0]
    assert by_gid(forward, "ampdoctor-min") == []  # no smallest-nonzero magnitudes at survey level
    assert by_gid(forward, "ampdoctor-min-missing")
    assert by_gid(forward, "ampdoctor-max")
    assert by_gid(forward, "ampdoctor-origin") == []


def test_bfloat16_band_comes_from_its_limits() -> None:
    report = healthy_report(torch.bfloat16)
    limits = report.run.limits
    assert limits.dtype == "bfloat16" and limits.tiny == 2.0**-126
    fig = plot_report(report)
    for ax in fig.axes:
        check_band(ax, limits)
    assert by_gid(fig.axes[1], "ampdoctor-loss-scale")[0].get_ydata()[0] == 0  # bfloat16: unscaled


def test_readable_with_hundreds_of_layers(tmp_path: Path) -> None:
    report = long_report(600, tight_every=150)
    fig = plot_report(report, str(tmp_path / "long.png"))
    for ax in fig.axes:
        assert 0 < len(ax.get_xticks()) <= MAX_TICK_LABELS + 1
        assert all(len(label) <= 28 for label in tick_labels(ax))
        # Lines only: no per-point markers (scatter collections without a gid) at this size.
        assert not any(c.get_gid() is None and type(c).__name__ == "PathCollection" for c in ax.collections)
    assert (tmp_path / "long.png").stat().st_size > 0


def test_figure_shows_itself_in_jupyter_without_pyplot() -> None:
    fig = plot_report(overflow_report())
    assert fig._repr_png_().startswith(PNG_MAGIC)  # type: ignore[attr-defined]
    assert fig.canvas.manager is None  # not a pyplot figure: no GUI backend, nothing kept alive globally


def test_report_from_json_plots() -> None:
    report = Report.from_json(overflow_report().to_json())
    assert len(plot_report(report).axes) == 2


def test_missing_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(AmpDoctorError, match=r"pip install 'ampdoctor\[notebook\]'"):
        overflow_report().plot()
