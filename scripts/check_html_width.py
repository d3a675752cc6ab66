"""Check in a real headless browser that the HTML report reads at 800 px: the page never scrolls sideways, wide
tables scroll inside their own box, long source lines wrap.

    python scripts/check_html_width.py [--width 800] [--browser chromium] [--keep report.html]

Diagnoses a small model written for the purpose (module names of 60+ characters make the tables wide; the line
that overflows is 190 characters long), writes the page with a measuring script appended (the report itself has
no JavaScript), loads it in ``chromium --headless`` at the given width with every ``<details>`` opened, and
prints what it measured. Exit status 0 when every check holds, 1 otherwise, 2 without a browser (Debian:
``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

import ampdoctor

MEASURE = """<script>
document.querySelectorAll('details').forEach(d => { d.open = true; });
const m = {viewport: window.innerWidth, page: document.documentElement.scrollWidth, tables: [], pres: []};
document.querySelectorAll('.ad-wrap table.ad-calls').forEach(t => {
  const b = t.getBoundingClientRect();
  m.tables.push({scroll: t.scrollWidth, client: t.clientWidth, right: Math.round(b.right)});
});
document.querySelectorAll('.ad-wrap pre').forEach(p => {
  const b = p.getBoundingClientRect();
  m.pres.push({scroll: p.scrollWidth, client: p.clientWidth, right: Math.round(b.right),
               height: Math.round(b.height), chars: p.textContent.length});
});
document.body.setAttribute('data-measure', JSON.stringify(m));
</script>"""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.projection_with_a_rather_long_descriptive_name = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection_with_a_rather_long_descriptive_name(x) * self.projection_with_a_rather_long_descriptive_name(x) + torch.zeros_like(x) * 0.0  # noqa: E501  (long on purpose: the report must wrap it)


def make_report() -> ampdoctor.Report:
    torch.manual_seed(0)
    model = nn.Sequential()
    for i in range(3):
        model.add_module(f"encoder_layer_with_a_long_descriptive_name_for_the_width_test_{i}", Block())
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(4.0)
    return ampdoctor.diagnose(model, torch.full((2, 16), 4.0), progress=False)


def measure(page: str, width: int, browser: str) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "report.html"
        path.write_text(page.replace("</body>", MEASURE + "</body>"), encoding="utf-8")
        done = subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--window-size={width},2000",
             "--virtual-time-budget=2000", "--dump-dom", path.as_uri()],
            capture_output=True, text=True, timeout=120,
        )
    found = re.search(r'data-measure="([^"]*)"', done.stdout)
    if not found:
        raise SystemExit(f"no measurement in the browser's output (exit {done.returncode}): {done.stderr[-500:]}")
    return json.loads(html.unescape(found.group(1)))  # type: ignore[no-any-return]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=800)
    parser.add_argument("--browser", default=shutil.which("chromium") or shutil.which("chromium-browser") or "")
    parser.add_argument("--keep", help="also write the report page here")
    args = parser.parse_args()
    if not args.browser:
        print("no headless browser found (Debian: apt-get install chromium)", file=sys.stderr)
        return 2
    report = make_report()
    page = report.to_html()
    if args.keep:
        Path(args.keep).write_text(page, encoding="utf-8")
    m = measure(page, args.width, args.browser)
    viewport = int(m["viewport"])  # type: ignore[call-overload]
    tables, pres = m["tables"], m["pres"]
    checks = {
        f"page fits the {viewport} px viewport (scrollWidth {m['page']})": int(m["page"]) <= viewport,  # type: ignore[call-overload]
        "every table stays inside the viewport": all(t["right"] <= viewport for t in tables),  # type: ignore[union-attr, index]
        "a wide table scrolls inside its box": any(t["scroll"] > t["client"] for t in tables),  # type: ignore[union-attr, index]
        "every <pre> wraps (no sideways scroll)": all(p["scroll"] <= p["client"] for p in pres),  # type: ignore[union-attr, index]
        "every <pre> stays inside the viewport": all(p["right"] <= viewport for p in pres),  # type: ignore[union-attr, index]
        "the 190-character source line wraps onto several lines": any(
            p["chars"] > 150 and p["height"] > 40 for p in pres  # type: ignore[index]
        ),
    }
    print(json.dumps(m))
    for text, ok in checks.items():
        print(("ok    " if ok else "FAIL  ") + text)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
