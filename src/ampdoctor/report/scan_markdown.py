"""GitHub-flavoured markdown of a checkpoint scan (pure): headings, pipe tables, names in code spans.

Same words and tables as the text report (:mod:`.scan_text`), so the two cannot disagree.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from .inert import inert_names
from .scan_text import (
    Table,
    file_table,
    finding_message,
    finding_title,
    module_table,
    notes,
    optimizer_rows,
    scaler_rows,
    summary_lines,
    tensor_table,
    verdict_line,
)

if TYPE_CHECKING:
    from .scan_data import ScanReportData


def code(text: str) -> str:
    """``text`` as an inline code span (a span holding backticks gets a longer fence)."""
    fence = "`"
    while fence in text:
        fence += "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def pipe_table(table: Table) -> list[str]:
    """A GitHub pipe table; numeric-looking columns are right-aligned."""
    headers, rows = table
    lines = ["| " + " | ".join(_cell(h) for h in headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _escape(text: str) -> str:
    """Prose with the characters markdown would take as markup escaped."""
    for char in ("\\", "*", "_", "<", ">", "[", "]", "#", "|"):
        text = text.replace(char, "\\" + char)
    return text


def render_scan_markdown(report: ScanReportData, max_rows: int = 20) -> str:
    """The verdict as a heading, then findings, state and tables, each under its own heading. Names from the files
    are shown inert (:func:`~.inert.inert_names`)."""
    report = inert_names(report)
    head = verdict_line(report).split(" - ", 1)
    lines = [f"## ampdoctor scan: {report.verdict}", ""]
    if len(head) == 2:
        lines += [f"**{_escape(head[1])}**", ""]
    lines += [_escape(line) + "  " for line in summary_lines(report)]
    for severity, title in (("error", "Findings"), ("warning", "Warnings")):
        chosen = [f for f in report.findings if f.severity == severity]
        if chosen:
            lines += ["", f"### {title}", ""]
            for i, f in enumerate(chosen, 1):
                lines.append(f"{i}. **{_escape(finding_title(f, report))}**  ")
                lines.append(f"   {_escape(finding_message(f, report))}")
    if notes(report):
        lines += ["", "### Notes", ""]
        lines += [f"- {_escape(note)}" for note in notes(report)]
    if report.scalers:
        lines += ["", "### GradScaler state", ""]
        rows = [[code(r[0]), *r[1:]] for r in scaler_rows(report)]
        lines += pipe_table((["path", "scale", "growth tracker", "state"], rows))
    if report.optimizers:
        lines += ["", "### Optimizer state", ""]
        rows = [[code(r[0]), *r[1:]] for r in optimizer_rows(report)]
        lines += pipe_table((["path", "parameter states", "param groups", "eps", "moments in"], rows))
    modules = module_table(report, max_rows, code)
    if modules[1]:
        lines += ["", f"### Modules (worst first, {len(modules[1])} shown)", "", *pipe_table(modules)]
    tensors = tensor_table(report, max_rows, code)
    if tensors[1]:
        lines += ["", "### Tensors with inf/NaN or values the format cannot hold", "", *pipe_table(tensors)]
    files = file_table(report, max_rows, code)
    if files is not None:
        lines += ["", "### Files", "", *pipe_table(files)]
    if report.verdict not in ("healthy", "incomplete"):
        lines += [
            "",
            "### Next step",
            "",
            "```bash",
            f"ampdoctor diagnose {shlex.quote(report.path)} --model MODULE:FACTORY "
            "--input-shape SHAPE   # where the first inf/NaN is made",
            "```",
        ]
    return "\n".join(lines) + "\n"
