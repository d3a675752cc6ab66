"""Regenerate the golden files of the renderers: three saved reports and their text, markdown and HTML.

    python scripts/make_golden.py            # renders the saved reports again (review the diff!)
    python scripts/make_golden.py --reports  # also re-runs the three diagnoses that produce the saved reports

The tests (``tests/test_golden.py``) render the saved ``*.json`` reports and compare with the ``*.txt``, ``*.md``
and ``*.html.golden`` files byte by byte. Saved reports carry their own torch version, so the golden files do not change
when torch does; re-running the diagnoses (``--reports``) is for when the report's content is meant to change.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "golden"
# The HTML golden file ends in .golden so that tools reading the tree as source do not take it for a page.
RENDERERS = {"txt": "to_text", "md": "to_markdown", "html.golden": "_repr_html_"}


def _demo() -> object:
    import ampdoctor
    from ampdoctor.demo import demo_loss, make_demo

    model, tokens, targets = make_demo()
    return ampdoctor.diagnose(model, tokens, loss_fn=lambda out, _: demo_loss(out, targets), device_type="cpu")


def _constant_linear(n_in: int, n_out: int, value: float) -> object:
    import torch
    from torch import nn

    layer = nn.Linear(n_in, n_out, bias=False)
    with torch.no_grad():
        layer.weight.fill_(value)
    return layer


def _scale_overflow() -> object:
    """A harmless loss-scale overflow: big's input gradient is 1280 * scale, finite up to scale 32."""
    import torch
    from torch import nn

    import ampdoctor

    model = nn.Sequential()
    model.add_module("pre", _constant_linear(64, 64, 1e-4))  # type: ignore[arg-type]
    model.add_module("big", _constant_linear(64, 64, 20.0))  # type: ignore[arg-type]
    return ampdoctor.diagnose(
        model, torch.full((4, 64), 1e-3), loss_fn=lambda out, _: out.float().sum(), device_type="cpu"
    )


def _watch() -> object:
    """A watched loop whose scale overflows now and then (harmless), with per-module statistics every step."""
    import torch
    from torch import nn

    import ampdoctor

    model = nn.Sequential(_constant_linear(16, 4, 1 / 16))  # type: ignore[arg-type]
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    x = torch.ones(1, 16)
    with ampdoctor.watch(model, scaler, loss_fn=lambda out, _: out.float().pow(2).sum(), stats_every=1,
                         save_bundle=False) as doctor:
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        for _ in range(7):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return doctor.report()


REPORTS = {"demo_overflow": _demo, "scale_overflow": _scale_overflow, "watch_harmless": _watch}


def render_all(name: str) -> dict[str, str]:
    """The golden renderings of a saved report (what the test compares)."""
    from ampdoctor import Report

    report = Report.from_json((GOLDEN / f"{name}.json").read_text(encoding="utf-8"))
    return {suffix: getattr(report, method)() for suffix, method in RENDERERS.items()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reports", action="store_true", help="re-run the diagnoses that produce the saved reports")
    args = parser.parse_args(argv)
    GOLDEN.mkdir(parents=True, exist_ok=True)
    for name, make in REPORTS.items():
        if args.reports or not (GOLDEN / f"{name}.json").exists():
            (GOLDEN / f"{name}.json").write_text(make().to_json(indent=1) + "\n", encoding="utf-8")  # type: ignore[attr-defined]
        for suffix, text in render_all(name).items():
            (GOLDEN / f"{name}.{suffix}").write_text(text, encoding="utf-8")
        print(f"wrote {GOLDEN / name}.{{json,txt,md,html.golden}}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
