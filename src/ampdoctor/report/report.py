"""The Report: records + findings + recommendations + run facts, with a JSON round trip. No torch here."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional, Union

from ..analysis import Findings, Origin
from ..records import ModuleInfo, PassTrace, Recommendation, RunInfo, StepRecord, Verdict
from ..serial import SavedReport, to_plain

# Major.minor: readers refuse a newer major version; a newer minor only adds fields.
# 1.1: policy notes, run facts (environment, passes, policy), discarded ops; the watch's divergence, weight norms
SCHEMA_VERSION = "1.1"


@dataclass(frozen=True)
class Report(SavedReport):
    """What ``diagnose`` found. ``print(report)`` shows it; ``report.to_json()`` saves it."""

    SCHEMA: ClassVar[str] = SCHEMA_VERSION
    KIND: ClassVar[str] = "report"

    run: RunInfo
    modules: tuple[ModuleInfo, ...]
    trace: PassTrace
    findings: Findings
    recommendations: tuple[Recommendation, ...] = ()
    steps: tuple[StepRecord, ...] = ()  # filled by ampdoctor.watch; empty for diagnose
    schema_version: str = SCHEMA_VERSION

    # -- the stable surface ---------------------------------------------------------------------------------
    @property
    def verdict(self) -> Verdict:
        """One of ``healthy``, ``overflow``, ``nan``, ``underflow``, ``scale_overflow``."""
        return self.findings.verdict

    @property
    def forward_origin(self) -> Optional[Origin]:
        return self.findings.forward_origin

    @property
    def backward_origin(self) -> Optional[Origin]:
        return self.findings.backward_origin

    @property
    def exit_code(self) -> int:
        """CLI convention: 0 healthy or warnings only (harmless scale overflow, thin headroom), 1 a finding
        (a divergence in training included)."""
        if self.findings.divergence is not None:
            return 1
        if self.verdict == "healthy":
            return 0
        if self.verdict == "scale_overflow" and self.findings.scale is not None and self.findings.scale.harmless:
            return 0
        return 1

    # -- serialisation --------------------------------------------------------------------------------------
    def to_dict(self, *, absolute_paths: bool = False) -> dict[str, Any]:
        """Plain data for JSON: every field, plus ``verdict`` and ``exit_code`` at the top (read-only: ignored
        by :meth:`from_dict`, which recomputes them). Source paths are relative to the working directory (or
        to the package root for library code) unless ``absolute_paths``."""
        data: dict[str, Any] = {"verdict": self.verdict, "exit_code": self.exit_code}
        if self.run.random_input:  # the verdict is about a random batch, not real data (see run.random_input)
            data["on_random_input"] = True
        data.update(to_plain(self._shown(absolute_paths)))
        return data

    def to_json(self, indent: Optional[int] = None, *, absolute_paths: bool = False) -> str:
        import json

        return json.dumps(self.to_dict(absolute_paths=absolute_paths), indent=indent, allow_nan=False)

    def _shown(self, absolute_paths: bool) -> Report:
        """This report with its source paths as shown (see :mod:`.paths`), or as captured."""
        if absolute_paths:
            return self
        from .paths import with_shown_paths

        return with_shown_paths(self)

    # -- rendering ------------------------------------------------------------------------------------------
    def to_text(self, max_rows: int = 20, *, absolute_paths: bool = False) -> str:
        """The plain-text report (what ``print(report)`` shows); source paths relative unless ``absolute_paths``."""
        from .text import render_text

        return render_text(self._shown(absolute_paths), max_rows=max_rows)

    def to_markdown(self, max_rows: int = 20, *, absolute_paths: bool = False) -> str:
        """GitHub-flavoured markdown (headings, pipe tables, fenced code) for issues and pull requests."""
        from .markdown import render_markdown

        return render_markdown(self._shown(absolute_paths), max_rows=max_rows)

    def to_html(self, *, fragment: bool = False, absolute_paths: bool = False) -> str:
        """A standalone HTML page (what ``--format html`` writes), or with ``fragment`` the ``<div>`` a notebook
        shows. Escaped, no JavaScript, with a ``<pre>`` text fallback; source paths relative unless
        ``absolute_paths``."""
        from .html import render_html, render_html_page

        shown = self._shown(absolute_paths)
        return render_html(shown) if fragment else render_html_page(shown)

    def save(self, path: Union[str, os.PathLike[str]], *, absolute_paths: bool = False) -> Path:
        """Write the report in the format its suffix names: ``.html``, ``.md``, ``.json`` or ``.txt``. Returns
        the path. Any other suffix raises :class:`~ampdoctor.errors.InvalidInput` (nothing is written)."""
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
        target.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
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
