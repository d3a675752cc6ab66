"""Plain-text rendering of a Report (tabulate): the report's :mod:`document`, laid out as text. Pure."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tabulate import tabulate

from .document import Document, Item, Para, Source, Table, describe_bad, describe_origin, fmt_num
from .sections import build_document

if TYPE_CHECKING:
    from .report import Report

__all__ = ["describe_bad", "describe_origin", "fmt_num", "render_text", "text_of"]


def text_of(doc: Document, title: str = "ampdoctor") -> str:
    """A document as indented plain text: sections separated by a blank line, tables in tabulate's simple style."""
    lines = [f"{title}: {doc.head}", f"  {doc.facts}", *(f"  {alert}" for alert in doc.alerts)]
    for section in doc.sections:
        lines += ["", section.title]
        for block in section.blocks:
            if isinstance(block, Para):
                lines.append("  " * block.indent + block.text)
            elif isinstance(block, Source):
                lines.append("  " * block.indent + f"{block.text}: {block.code}")
            elif isinstance(block, Table):
                lines.append(tabulate(block.rows, headers=block.headers, tablefmt="simple"))
            elif isinstance(block, Item):
                lines.append(f"  {block.number}. {block.title}" + (" [verified]" if block.verified else ""))
                lines += ["       " + d for d in block.details]
                lines += ["       " + line for line in block.snippet.splitlines()]
    return "\n".join(lines)


def render_text(report: Report, max_rows: int = 20) -> str:
    return text_of(build_document(report, max_rows))
