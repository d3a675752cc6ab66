"""What every subcommand shares: output options, rendering and writing, loading options, progress, warnings
turned into notes, and the guard around the user's own code (factories, imports) that exits or is interrupted.

Exit codes: 0 healthy or warnings only, 1 a finding (overflow, nan, underflow), 2 usage or input error, 130 Ctrl-C.
Nothing here imports torch: arguments are checked before the heavy imports.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, redirect_stdout
from typing import TYPE_CHECKING, Any, Optional

from ..capture.progress import Progress, progress_on_stderr
from ..errors import InvalidInput, ModelRaised, Stage
from .fileio import PathLike, write_output

if TYPE_CHECKING:
    from ..report import Report

EXIT_OK, EXIT_USAGE, EXIT_INTERRUPTED = 0, 2, 130
FORMATS = ("text", "json", "markdown", "html")


def add_output_options(parser: argparse.ArgumentParser, formats: Sequence[str] = FORMATS) -> None:
    parser.add_argument("--format", choices=list(formats), default="text", help="output format (default: text)")
    parser.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="write the report to FILE (atomically; never over an input) instead of stdout ('-' is stdout)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr (errors still print)")


def render(report: Report, fmt: str) -> str:
    if fmt == "json":
        return report.to_json(indent=2)
    if fmt == "markdown":
        return report.to_markdown()
    if fmt == "html":
        return report.to_html()
    return report.to_text()


def emit(text: str, output: Optional[str], inputs: Sequence[PathLike] = ()) -> None:
    """Print, or write the file atomically (never over one of ``inputs``)."""
    write_output(text if text.endswith("\n") else text + "\n", output, inputs)


def progress_for(args: argparse.Namespace) -> Progress:
    """Progress on stderr when it is a terminal, unless ``--quiet``."""
    return progress_on_stderr(quiet=args.quiet)


def add_loading_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("loading (always torch.load(weights_only=True))")
    group.add_argument(
        "--allow-global",
        metavar="NAME[,NAME]",
        action="append",
        default=[],
        help="allow this global (e.g. argparse.Namespace) that a refusal named; repeat or separate with commas. "
        "Only for files you trust; globals that can run code are never allowed",
    )
    group.add_argument(
        "--unsafe-load",
        action="store_true",
        help="last resort: torch.load(weights_only=False) through ampdoctor's allow-list (warns): admits what "
        "weights_only admits, --allow-global names, torch's data classes (modules, optimizers ...), numpy arrays, "
        "Python containers, --trust packages (and diagnose's --model module); refuses every other global while loading",
    )
    group.add_argument(
        "--trust",
        metavar="PACKAGE",
        action="append",
        default=[],
        help="with --unsafe-load: admit every global of PACKAGE and its submodules (the code that defines your "
        "model); repeatable. Packages that run code (os, subprocess ...), torch and numpy cannot be trusted whole",
    )


def allowed_globals(args: argparse.Namespace) -> list[str]:
    """The ``--allow-global`` names, each checked for syntax and refused when it can run code (no import)."""
    from ..checkpoint.safe_load import check_global_name

    return [check_global_name(n.strip()) for item in args.allow_global for n in item.split(",") if n.strip()]


def trusted_packages(args: argparse.Namespace, model_spec: Optional[str] = None) -> list[str]:
    """With ``--unsafe-load``: the ``--trust`` packages, checked (no import), plus the module of ``--model`` when
    it can be trusted; without it, none. Raises InvalidInput for ``--trust`` without ``--unsafe-load``."""
    from ..checkpoint.allow_list import check_trusted

    trusted = [check_trusted(p) for item in args.trust for p in item.split(",") if p.strip()]
    if not args.unsafe_load:
        if trusted:
            raise InvalidInput("--trust admits globals only when loading with --unsafe-load: add --unsafe-load")
        return []
    if model_spec and ":" in model_spec:
        try:
            trusted.append(check_trusted(model_spec.partition(":")[0]))
        except InvalidInput:
            pass  # torch.nn:Sequential and the like: admitted by class already, or never
    return list(dict.fromkeys(trusted))


def warn_unsafe(args: argparse.Namespace) -> None:
    if args.unsafe_load:
        print(
            "ampdoctor: warning: --unsafe-load: torch.load(weights_only=False) through ampdoctor's allow-list; "
            "the classes it admits run their own code when loaded: use it only on files you trust",
            file=sys.stderr,
        )


# -- library warnings become notes -------------------------------------------------------------------------------


def warning_note(message: warnings.WarningMessage) -> str:
    """A library warning as one line for a report's notes: who warned (the installed package, else the file's
    module name), and the first sentence of what it said."""
    path = message.filename.replace("\\", "/")
    if "/site-packages/" in path:
        source = path.split("/site-packages/")[-1].split("/")[0]
    else:
        source = path.rsplit("/", 1)[-1]
    source = source.removesuffix(".py") or "python"
    text = " ".join(str(message.message).split())
    first = text.split(". ", 1)[0].rstrip(".")
    return f"{source} warned ({message.category.__name__}): {first}"


@contextmanager
def warnings_as_notes() -> Iterator[list[str]]:
    """Collect the warnings raised inside (torch's pickle-protocol warning ...) as note lines, once each, instead
    of letting them reach stderr: exactly those the warning filters would have printed (DeprecationWarnings from
    libraries stay hidden by default). ampdoctor's own UnsafeLoadWarning is dropped: the command printed its
    line."""
    from ..checkpoint.safe_load import UnsafeLoadWarning

    notes: list[str] = []
    with warnings.catch_warnings(record=True) as caught:  # the filters in force decide what is kept, as for stderr
        try:
            yield notes
        finally:
            for message in caught:
                if not issubclass(message.category, UnsafeLoadWarning):
                    notes.append(warning_note(message))
            notes[:] = list(dict.fromkeys(notes))


def with_notes(report: Report, notes: Sequence[str]) -> Report:
    """The report with more run notes (the notes' own sequence type kept)."""
    if not notes:
        return report
    run = report.run
    more = type(run.notes)([*run.notes, *notes])  # type: ignore[call-arg]
    return dataclasses.replace(report, run=dataclasses.replace(run, notes=more))


# -- Ctrl-C and the user's code ----------------------------------------------------------------------------------

_sigint = threading.Event()  # set when a real SIGINT (Ctrl-C) arrived while a command ran
_tracking = threading.Event()  # set while our SIGINT handler is installed


def _on_sigint(signum: int, frame: Any) -> None:
    _sigint.set()
    raise KeyboardInterrupt


@contextmanager
def interrupt_tracking() -> Iterator[None]:
    """Tell a real Ctrl-C (exit 130) from user code that raises KeyboardInterrupt itself (an input error)."""
    _sigint.clear()
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
        _tracking.set()
    try:
        yield
    finally:
        if _tracking.is_set():
            signal.signal(signal.SIGINT, signal.default_int_handler)
            _tracking.clear()


@contextmanager
def user_code(what: str, stage: Optional[Stage] = None) -> Iterator[None]:
    """Around the user's code (``what``: "the factory mypkg:build", "importing mypkg"): ``sys.exit`` and a
    KeyboardInterrupt that no Ctrl-C caused become one-line errors, never exit 0 ("healthy") or 130. What the
    user's code prints goes to stderr: stdout carries only the report (``--format json`` stays JSON)."""
    try:
        with redirect_stdout(sys.stderr):
            yield
    except SystemExit as exc:
        message = f"{what} called sys.exit({exc.code!r}); ampdoctor needs it to return"
        raise (ModelRaised(message, stage) if stage else InvalidInput(message)) from exc
    except KeyboardInterrupt as exc:
        if _sigint.is_set() or not _tracking.is_set():  # a real Ctrl-C, or no way to tell: exit 130
            raise
        message = f"{what} raised KeyboardInterrupt (no Ctrl-C was pressed)"
        raise (ModelRaised(message, stage) if stage else InvalidInput(message)) from exc


def one_line(exc: BaseException) -> str:
    """An error message on one printable line (messages from the user's model or a damaged file may span several
    lines or hold control characters)."""
    from ..report.inert import inert

    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    return inert(text) or type(exc).__name__
