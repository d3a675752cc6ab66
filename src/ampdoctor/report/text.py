"""Plain-text rendering of a Report (tabulate): the report's :mod:`document`, laid out as text. Pure."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from tabulate import tabulate

from .document import Document, Item, Para, Source, Table, describe_bad, describe_origin, fmt_num
from .inert import inert
from .rows import left_out_line
from .sections import build_document

if TYPE_CHECKING:
    from .data import ReportData

__all__ = ["describe_bad", "describe_origin", "fmt_num", "render_text", "text_of"]

# A cell that reads as a number (aligned as tabulate would, without letting it re-read the value).
_NUMBER = re.compile(r"[-+]?(\d[\d,]*(\.\d*)?|\.\d+)([eE][-+]?\d+)?|[-+]?inf|nan")


def _alignment(headers: tuple[str, ...], rows: list[list[str]]) -> tuple[str, ...]:
    """A column of numbers aligned on the decimal point, any other left (as tabulate aligns them when it reads
    the cells as numbers itself)."""
    return tuple(
        "decimal" if rows and all(not r[i] or _NUMBER.fullmatch(r[i]) for r in rows) else "left"
        for i in range(len(headers))
    )


def text_of(doc: Document, title: str = "ampdoctor") -> str:
    """A document as indented plain text: sections separated by a blank line, tables in tabulate's simple style.
    Every string is made :func:`inert` (control characters and line breaks escaped): names may come from files."""
    lines = [f"{inert(title)}: {inert(doc.head)}", f"  {inert(doc.facts)}", *(f"  {inert(a)}" for a in doc.alerts)]
    for section in doc.sections:
        lines += ["", inert(section.title)]
        for block in section.blocks:
            if isinstance(block, Para):
                lines.append("  " * block.indent + inert(block.text))
            elif isinstance(block, Source):
                lines.append("  " * block.indent + f"{inert(block.text)}: {inert(block.code)}")
            elif isinstance(block, Table):
                rows = [[inert(str(c)) for c in row] for row in block.rows]
                # cells are formatted already: tabulate must not re-read them as numbers ("007" -> 7, "18.60" -> 18.6)
                lines.append(tabulate(rows, headers=[inert(h) for h in block.headers], tablefmt="simple",
                                      disable_numparse=True, colalign=_alignment(block.headers, rows)))
                if block.left_out:
                    lines.append("  " + left_out_line(block.left_out, len(block.rows), block.shown_as))
            elif isinstance(block, Item):
                lines.append(f"  {block.number}. {inert(block.title)}" + (" [verified]" if block.verified else ""))
                lines += ["       " + inert(d) for d in block.details]
                lines += ["       " + inert(line) for line in block.snippet.splitlines()]
    return "\n".join(lines)


def render_text(report: ReportData, max_rows: int = 20) -> str:
    return text_of(build_document(report, max_rows))
