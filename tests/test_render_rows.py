"""One row model for every renderer: text, markdown, HTML, the DataFrame and the plot agree on each tensor.

The case that used to split them: a finite float32 output above 65504. It has no float16 headroom to lose (it
is not held in float16), so it is neither "non-finite" nor "-4.30 bits" anywhere.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from markdown_it import MarkdownIt
from torch import nn

import ampdoctor
from ampdoctor.report.plot import forward_series
from ampdoctor.report.rows import ReportRows

BIG = 70000.0  # above float16's max (65504), far below float32's


class WideScale(nn.Module):
    """Returns float32 values around 70000: finite, and too large for float16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() * 0 + BIG


def wide_report() -> ampdoctor.Report:
    model = nn.Sequential(nn.Linear(4, 4), WideScale())
    with torch.no_grad():
        model[0].weight.fill_(0.1)
        model[0].bias.zero_()
    return ampdoctor.diagnose(model, torch.ones(2, 4), loss_fn=lambda out, _: out.mean() * 1e-9, device_type="cpu")


@pytest.fixture(scope="module")
def report() -> ampdoctor.Report:
    return wide_report()


def test_the_row_model_has_no_headroom_for_a_wider_tensor(report: ampdoctor.Report) -> None:
    rows = ReportRows.of(report)
    wide = next(c for c in rows.calls if c.label == "1")
    assert wide.worst is not None and wide.worst.stats.dtype == "float32" and wide.worst.stats.abs_max == BIG
    assert wide.headroom_bits is None and wide.level == "fine" and wide.role == ""
    linear = next(c for c in rows.calls if c.label == "0")
    assert linear.worst is not None and linear.worst.stats.dtype == "float16"
    assert linear.headroom_bits == pytest.approx(math.log2(65504 / linear.worst.stats.abs_max))


def test_every_renderer_agrees_on_the_wide_tensor(report: ampdoctor.Report) -> None:
    assert report.verdict == "healthy"
    text = str(report)
    row = next(line for line in text.splitlines() if line.startswith("1 ") and "WideScale" in line)
    assert row.split()[-1] == "-" and "non-finite" not in text
    md = report.to_markdown()
    assert "| 1 | WideScale | out | float32 | 70000 | - |" in md
    html = report._repr_html_()
    cells = re.search(r'<tr class="ad-fine"><td class="ad-num">\d+</td><td[^>]*><code>1</code>.*?</tr>', html)
    assert cells is not None, "the WideScale row is not coloured fine"
    assert "<td class=\"ad-num\">-</td>" in cells.group(0) and "-4.3" not in html
    frame = report.to_dataframe()
    out = frame[(frame["label"] == "1") & (frame["kind"] == "output")].iloc[0]
    assert math.isnan(out["headroom_bits"]) and bool(out["finite"]) and out["abs_max"] == BIG
    series = forward_series(report)
    position = series.labels.index("1")
    assert not series.nonfinite[position] and not series.low_dtype[position]


def test_markdown_is_real_markdown() -> None:
    from ampdoctor.demo import DEMO_ORIGIN, demo_loss, make_demo

    model, tokens, targets = make_demo()
    md = ampdoctor.diagnose(model, tokens, loss_fn=lambda o, _: demo_loss(o, targets), device_type="cpu").to_markdown()
    tokens_ = MarkdownIt("commonmark").enable("table").parse(md)
    kinds = [t.type for t in tokens_]
    headings = [tokens_[i + 1].content for i, t in enumerate(tokens_) if t.type == "heading_open"]
    assert headings[0] == f"ampdoctor: OVERFLOW - forward origin: {DEMO_ORIGIN}"
    assert f"Forward origin: {DEMO_ORIGIN} (DemoAttention)" in headings and "Recommendations" in headings
    assert "table_open" in kinds and "html_inline" not in kinds and "html_block" not in kinds
    fences = [t for t in tokens_ if t.type == "fence"]
    assert any("q @ k.transpose" in t.content for t in fences)  # the origin's source line, as code
    assert any("ampdoctor.fp32_fallback" in t.content and t.info == "python" for t in fences)
    html = MarkdownIt("commonmark").enable("table").render(md)
    assert "<td>&lt;root&gt;</td>" in html  # shown as text, not swallowed as an HTML tag
