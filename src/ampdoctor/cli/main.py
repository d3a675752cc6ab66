"""Command line: ``ampdoctor demo | scan | diagnose``; ``main(argv)`` returns the exit code.

Exit codes: 0 healthy or warnings only, 1 a finding (overflow, nan, underflow), 2 usage or input error.
One parser function and one command function per subcommand; ``main(argv)`` returns the exit code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Callable, Optional

from .._version import __version__
from ..errors import AmpDoctorError
from .common import EXIT_USAGE
from .demo import add_demo_parser
from .diagnose import add_diagnose_parser
from .scan import add_scan_parser

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
