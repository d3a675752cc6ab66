"""Generate ``docs/plot.png``, the README's picture of ``report.plot()``, from ampdoctor's demo model.

Run from the repository root: ``python scripts/make_readme_plot.py`` (CPU, a few seconds; needs matplotlib:
``pip install -e '.[notebook]'``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import ampdoctor
from ampdoctor.demo import demo_loss, make_demo
from ampdoctor.report.plot import plot_report

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "plot.png"
# Screenshot-sized: the figure is 11 x 7.7 inches, so this gives about 990 x 693 pixels.
README_DPI = 90


def _shrink(path: Path) -> None:
    """A 256-colour palette keeps the PNG small for the repository; the plot has only a handful of colours."""
    from PIL import Image  # matplotlib depends on Pillow

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=256)
    small.save(path, optimize=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"PNG to write (default: {DEFAULT_OUT})")
    parser.add_argument("--dpi", type=int, default=README_DPI)
    args = parser.parse_args(argv)
    model, tokens, targets = make_demo()
    report = ampdoctor.diagnose(model, tokens, loss_fn=lambda out, _: demo_loss(out, targets))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot_report(report, str(args.out), dpi=args.dpi)
    _shrink(args.out)
    origin = report.forward_origin or report.backward_origin
    where = f" at {origin.label}" if origin is not None else ""
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB): {report.verdict}{where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
