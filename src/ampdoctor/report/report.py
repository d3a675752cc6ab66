"""The Report: :class:`~.data.ReportData` with its renderings (text, markdown, HTML, DataFrame, plot, files)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

from ..atomic import write_text_atomically
from .data import SCHEMA_VERSION, ReportData

__all__ = ["SCHEMA_VERSION", "Report"]


def _rows(max_rows: object) -> int:
    """``max_rows`` checked: a table shows at least one row (a negative one dropped the last row silently)."""
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        from ..errors import InvalidInput

        raise InvalidInput(f"max_rows={max_rows!r}: give a whole number of table rows, 1 or more (default 20)")
    return max_rows


class Report(ReportData):
    """What ``diagnose`` found. ``print(report)`` shows it; ``report.to_json()`` saves it."""

    # -- rendering ------------------------------------------------------------------------------------------
    def to_text(self, max_rows: int = 20, *, absolute_paths: bool = False) -> str:
        """The plain-text report (what ``print(report)`` shows). Source lines are named by their file's name; a
        path the text quotes is relative to the working directory unless ``absolute_paths``."""
        from .text import render_text

        return render_text(self._shown(absolute_paths), max_rows=_rows(max_rows))

    def to_markdown(self, max_rows: int = 20, *, absolute_paths: bool = False) -> str:
        """GitHub-flavoured markdown (headings, pipe tables, fenced code) for issues and pull requests."""
        from .markdown import render_markdown

        return render_markdown(self._shown(absolute_paths), max_rows=_rows(max_rows))

    def to_html(self, *, fragment: bool = False, absolute_paths: bool = False) -> str:
        """A standalone HTML page (what ``--format html`` writes), or with ``fragment`` the ``<div>`` a notebook
        shows. Escaped, no JavaScript, with a ``<pre>`` text fallback; source paths relative unless
        ``absolute_paths``."""
        from .html import render_html, render_html_page

        shown = self._shown(absolute_paths)
        return render_html(shown) if fragment else render_html_page(shown)

    def save(self, path: Union[str, os.PathLike[str]], *, absolute_paths: bool = False) -> Path:
        """Write the report in the format its suffix names: ``.html``, ``.md``, ``.json`` or ``.txt``. Returns
        the path. Any other suffix raises :class:`~ampdoctor.errors.InvalidInput` (nothing is written). The file
        is replaced atomically: whole, or left as it was (:mod:`ampdoctor.atomic`)."""
        target = Path(path)
        writers = {
            ".html": lambda: self.to_html(absolute_paths=absolute_paths),
            ".htm": lambda: self.to_html(absolute_paths=absolute_paths),
            ".md": lambda: self.to_markdown(absolute_paths=absolute_paths),
            ".json": lambda: self.to_json(indent=2, absolute_paths=absolute_paths),
            ".txt": lambda: self.to_text(absolute_paths=absolute_paths),
        }
        writer = writers.get(target.suffix.lower())
        if writer is None:
            from ..errors import InvalidInput

            raise InvalidInput(
                f"Report.save({os.fspath(path)!r}): cannot tell the format from the suffix {target.suffix!r}; name "
                "the file .html, .md, .json or .txt"
            )
        text = writer()
        write_text_atomically(target, text if text.endswith("\n") else text + "\n")  # whole, or as it was
        return target

    def __str__(self) -> str:
        return self.to_text()

    def _repr_html_(self) -> str:
        """Rich display in Jupyter (escaped, no JavaScript, with a ``<pre>`` text fallback)."""
        return self.to_html(fragment=True)

    def to_dataframe(self) -> Any:
        """One row per module call and tensor (pandas needed: ``pip install ampdoctor[notebook]``)."""
        from .frames import to_dataframe

        return to_dataframe(self)

    def plot(self, path: Optional[str] = None) -> Any:
        """Each call's range against the format's band; returns the figure, saves a PNG when ``path`` is given
        (matplotlib needed: ``pip install ampdoctor[notebook]``)."""
        from .plot import plot_report

        return plot_report(self, path)

    def __repr__(self) -> str:
        origin = self.forward_origin or self.backward_origin
        where = f", origin={origin.label!r}" if origin else ""
        return f"<ampdoctor.Report verdict={self.verdict!r}{where}, calls={len(self.trace.calls)}>"
