"""Command line: ``ampdoctor demo`` (and the checkpoint commands).

Exit codes: 0 healthy or warnings only, 1 a finding (overflow, nan, underflow), 2 usage or input error.
One parser function and one command function per subcommand; ``main(argv)`` returns the exit code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable, Optional

from ._version import __version__
from .cli_checkpoint import add_diagnose_parser, add_scan_parser
from .errors import AmpDoctorError

if TYPE_CHECKING:
    from .report import Report

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2
FORMATS = ("text", "json", "markdown", "html")


def add_output_options(parser: argparse.ArgumentParser, formats: Sequence[str] = FORMATS) -> None:
    parser.add_argument("--format", choices=list(formats), default="text", help="output format (default: text)")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the report to FILE instead of stdout")


def render(report: Report, fmt: str) -> str:
    if fmt == "json":
        return report.to_json(indent=2)
    if fmt == "markdown":
        from .render_text import render_markdown

        return render_markdown(report)
    if fmt == "html":
        from .render_html import render_html_page

        return render_html_page(report)
    return report.to_text()


def emit(text: str, output: Optional[str]) -> None:
    """Print, or write to a file atomically enough for a report (never next to a checkpoint unless asked)."""
    if output is None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return
    try:
        with open(output, "w", encoding="utf-8") as fh:
            fh.write(text if text.endswith("\n") else text + "\n")
    except OSError as exc:
        raise AmpDoctorError(f"cannot write {output}: {exc.strerror}") from exc


# -- demo --------------------------------------------------------------------------------------------------


def add_demo_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "demo",
        help="diagnose a built-in transformer that overflows in float16",
        description="Build a small transformer whose second attention overflows in float16, diagnose it on the "
        "CPU and print the report. Exits 0 when the diagnosis ran (the model is meant to overflow).",
    )
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16", help="autocast dtype")
    add_output_options(parser)
    parser.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    import torch

    from .api import diagnose
    from .demo import demo_loss, make_demo

    model, tokens, targets = make_demo()
    report = diagnose(
        model,
        tokens,
        loss_fn=lambda logits, _: demo_loss(logits, targets),
        dtype=getattr(torch, args.dtype),
        device_type="cpu",
    )
    emit(render(report, args.format), args.output)
    return EXIT_OK


# -- main --------------------------------------------------------------------------------------------------

_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [  # type: ignore[type-arg]
    add_demo_parser,
    add_scan_parser,
    add_diagnose_parser,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ampdoctor",
        description="Find out why PyTorch automatic mixed precision (AMP) training breaks, and what to change.",
        epilog="Exit status: 0 healthy (or warnings only), 1 findings, 2 usage or input error.",
    )
    parser.add_argument("--version", action="version", version=f"ampdoctor {__version__}")
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks on errors")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help / --version exit 0, usage errors exit 2
        return int(exc.code or 0)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        code: int = args.func(args)
        return code
    except AmpDoctorError as exc:
        if args.debug:
            raise
        print(f"ampdoctor: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("ampdoctor: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
