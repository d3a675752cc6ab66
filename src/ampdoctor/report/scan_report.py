"""The report of a checkpoint scan: :class:`~.scan_data.ScanReportData` saved as JSON and rendered.

Pure (no torch): ``ScanReport.from_json`` and rendering run on a machine without torch.
"""

from __future__ import annotations

from typing import Any

from ..serial import to_plain
from .scan_data import ScanReportData

__all__ = ["ScanReport"]


class ScanReport(ScanReportData):
    """What :func:`scan` found in a checkpoint. ``print(report)`` shows it; ``report.to_json()`` saves it."""

    # -- serialisation --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data: the fields, plus ``kind``, ``verdict``, ``exit_code``, the per-module summary and
        each finding's ``title`` and ``message`` as the text report words them (``from_dict`` ignores those)."""
        from .scan_text import finding_message, finding_title

        data: dict[str, Any] = to_plain(self)
        data["kind"] = "ampdoctor.scan"
        data["verdict"] = self.verdict
        data["exit_code"] = self.exit_code
        data["modules"] = to_plain(self.by_module())
        for plain, finding in zip(data["findings"], self.findings):
            plain["title"] = finding_title(finding, self)
            plain["message"] = finding_message(finding, self)
        return data

    # -- rendering ------------------------------------------------------------------------------------------
    def to_text(self, max_rows: int = 20) -> str:
        from .scan_text import render_scan_text

        return render_scan_text(self, max_rows=max_rows)

    def to_markdown(self, max_rows: int = 20) -> str:
        from .scan_markdown import render_scan_markdown

        return render_scan_markdown(self, max_rows=max_rows)

    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        return f"<ampdoctor.ScanReport verdict={self.verdict!r}, files={len(self.files)}, tensors={len(self.tensors)}>"
