"""The HTML report: well-formed, escaped, no JavaScript, colour-coded, readable for thousands of calls."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from html.parser import HTMLParser
from importlib import resources
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from notebook_reports import (
    DEMO_ORIGIN,
    EVIL,
    backward_report,
    evil_report,
    healthy_report,
    long_report,
    overflow_report,
)

from ampdoctor.records import Cost, Recommendation, StepRecord
from ampdoctor.report import Report
from ampdoctor.report import html as html_module
from ampdoctor.report.html import (
    COLLAPSE_MIN_RUN,
    FULL_TABLE_ROWS,
    render_html,
    render_html_page,
    stylesheet,
)
from ampdoctor.report.text import render_text

BADGE = r'<span class="ad-badge (ad-verified|ad-unverified)">'
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class TagChecker(HTMLParser):
    """Records every element; fails on a closing tag that does not match the open one."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1] if self.stack else 'nothing'}")
        else:
            self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def parse(markup: str) -> TagChecker:
    checker = TagChecker()
    checker.feed(markup)
    checker.close()
    assert checker.errors == []
    assert checker.stack == [], f"unclosed: {checker.stack}"
    return checker


def table_rows(markup: str) -> list[str]:
    return re.findall(r'<tr class="([^"]*)"', markup)


@pytest.mark.parametrize("make", [overflow_report, healthy_report, backward_report, evil_report])
def test_fragment_and_page_parse_with_balanced_tags(make) -> None:  # type: ignore[no-untyped-def]
    report = make()
    fragment = report._repr_html_()
    checker = parse(fragment)
    assert [t for t, _ in checker.tags].count("style") == 1
    assert ("pre", {"class": "ad-text-fallback"}) in checker.tags
    page = render_html_page(report)
    assert page.startswith("<!DOCTYPE html>")
    parse(page.split("\n", 1)[1])
    assert f"<title>ampdoctor: {report.verdict}" in page


@pytest.mark.parametrize("make", [overflow_report, healthy_report, backward_report, evil_report])
def test_no_javascript(make) -> None:  # type: ignore[no-untyped-def]
    checker = parse(make()._repr_html_())
    assert all(tag != "script" for tag, _ in checker.tags)
    handlers = [name for _, attrs in checker.tags for name in attrs if name.startswith("on")]
    assert handlers == []
    assert "javascript:" not in make()._repr_html_().lower()


def test_module_named_script_is_escaped() -> None:
    report = evil_report()
    assert report.forward_origin is not None and report.forward_origin.module == EVIL
    markup = render_html(report)
    assert "<script" not in markup
    assert "&lt;script&gt;&amp;" in markup
    checker = parse(markup)
    assert any(EVIL in text for text in checker.text)  # the name reads correctly once unescaped


def test_every_user_string_is_escaped() -> None:
    """Class names, the model class, recommendation titles, snippets and notes can all hold markup."""
    base = overflow_report()
    bad = '<img src=x onerror="alert(1)">'
    calls = [dataclasses.replace(c, class_name=bad) for c in base.trace.calls]
    run = dataclasses.replace(base.run, model_class=bad, notes=[bad], device=bad)
    rec = Recommendation(action="fp32_fallback", modules=[bad], title=bad, snippet=f"</pre>{bad}", evidence=bad)
    origin = dataclasses.replace(base.findings.forward_origin, class_name=bad)  # type: ignore[arg-type]
    findings = dataclasses.replace(base.findings, forward_origin=origin, warnings=[bad], propagation=[bad])
    report = dataclasses.replace(
        base, run=run, trace=dataclasses.replace(base.trace, calls=calls), findings=findings, recommendations=[rec]
    )
    for markup in (render_html(report), render_html_page(report)):
        assert "<img" not in markup
        assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in markup
        checker = parse(markup.removeprefix("<!DOCTYPE html>\n"))
        assert not any(name.startswith("on") for _, attrs in checker.tags for name in attrs)


