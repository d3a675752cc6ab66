"""Reports of bounded size (issue 22): HTML and text show the k most relevant rows and say how many they left out;
the JSON keeps every row."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.report.html_tables import MAX_SHOWN_ROWS
from ampdoctor.report.markdown import md_escape

TIGHT = 80  # modules whose output has under 4 bits of float16 headroom: more than MAX_SHOWN_ROWS (50)


class Tight(nn.Module):
    """Returns ``value`` everywhere, in its input's dtype (float16 under autocast): 5000 + 100 i has 2.3 to 3.7
    bits of headroom below 65504, the "tight" band."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0 + self.value


@pytest.fixture(scope="module")
def report() -> ampdoctor.Report:
    model = nn.Sequential(nn.Linear(4, 4), *(Tight(5000.0 + 100 * i) for i in range(TIGHT)))
    return ampdoctor.diagnose(model, torch.ones(2, 4), loss_fn=lambda out, _: out.float().mean() * 1e-9,
                              device_type="cpu")


def test_html_shows_the_most_relevant_rows_and_counts_the_rest(report: ampdoctor.Report) -> None:
    assert MAX_SHOWN_ROWS == 50
    html = report._repr_html_()
    forward = html[html.index("Forward: "):html.index("</table>", html.index("Forward: "))]
    # 82 calls: Linear "0", Tight "1".."80", the root. 81 are tight (the root returns Tight "80"'s output); the
    # 50 with the least headroom are the root and Tight "32".."80"; Tight "1".."31" (31) are left out, and fold
    # with the healthy Linear before them into one summary row.
    shown = re.findall(r'<tr class="ad-tight[^"]*"><td class="ad-num">\d+</td><td[^>]*><code>([^<]*)</code>', forward)
    assert shown == [str(i) for i in range(32, 81)] + ["&lt;root&gt;"]
    runs = re.findall(r'<tr class="ad-run[^"]*"><td colspan="\d+">([^<]*)<code>', forward)
    assert runs == ["⋯ 32 calls not shown (31 left out, 1 healthy): "]
    line = "… 31 more rows left out (the 50 most relevant are shown); the JSON report (report.to_json()) has every row"
    assert html.count(line) == 1


def test_text_and_markdown_say_how_many_rows_they_left_out(report: ampdoctor.Report) -> None:
    line = "… 62 more rows left out (the 20 most relevant are shown); the JSON report (report.to_json()) has every row"
    text = report.to_text()  # "Layers by headroom": 82 measured outputs, 20 shown
    assert text.count(line) == 1
    assert report.to_markdown().count(md_escape(line)) == 1
    assert report.to_text(max_rows=100).count("more rows left out") == 0


def test_json_keeps_every_row(report: ampdoctor.Report) -> None:
    again = ampdoctor.Report.from_json(report.to_json())
    assert len(again.trace.calls) == TIGHT + 2
    assert sorted(c.outputs[0].stats.max for c in again.trace.calls if c.class_name == "Tight")[:2] == [5000.0, 5100.0]


class Hide(nn.Module):
    """Overflows in float16 and clamps it away: a hidden overflow each."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * 1e5).clamp(-1, 1)


def test_the_hidden_overflow_table_says_how_many_rows_it_left_out() -> None:
    """It showed 20 of 25 with no word of the other 5 (every other bounded table says so)."""
    torch.manual_seed(0)
    report = ampdoctor.diagnose(nn.Sequential(*(Hide() for _ in range(25))), torch.randn(4, 8), verify=False)
    assert len(report.findings.hidden) == 25
    said = "… 5 more rows left out (the 20 first in op order are shown)"  # the table is not ranked
    assert said in report.to_text().split("Hidden overflows")[1]
    assert md_escape(said) in report.to_markdown().split("Hidden overflows")[1]
    assert said in report.to_html().split("Hidden overflows")[1]
    assert "… 15 more rows left out (the 10 first in op order" in report.to_text(max_rows=10)


@pytest.mark.parametrize("max_rows", [0, -1, 2.5, True, "5"])
def test_max_rows_must_be_a_whole_number_of_rows(report: ampdoctor.Report, max_rows: object) -> None:
    """-1 dropped the last row and said "the 5 most relevant are shown"; 2.5 raised a bare TypeError."""
    with pytest.raises(ampdoctor.AmpDoctorError, match=f"max_rows={max_rows!r}: give a whole number"):
        report.to_text(max_rows=max_rows)  # type: ignore[arg-type]
    with pytest.raises(ampdoctor.AmpDoctorError, match="max_rows"):
        report.to_markdown(max_rows=max_rows)  # type: ignore[arg-type]
