"""Command line: ``ampdoctor demo | scan | diagnose``; ``main(argv)`` returns the exit code.

Exit codes: 0 healthy or warnings only, 1 a finding (overflow, nan, underflow), 2 no verdict (usage or input
error, or an internal error, which says so) with one line on stderr, 130 Ctrl-C. ``--debug`` adds the
traceback and keeps the exit code. One parser function and one command function per subcommand.
"""

from __future__ import annotations

import argparse
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import Callable, NoReturn, Optional

from .._version import __version__
from ..errors import AmpDoctorError
from .common import EXIT_INTERRUPTED, EXIT_USAGE, interrupt_tracking, one_line
from .demo import add_demo_parser
from .diagnose import add_diagnose_parser
from .scan import add_scan_parser

_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [  # type: ignore[type-arg]
    add_demo_parser,
    add_scan_parser,
    add_diagnose_parser,
]


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are two lines: a short usage and the error."""

    def short_usage(self) -> str:
        positionals = [a.metavar or a.dest for a in self._actions if not a.option_strings and a.help != "==SUPPRESS=="]
        names = " ".join(str(p) for p in positionals)
        return f"usage: {self.prog} [options] {names}  (see {self.prog} --help)".replace("  ", " ", 1)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.short_usage()}\n{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ampdoctor",
        description="Find out why PyTorch automatic mixed precision (AMP) training breaks, and what to change.",
        epilog="Exit status: 0 healthy (or warnings only), 1 findings, 2 usage or input error (one line; --debug "
        "adds the traceback), 130 interrupted. Output files are written atomically and never over an input.",
    )
    parser.add_argument("--version", action="version", version=f"ampdoctor {__version__}")
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks on errors (same exit status)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(subparsers)
    return parser


def _error(args: argparse.Namespace, exc: BaseException, line: str, code: int) -> int:
    if getattr(args, "debug", False):
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    print(f"ampdoctor: {line}", file=sys.stderr)
    return code


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help / --version exit 0, usage errors exit 2
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if not getattr(args, "func", None):
        print("usage: ampdoctor [--version] [--debug] COMMAND ...  (see ampdoctor --help)", file=sys.stderr)
        print("ampdoctor: error: choose a command: demo, scan or diagnose", file=sys.stderr)
        return EXIT_USAGE
    with interrupt_tracking():
        try:
            code: int = args.func(args)
            return code
        except AmpDoctorError as exc:
            return _error(args, exc, f"error: {one_line(exc)}", EXIT_USAGE)
        except KeyboardInterrupt as exc:
            return _error(args, exc, "interrupted; nothing was written", EXIT_INTERRUPTED)
        except SystemExit as exc:  # code outside the guarded user calls (a library) that exits
            return _error(args, exc, f"error: something called sys.exit({exc.code!r}) while ampdoctor ran", EXIT_USAGE)
        except MemoryError as exc:
            return _error(args, exc, "error: out of memory (a smaller --input-shape or batch may fit)", EXIT_USAGE)
        except Exception as exc:  # a bug, or an input nothing above knows: still one line, never a traceback
            line = f"internal error: {type(exc).__name__}: {one_line(exc)} (rerun with --debug and report it)"
            return _error(args, exc, line, EXIT_USAGE)


def run() -> NoReturn:
    """The ``ampdoctor`` program: :func:`main`, then exit with its status. Once main has returned, its output is
    written and its status known; a Ctrl-C during the interpreter's teardown (about a second of torch's) would
    turn a finished run into a death by signal, or a traceback with status 0, so it is ignored from then on."""
    code = main()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":
    run()
