"""Markdown rendering of a Report (GitHub-flavoured: headings, pipe tables, fenced code), for issues and pull
requests. The same :mod:`document` as the text report, laid out as markdown. Pure."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .document import Document, Item, Para, Source, Table
from .inert import inert
from .rows import left_out_line
from .sections import build_document

if TYPE_CHECKING:
    from .data import ReportData

# CommonMark backslash-escapes ASCII punctuation; these would otherwise start emphasis, links, HTML, tables or
# (``&``) an entity reference: ``&rlm;`` in a name would become the invisible character that inert() escapes.
_SPECIAL = re.compile(r"([\\`*_\[\]<>|#~&])")


def md_escape(text: str) -> str:
    """Text shown as itself (module names such as ``_orig_mod`` or ``<root>`` are not markup; control characters
    and line breaks escaped visibly)."""
    return _SPECIAL.sub(r"\\\1", inert(text))


def _fence(code: str, language: str = "python", indent: str = "") -> list[str]:
    longest = max((len(m) for m in re.findall(r"`+", code)), default=0)
    fence = "`" * max(3, longest + 1)  # a fence longer than any run of backticks inside
    return [f"{indent}{fence}{language}", *(indent + inert(line) for line in code.splitlines()), f"{indent}{fence}"]


def _table(table: Table) -> list[str]:
    def row(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(md_escape(c) for c in cells) + " |"

    lines = [row(table.headers), "|" + "|".join(" --- " for _ in table.headers) + "|", *(row(r) for r in table.rows)]
    if table.left_out:
        lines += ["", md_escape(left_out_line(table.left_out, len(table.rows), table.shown_as))]
    return lines


def markdown_of(doc: Document, title: str = "ampdoctor") -> str:
    """A document as markdown: one ``###`` heading per section, paragraphs as bullet points."""
    lines = [f"## {md_escape(title)}: {md_escape(doc.head)}", "", md_escape(doc.facts)]
    for alert in doc.alerts:  # each its own blockquote paragraph
        lines += ["", f"> **{md_escape(alert)}**"]
    for section in doc.sections:
        lines += ["", f"### {md_escape(section.title)}", ""]
        previous = None
        for block in section.blocks:
            if previous is not None and type(block) is not type(previous) or isinstance(block, (Table, Item)):
                if lines[-1] != "":
                    lines.append("")
            if isinstance(block, Para):
                lines.append("  " * (block.indent - 1) + "- " + md_escape(block.text))
            elif isinstance(block, Source):
                lines += [f"- {md_escape(block.text)}:", "", *_fence(block.code, indent="  ")]
            elif isinstance(block, Table):
                lines += _table(block)
            elif isinstance(block, Item):
                status = " (verified)" if block.verified else ""
                lines.append(f"{block.number}. **{md_escape(block.title)}**{status}")
                lines += ["   - " + md_escape(d) for d in block.details]
                if block.snippet:
                    lines += ["", *_fence(block.snippet, indent="   ")]
            previous = block
    return "\n".join(lines) + "\n"


def render_markdown(report: ReportData, max_rows: int = 20) -> str:
    return markdown_of(build_document(report, max_rows))
