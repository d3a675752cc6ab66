"""Reports carrying hostile values: a crafted report JSON, module names with markup, entities, bidirectional
overrides or a non-UTF-8 source path, and names that look like numbers. Every renderer shows them as text, a
saved report is refused when a field has the wrong type, and a failed save leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor import Report
from ampdoctor.errors import AmpDoctorError

PAYLOAD = "<img src=x onerror=alert(1)>"


@pytest.fixture(scope="module")
def overflow() -> Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    with torch.no_grad():
        model[2].weight.mul_(3e4)
    return ampdoctor.diagnose(model, torch.randn(4, 8) * 100, dtype=torch.float16, progress=False)


def _crafted(report: Report, edit: Any) -> str:
    data = json.loads(report.to_json())
    edit(data)
    return json.dumps(data)


@pytest.mark.parametrize(
    "edit, says",
    [
        # an integer field holding markup (the origin's call, shown in the HTML's origin card)
        (lambda d: d["findings"]["forward_origin"].__setitem__("call", PAYLOAD), "expected an integer"),
        (lambda d: d["findings"]["forward_origin"].__setitem__("call", True), "expected an integer"),
        (lambda d: d["findings"]["forward_origin"].__setitem__("module", 7), "expected a string"),
        (lambda d: d["run"].__setitem__("scale", "1e400"), "expected a number"),
        (lambda d: d["findings"].__setitem__("forward_origin", [1, 2]), "expected an object"),
        (lambda d: d.__setitem__("recommendations", {"a": 1}), "expected a list"),
    ],
)
def test_a_report_json_with_a_value_of_the_wrong_type_is_refused(overflow: Report, edit: Any, says: str) -> None:
    with pytest.raises(AmpDoctorError, match=f"malformed ampdoctor report: {says}"):
        Report.from_json(_crafted(overflow, edit))


def test_a_mapping_field_holding_a_list_is_refused_with_the_library_error() -> None:
    """It raised AttributeError (``list.items``) from deep inside the loader."""
    torch.manual_seed(0)
    healthy = ampdoctor.diagnose(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), torch.randn(4, 8), progress=False)
    assert healthy.findings.window is not None
    for bad in ([1], "x"):
        crafted = _crafted(healthy, lambda d, bad=bad: d["findings"]["window"].__setitem__("module_min_useful", bad))
        with pytest.raises(AmpDoctorError, match="malformed ampdoctor report: expected an object"):
            Report.from_json(crafted)
    assert Report.from_json(healthy.to_json(absolute_paths=True)) == healthy  # what to_json writes loads exactly


def _named(name: str) -> nn.Module:
    torch.manual_seed(0)
    big = nn.Linear(8, 8)
    with torch.no_grad():
        big.weight.mul_(3e4)
    return nn.Sequential(OrderedDict([("first", nn.Linear(8, 8)), ("relu", nn.ReLU()), (name, big)]))


def test_entities_and_bidirectional_overrides_in_names_stay_visible_text() -> None:
    name = "&lt;b&gt;x&rlm;\u202eexe"
    report = ampdoctor.diagnose(_named(name), torch.randn(4, 8) * 100, dtype=torch.float16, progress=False)
    assert report.forward_origin is not None and report.forward_origin.module == name
    markdown = report.to_markdown()
    assert "\\&lt;b\\&gt;x\\&rlm;\\\\u202eexe" in markdown  # no entity a markdown viewer would decode
    html = report.to_html()
    assert "\u202e" not in html and "&amp;lt;b&amp;gt;x&amp;rlm;\\u202eexe" in html
    assert "\u202e" not in report.to_text() and "\\u202eexe" in report.to_text()


def test_html_of_a_non_utf8_source_path_encodes_and_a_failed_save_leaves_the_file_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / os.fsdecode(b"src-\xff")
    folder.mkdir()
    (folder / "odd_model.py").write_text(
        "import torch\nfrom torch import nn\n\n\nclass Odd(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.a = nn.Linear(8, 8)\n\n"
        "    def forward(self, x):\n        return self.a(x) * 1e5\n"
    )
    monkeypatch.syspath_prepend(os.fspath(folder))
    from odd_model import Odd  # type: ignore[import-not-found]

    torch.manual_seed(0)
    report = ampdoctor.diagnose(Odd(), torch.randn(4, 8), dtype=torch.float16, progress=False)
    sys.modules.pop("odd_model", None)
    origin = report.forward_origin
    assert origin is not None and origin.op is not None and origin.op.location is not None
    assert "\udcff" in origin.op.location.file  # the path as Python holds it
    html = report.to_html(absolute_paths=True)
    assert "src-\\xff" in html
    html.encode("utf-8")  # raised UnicodeEncodeError (a lone surrogate)
    target = tmp_path / "report.html"
    report.save(target, absolute_paths=True)
    assert "src-\\xff" in target.read_text(encoding="utf-8")

    # a save that fails midway leaves the file as it was, and no temporary file beside it
    target.write_text("before\n")
    monkeypatch.setattr(type(report), "to_html", lambda self, **kw: "caf\udcff")  # unencodable
    with pytest.raises(UnicodeEncodeError):
        report.save(target)
    assert target.read_text() == "before\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([folder.name, "report.html"])


def test_names_that_look_like_numbers_are_shown_as_given_in_text() -> None:
    """The text tables let tabulate re-read formatted cells: module ``007`` showed as ``7``, ``1e3`` as
    ``1000``, and a headroom of ``18.60`` as ``18.6`` (markdown kept both)."""
    torch.manual_seed(0)

    def linear(gain: float) -> nn.Linear:
        layer = nn.Linear(8, 8)
        with torch.no_grad():
            layer.weight.mul_(gain)
            layer.bias.mul_(gain)
        return layer

    model = nn.Sequential(OrderedDict([("007", linear(3000.0)), ("1e3", linear(1.0)), ("2", linear(1e-4))]))
    report = ampdoctor.diagnose(model, torch.randn(4, 8), dtype=torch.float16, progress=False)
    text, markdown = report.to_text(max_rows=2), report.to_markdown(max_rows=2)
    table = text.split("Layers by headroom")[1].split("\n\n")[0]
    rows = {line.split()[0]: line.split() for line in table.splitlines()[3:] if "left out" not in line}
    assert "007" in rows and "1e3" in rows and "7" not in rows and "1000" not in rows
    for name, cells in rows.items():
        assert f"| {name} |" in markdown and f"| {cells[-1]} |" in markdown  # the same headroom text in both
