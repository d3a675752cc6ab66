"""Golden files: three saved reports rendered as text, markdown and HTML, compared byte by byte.

A renderer change shows up here as a diff to review. Regenerate with ``python scripts/make_golden.py`` (and
``--reports`` to re-run the diagnoses behind the saved reports), then read the diff before committing.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from ampdoctor import Report

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
NAMES = ("demo_overflow", "scale_overflow", "watch_harmless")


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("make_golden", ROOT / "scripts" / "make_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_golden"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", NAMES)
def test_renderings_match_the_golden_files(name: str) -> None:
    rendered = _script().render_all(name)
    assert set(rendered) == {"txt", "md", "html.golden"}
    for suffix, text in rendered.items():
        expected = (GOLDEN / f"{name}.{suffix}").read_text(encoding="utf-8")
        assert text == expected, f"{name}.{suffix} differs: run python scripts/make_golden.py and review the diff"


@pytest.mark.parametrize("name", NAMES)
def test_saved_reports_round_trip_and_hash(name: str) -> None:
    report = Report.from_json((GOLDEN / f"{name}.json").read_text(encoding="utf-8"))
    again = Report.from_json(report.to_json())
    assert again == report and hash(again) == hash(report)
    assert report.to_dict()["verdict"] == report.verdict and report.to_dict()["exit_code"] == report.exit_code


def test_golden_reports_cover_three_kinds() -> None:
    verdicts = {name: Report.from_json((GOLDEN / f"{name}.json").read_text()).verdict for name in NAMES}
    assert verdicts == {"demo_overflow": "overflow", "scale_overflow": "scale_overflow",
                        "watch_harmless": "scale_overflow"}
    assert Report.from_json((GOLDEN / "watch_harmless.json").read_text()).steps