def test_overflow_report_shows_banner_origin_card_and_recommendations() -> None:
    report = overflow_report()
    markup = render_html(report)
    assert 'class="ad-banner ad-v-overflow"' in markup
    assert f"forward origin: <code>{DEMO_ORIGIN}</code>" in markup
    card = markup[markup.index('<div class="ad-card">') :]
    card = card[: card.index("</div>")]
    assert "DemoAttention" in card
    assert "<code>aten::bmm</code>" in card
    assert "demo.py:32" in card and "scores = q @ k.transpose(-2, -1)" in card
    assert "182.8" in card  # the operands' magnitude: 182.8^2 * 16 > 65504
    assert "896 NaN of 2048 values" in card
    assert "max 65504" in card and "65520" in card
    assert "<h4>Recommendations</h4>" in markup
    assert "ampdoctor.fp32_fallback(model, [&#x27;blocks.1.attn&#x27;])" in markup
    badges = re.findall(BADGE, markup)
    assert badges == ["ad-verified" if r.verified else "ad-unverified" for r in report.recommendations]


def test_recommendations_show_verification_status_evidence_and_cost() -> None:
    base = overflow_report()
    first = dataclasses.replace(
        base.recommendations[0],
        verified=True,
        evidence="re-run: finite",
        cost=Cost(extra_activation_bytes=20480, fp32_matmul_flop_share=0.25, note="<est>"),
    )
    second = dataclasses.replace(first, verified=False, evidence="", cost=None)
    markup = render_html(dataclasses.replace(base, recommendations=[first, second]))
    assert re.findall(BADGE, markup) == ["ad-verified", "ad-unverified"]
    assert "evidence: re-run: finite" in markup
    assert "cost: +20.0 KiB of activations, 25.0% of Linear/Conv FLOPs in float32 (&lt;est&gt;)" in markup


def test_rows_are_colour_coded_and_the_origin_marked() -> None:
    report = overflow_report()
    forward = render_html(report).split("<details open><summary>Forward")[1].split("</details>")[0]
    classes = table_rows(forward)
    assert len(classes) == len(report.trace.calls)  # 24 rows: short tables show every call
    nonfinite = [c for c in classes if c.startswith("ad-nonfinite")]
    assert len(nonfinite) == 1 + len(report.findings.propagation)  # the origin and the 10 calls it reached
    assert classes.count("ad-nonfinite ad-origin") == 1
    assert "◀ origin" in forward
    assert {c.split()[0] for c in classes} <= {"ad-nonfinite", "ad-warn", "ad-tight", "ad-fine", "ad-none"}


def test_forward_and_backward_sections_fold_with_details() -> None:
    markup = render_html(overflow_report())
    assert "<details open><summary>Forward: 24 module calls" in markup
    assert re.search(r"<details><summary>Backward: \d+ gradient events", markup)  # closed: the forward is at fault
    backward = render_html(backward_report())
    assert re.search(r"<details open><summary>Backward: \d+ gradient events", backward)
    section = backward.split("<summary>Backward")[1]
    assert section.count("ad-origin") == 1 and "◀ origin" in section


def test_headroom_bands_follow_the_thresholds() -> None:
    markup = render_html(long_report(20, tight_every=5))  # |x|max 3e4: log2(65504 / 3e4) = 1.13 bits
    classes = table_rows(markup.split("<summary>Forward")[1].split("</table>")[0])
    assert classes.count("ad-tight") == 4 and classes.count("ad-fine") == 16


def test_thousands_of_calls_fold_into_summary_rows() -> None:
    report = long_report(3000, tight_every=1000)
    markup = render_html(report)
    parse(markup)
    forward = markup.split("<summary>Forward")[1].split("</details>")[0]
    rows = table_rows(forward)
    # Three tight calls stay visible; the healthy runs between them fold: 3 + 3 summary rows (the run after the
    # last tight call is empty).
    assert rows.count("ad-tight") == 3
    assert rows.count("ad-run ad-fine") == 3
    assert len(rows) == 6
    assert "⋯ 999 healthy calls, least headroom 15.0 bits: <code>layers.0</code> … <code>layers.998</code>" in forward
    backward = markup.split("<summary>Backward")[1]
    assert table_rows(backward) == ["ad-run ad-fine"]
    assert len(markup) < 50_000


