"""Progress of long steps, shown on stderr (``tqdm``) only when someone watches.

A :class:`Progress` is handed to the code that does the long steps: ``stage(name, total)`` starts a step
(``total`` items, or ``None`` when unknown), ``advance()`` counts an item done, ``detail(text)`` says what is
being worked on now (a shard, a large tensor), ``close()`` ends the display. The base class does nothing, so
library code calls it unconditionally; :func:`progress_on_stderr` returns a visible one only when stderr is a
terminal (or when forced) and not ``quiet``::

    with progress_on_stderr(quiet=args.quiet) as progress:
        progress.stage("reading", total=len(files))
        for f in files:
            progress.detail(f.name)
            ...
            progress.advance()

``ampdoctor.scan(path, progress=...)`` takes one; ``ampdoctor.diagnose`` can take the same object for its passes.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any, Optional, TextIO

# Tensors with at least this many values get their own progress line while they are measured.
LARGE_TENSOR_NUMEL = 2**24


class Progress:
    """Progress of long steps: this base class shows nothing (the no-op every caller can use)."""

    def stage(self, name: str, total: Optional[int] = None) -> None:
        """Start a step of ``total`` items (``None``: unknown); ends the previous step."""

    def advance(self, n: int = 1) -> None:
        """``n`` items of the current step are done."""

    def detail(self, text: str) -> None:
        """What the current step works on now (shown next to the count)."""

    def close(self) -> None:
        """End the display; the object may start new stages afterwards."""

    @property
    def visible(self) -> bool:
        return False

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.close()


NO_PROGRESS = Progress()


class BarProgress(Progress):
    """A ``tqdm`` line per stage on ``stream``: ``ampdoctor: reading 1/5 [00:03], model-00002-of-00005.bin``."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._bar: Any = None

    @property
    def visible(self) -> bool:
        return True

    def stage(self, name: str, total: Optional[int] = None) -> None:
        from tqdm import tqdm

        self.close()
        counted = "{n_fmt}/{total_fmt} " if total is not None else ""
        self._bar = tqdm(
            total=total,
            desc=f"ampdoctor: {name}",
            file=self._stream,
            leave=False,
            dynamic_ncols=True,
            mininterval=0.2,
            bar_format="{desc} " + counted + "[{elapsed}]{postfix}",
        )

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def detail(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def progress_on_stderr(quiet: bool = False, force: bool = False, stream: Optional[TextIO] = None) -> Progress:
    """A visible progress display on ``stream`` (stderr) when it is a terminal or ``force``; else the no-op.

    ``quiet`` always wins: nothing is shown.
    """
    target = sys.stderr if stream is None else stream
    if quiet:
        return Progress()
    isatty = getattr(target, "isatty", None)
    if force or (callable(isatty) and isatty()):
        return BarProgress(target)
    return Progress()
