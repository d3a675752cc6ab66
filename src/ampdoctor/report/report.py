"""The Report: records + findings + recommendations + run facts, with a JSON round trip. No torch here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from ..analysis import Findings, Origin
from ..records import ModuleInfo, PassTrace, Recommendation, RunInfo, StepRecord, Verdict
from ..serial import SavedReport, to_plain

# Major.minor: readers refuse a newer major version; a newer minor only adds fields.
# 1.1: policy notes, run facts (environment, passes, policy), discarded ops; the watch's divergence, weight norms
# 1.2: hidden overflows (trace.op_overflows, findings.hidden) and the verdict "hidden_overflow"
SCHEMA_VERSION = "1.2"


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
        """One of ``healthy``, ``overflow``, ``nan``, ``underflow``, ``scale_overflow``, ``hidden_overflow``."""
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
        (a divergence in training and a hidden overflow included)."""
        if self.findings.divergence is not None or self.findings.hidden:
            return 1  # a hidden overflow is a finding whatever the verdict (under a harmless scale overflow too)
        if self.verdict == "healthy":
            return 0
        if self.verdict == "scale_overflow" and self.findings.scale is not None and self.findings.scale.harmless:
            return 0
        return 1

    # -- serialisation --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON: every field, plus ``verdict`` and ``exit_code`` at the top (read-only: ignored
        by :meth:`from_dict`, which recomputes them)."""
        data: dict[str, Any] = {"verdict": self.verdict, "exit_code": self.exit_code}
        data.update(to_plain(self))
        return data

    # -- rendering ------------------------------------------------------------------------------------------
    def to_text(self, max_rows: int = 20) -> str:
        from .text import render_text

        return render_text(self, max_rows=max_rows)

    def to_markdown(self, max_rows: int = 20) -> str:
        """GitHub-flavoured markdown (headings, pipe tables, fenced code) for issues and pull requests."""
        from .markdown import render_markdown

        return render_markdown(self, max_rows=max_rows)

    def __str__(self) -> str:
        return self.to_text()

    def _repr_html_(self) -> str:
        """Rich display in Jupyter (escaped, no JavaScript, with a ``<pre>`` text fallback)."""
        from .html import render_html

        return render_html(self)

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
