"""What every subcommand shares: output options and rendering, writing the output, loading options, progress.

Exit codes: 0 healthy or warnings only, 1 a finding (overflow, nan, underflow), 2 usage or input error.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from ..errors import AmpDoctorError, InvalidInput

if TYPE_CHECKING:
    from ..report import Report

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2
FORMATS = ("text", "json", "markdown", "html")


def add_output_options(parser: argparse.ArgumentParser, formats: Sequence[str] = FORMATS) -> None:
    parser.add_argument("--format", choices=list(formats), default="text", help="output format (default: text)")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the report to FILE instead of stdout")


def render(report: Report, fmt: str) -> str:
    if fmt == "json":
        return report.to_json(indent=2)
    if fmt == "markdown":
        from ..report.markdown import render_markdown

        return render_markdown(report)
    if fmt == "html":
        from ..report.html import render_html_page

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



def add_loading_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("loading (always torch.load(weights_only=True))")
    group.add_argument(
        "--allow-global",
        metavar="NAME[,NAME]",
        action="append",
        default=[],
        help="allow this global (e.g. argparse.Namespace) that a refusal named; repeat or separate with commas. "
        "Only for files you trust",
    )
    group.add_argument(
        "--unsafe-load",
        action="store_true",
        help="last resort: torch.load(weights_only=False), which runs any code the file holds (warns)",
    )



def allowed_globals(args: argparse.Namespace) -> list[str]:
    return [name.strip() for item in args.allow_global for name in item.split(",") if name.strip()]


def warn_unsafe(args: argparse.Namespace) -> None:
    if args.unsafe_load:
        print(
            "ampdoctor: warning: --unsafe-load: torch.load(weights_only=False) runs any code the checkpoint holds; "
            "use it only on files you trust",
            file=sys.stderr,
        )


@contextmanager
def quiet_unsafe_warning() -> Iterator[None]:
    """The command has printed its own warning line; the library's UnsafeLoadWarning would repeat it."""
    from ..checkpoint.safe_load import UnsafeLoadWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeLoadWarning)
        yield


def progress_printer() -> Optional[Callable[[int, int, str], None]]:
    """Progress on stderr, only when stderr is a terminal."""
    if not sys.stderr.isatty():
        return None

    def show(index: int, total: int, name: str) -> None:
        end = "\n" if index + 1 == total else ""
        sys.stderr.write(f"\r\033[Kampdoctor: reading {index + 1}/{total} {name}{end}")
        sys.stderr.flush()

    return show


def guard_output(output: Optional[str], checkpoint: str) -> None:
    """Refuse ``-o`` pointing at the checkpoint or into a checkpoint directory (the input is never modified)."""
    if output is None:
        return
    target, source = Path(output).resolve(), Path(checkpoint).resolve()
    if target == source or (source.is_dir() and source in target.parents):
        raise InvalidInput(
            f"-o {output}: that is the checkpoint (or inside its directory); ampdoctor never writes there, "
            "choose another file"
        )


def one_line(exc: AmpDoctorError) -> AmpDoctorError:
    """The same error with its message on one line (messages from the user's model may span several)."""
    text = " ".join(part.strip() for part in str(exc).splitlines() if part.strip())
    return exc if text == str(exc) else AmpDoctorError(text)

