"""Reports in notebooks and files (issue 21, item 4): ``Report.to_html()`` and ``Report.save(path)`` by suffix,
source paths relative unless asked, an HTML page that reads at 800 px (the CSS rules; the browser check is
``scripts/check_html_width.py``), one number format, the replay's scale stated truthfully, bundles in
``ampdoctor-bundles/``.

The model (``usermodel.py``, written into the test's folder) squares a Linear's output: Linear(16, 16) with
weights 1 on inputs 100 gives 1600 per unit, and 1600 * 1600 = 2.56e6 > 65504 overflows in float16, on the line
``return h * h`` of the model's own file.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from test_watch import overflow_model, small_loss, train

import ampdoctor
from ampdoctor import Report
from ampdoctor.errors import InvalidInput
from ampdoctor.report.html import stylesheet
from ampdoctor.report.numbers import fmt_num
from ampdoctor.report.paths import shown_path
from ampdoctor.training.replay import replay_bundle

ROOT = Path(__file__).resolve().parents[1]

USER_MODEL = '''
import torch
from torch import nn


class Squares(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16, bias=False)
        nn.init.ones_(self.fc.weight)

    def forward(self, x):
        h = self.fc(x)
        return h * h
'''

# "%g" with its six significant digits ("1.09951e+12"): the format no rendering may use any more.
SIX_DIGITS = re.compile(r"\d\.\d{5}e[+-]\d\d")


@pytest.fixture()
def report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Report:
    (tmp_path / "usermodel.py").write_text(USER_MODEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import usermodel

    try:
        model = usermodel.Squares()
        return ampdoctor.diagnose(model, torch.full((2, 16), 100.0), scale=2.0**40, progress=False)
    finally:
        sys.modules.pop("usermodel", None)


def test_save_by_suffix_and_to_html(report: Report, tmp_path: Path) -> None:
    assert report.forward_origin is not None and report.forward_origin.op is not None
    page = report.to_html()
    assert page.startswith("<!DOCTYPE html>") and report.to_html(fragment=True) == report._repr_html_()
    written = {suffix: report.save(tmp_path / f"r{suffix}") for suffix in (".html", ".md", ".json", ".txt")}
    assert written[".html"].read_text() == page  # a page ends with its own newline
    assert written[".md"].read_text().rstrip("\n") == report.to_markdown().rstrip("\n")
    assert written[".txt"].read_text() == report.to_text() + "\n"  # every file ends with one newline
    assert Report.from_json(written[".json"].read_text()).verdict == "overflow"
    for bad in ("r.pdf", "r", "r.htmlx"):
        with pytest.raises(InvalidInput, match="name the file .html, .md, .json or .txt"):
            report.save(tmp_path / bad)
        assert not (tmp_path / bad).exists()


def test_source_paths_are_relative_unless_asked(report: Report, tmp_path: Path) -> None:
    op = report.forward_origin.op  # type: ignore[union-attr]
    assert op is not None and op.location is not None
    assert op.location.file == str(tmp_path / "usermodel.py") and op.location.code == "return h * h"
    for text in (report.to_json(), report.to_html(), report.to_html(fragment=True)):
        assert str(tmp_path) not in text
    assert '"file": "usermodel.py"' in report.to_json()
    assert "<code>usermodel.py:14</code>" in report.to_html()
    assert str(tmp_path / "usermodel.py") in report.to_json(absolute_paths=True)
    assert str(tmp_path / "usermodel.py") in report.to_html(absolute_paths=True)
    assert str(tmp_path / "usermodel.py") in report.save(tmp_path / "abs.json", absolute_paths=True).read_text()
    # the round trips the README states: exact with absolute paths; else the same report with its paths as shown
    from ampdoctor.report.paths import with_shown_paths

    assert Report.from_json(report.to_json(absolute_paths=True)) == report
    assert Report.from_json(report.to_json()) == with_shown_paths(report) != report
    # library code: from its package root; elsewhere outside the working directory: as it was
    lib = "/opt/py/lib/python3.11/site-packages/transformers/models/gpt2/modeling_gpt2.py"
    assert shown_path(lib, cwd="/home/me/run") == "transformers/models/gpt2/modeling_gpt2.py"
    assert shown_path("/home/me/run/models/net.py", cwd="/home/me/run") == "models/net.py"
    assert shown_path("/srv/other/net.py", cwd="/home/me/run") == "/srv/other/net.py"
    assert shown_path("/home/me/running/net.py", cwd="/home/me/run") == "/home/me/running/net.py"


def test_one_number_format_in_every_rendering(report: Report) -> None:
    assert report.run.scale == 2.0**40 and fmt_num(2.0**40) == "1.100e+12"
    for text in (report.to_text(), report.to_markdown(), report.to_html()):
        assert "1.100e+12" in text
        assert not SIX_DIGITS.search(text), SIX_DIGITS.search(text)


def test_html_reads_at_800_px_css_rules() -> None:
    """The rules that keep an 800 px page from scrolling sideways (a headless browser checks the layout itself:
    scripts/check_html_width.py)."""
    css = re.sub(r"/\*.*?\*/", "", stylesheet(), flags=re.S)
    rules = re.findall(r"([^{}]+)\{([^{}]*)\}", css)

    def declarations(selector: str) -> dict[str, str]:
        """Every declaration for ``selector``, later rules winning (as in the cascade)."""
        found: dict[str, str] = {}
        for selectors, body in rules:
            if selector in [part.strip() for part in selectors.split(",")]:
                found.update((k.strip(), v.strip()) for k, v in (d.split(":", 1) for d in body.split(";") if ":" in d))
        return found

    table = declarations(".ampdoctor table.ad-calls")
    assert table["display"] == "block" and table["overflow-x"] == "auto" and table["max-width"] == "100%"
    pre = declarations(".ampdoctor pre")
    assert pre["white-space"] == "pre-wrap" and pre["overflow-wrap"] == "anywhere"
    assert declarations(".ampdoctor code")["overflow-wrap"] == "anywhere"
    assert "minmax(0, 1fr)" in declarations(".ampdoctor .ad-card dl")["grid-template-columns"]


def test_bundles_go_to_their_folder_and_the_replay_says_where_its_scale_came_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    model = overflow_model()
    scaler = torch.amp.GradScaler("cpu")
    good, bad = torch.full((2, 16), 0.5), torch.ones(2, 16)
    with ampdoctor.watch(model, scaler, loss_fn=small_loss) as doctor:
        train(model, scaler, [good, good, good, bad, bad, bad], doctor)
    assert doctor.bundle_path == tmp_path / "ampdoctor-bundles" / "ampdoctor-bundle-step3.pt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ampdoctor-bundles"]
    replayed = replay_bundle(doctor.bundle_path, overflow_model)
    assert replayed.run.scale == 65536.0
    assert replayed.run.scale_source == "the failing step's GradScaler scale, from the bundle"
    for text in (replayed.to_text(), replayed.to_json(), replayed.to_html()):
        assert "scale= argument" not in text
    # The README and the project's .gitignore name the folder.
    assert "ampdoctor-bundles/" in (ROOT / ".gitignore").read_text().splitlines()
    assert "`ampdoctor-bundles/`" in (ROOT / "README.md").read_text()


def test_replay_scale_source_when_raised_or_missing() -> None:
    from ampdoctor.training.replay import MIN_REPLAY_SCALE, _scale_source

    low = MIN_REPLAY_SCALE / 2
    assert _scale_source({"scale": low}, low) == (
        "the failing step's GradScaler scale, from the bundle, raised to 5.960e-08"  # 2**-24
    )
    assert _scale_source({}, 1.0) == "none in the bundle: 1"
