"""The report's data: records + findings + recommendations + run facts, with a JSON round trip. No torch here.

Renderers (text, markdown, HTML, frames, plot) read a :class:`ReportData`; :class:`~.report.Report` adds the
methods that call them, so the renderers never import the module that imports them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, TypeVar

from ..analysis import Findings, Origin
from ..records import ModuleInfo, PassTrace, Recommendation, RunInfo, StepRecord, Verdict
from ..serial import SavedReport, to_plain

R = TypeVar("R", bound="ReportData")

# Major.minor: readers refuse a newer major version; a newer minor only adds fields.
# 1.1: policy notes, run facts (environment, passes, policy), discarded ops; the watch's divergence, weight norms
# 1.2: hidden overflows (trace.op_overflows, findings.hidden) and the verdict "hidden_overflow"
SCHEMA_VERSION = "1.2"


@dataclass(frozen=True)
class ReportData(SavedReport):
    """What ``diagnose`` found, as data (see :class:`~.report.Report` for the rendering methods)."""

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

    def _shown(self: R, absolute_paths: bool) -> R:
        """This report with its source paths as shown (see :mod:`.paths`), or as captured."""
        if absolute_paths:
            return self
        from .paths import with_shown_paths

        return with_shown_paths(self)