def test_short_runs_and_short_tables_are_not_folded() -> None:
    rows = table_rows(render_html(long_report(FULL_TABLE_ROWS)).split("<summary>Forward")[1].split("</table>")[0])
    assert len(rows) == FULL_TABLE_ROWS  # not longer than the limit: every row shown
    # A long table with healthy runs shorter than COLLAPSE_MIN_RUN keeps them.
    # (40 tight calls: under MAX_SHOWN_ROWS, so none is left out either)
    report = long_report(FULL_TABLE_ROWS + COLLAPSE_MIN_RUN * 20, tight_every=COLLAPSE_MIN_RUN)
    rows = table_rows(render_html(report).split("<summary>Forward")[1].split("</table>")[0])
    assert "ad-run ad-fine" not in rows


def test_text_fallback_is_the_escaped_text_report() -> None:
    report = evil_report()
    checker = parse(render_html(report))
    assert render_text(report) in checker.text


def test_stylesheet_is_the_package_data_file_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    css = (Path(html_module.__file__).resolve().parents[1] / "static" / "report.css").read_text(encoding="utf-8")
    reads: list[str] = []

    def files(package: str) -> Any:
        reads.append(package)
        return resources.files(package)

    monkeypatch.setattr(html_module, "resources", SimpleNamespace(files=files))
    stylesheet.cache_clear()
    rendered = [render_html(healthy_report()), render_html(overflow_report()), render_html(healthy_report())]
    assert reads == ["ampdoctor"]  # three reports, one read of the package data
    assert stylesheet() == css
    for markup in rendered:
        # the stylesheet, whole and once, ahead of the report it styles
        assert markup.startswith(f"<style>{css}</style>") and markup.count("</style>") == 1
        # without it a viewer shows the text fallback; with it, the hidden wrapper shows and the fallback does not
        assert '<pre class="ad-text-fallback">' in markup and '<div class="ad-wrap" hidden>' in markup
    assert ".ampdoctor .ad-text-fallback { display: none; }" in css.splitlines()
    assert ".ampdoctor .ad-wrap[hidden] { display: block !important; }" in css.splitlines()


def test_report_from_json_renders_without_a_live_model() -> None:
    report = Report.from_json(overflow_report().to_json(absolute_paths=True))  # the paths as captured
    assert render_html(report) == render_html(overflow_report())


def test_training_steps_of_a_watch_report_fold_into_runs() -> None:
    steps = [StepRecord(step=i, scale=2.0**16, skipped=False, loss=2.0) for i in range(100)]
    steps += [StepRecord(step=100 + i, scale=2.0 ** (15 - i), skipped=True, loss=None) for i in range(10)]
    steps.append(
        StepRecord(step=110, scale=2.0**5, skipped=True, forward_finite=False, forward_origin=EVIL)
    )
    report = dataclasses.replace(healthy_report(), steps=steps)
    markup = render_html(report)
    parse(markup)
    section = markup.split("<summary>Training steps")[1].split("</details>")[0]
    assert section.startswith(": 111 (11 skipped; scale 65536 → 32)")
    assert "<details open><summary>Training steps" in markup
    assert table_rows(section) == ["ad-run ad-fine", "ad-run ad-nonfinite", "ad-nonfinite"]
    assert "⋯ 100 healthy steps: <code>step 0</code> … <code>step 99</code>" in section
    assert "⋯ 10 skipped steps: <code>step 100</code> … <code>step 109</code>" in section
    assert "<code>&lt;script&gt;&amp;</code>" in section


def test_rendering_a_saved_report_needs_no_torch(tmp_path: Path) -> None:
    """HTML, DataFrame and plot of a report.json on a machine without torch (ARCHITECTURE.md §1)."""
    saved = tmp_path / "report.json"
    saved.write_text(overflow_report().to_json())
    code = (
        "import sys\n"
        "from ampdoctor.report import Report\n"
        f"report = Report.from_json(open({str(saved)!r}).read())\n"
        "assert 'blocks.1.attn' in report._repr_html_()\n"
        "assert len(report.to_dataframe()) > 0\n"
        f"report.plot({str(tmp_path / 'p.png')!r})\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
