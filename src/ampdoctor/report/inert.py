"""Names from a file, made inert for a terminal or a markdown viewer (pure).

State-dict keys, file names and the globals a pickle names come from files ampdoctor does not trust. Printed raw,
an escape sequence clears the screen and a line break starts a fake line ("ampdoctor scan: HEALTHY").
:func:`inert` shows every such character as a visible escape instead: control characters (``\\x1b``, ``\\n``,
``\\r``, ``\\t``, DEL and the C1 range), Unicode line and paragraph separators, the bidirectional overrides and
other invisible format characters that reorder or hide text, and the undecodable bytes of a non-UTF-8 file name
(Python's surrogate escapes, shown as the byte they stand for: ``\\xff``). Everything else is left as it is.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .scan_data import ScanReportData

# Escapes shown for the common control characters (others: \xNN, \uNNNN).
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\x00": "\\0"}


def _escape(char: str) -> str:
    code = ord(char)
    if char in _NAMED:
        return _NAMED[char]
    if 0xDC80 <= code <= 0xDCFF:  # a byte of a file name that is not UTF-8 (os.fsdecode's surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def _dangerous(char: str) -> bool:
    return unicodedata.category(char) in ("Cc", "Cf", "Cs", "Zl", "Zp") and char != " "


def inert(text: str) -> str:
    """``text`` with control, invisible-format and line-break characters escaped visibly (one line, printable)."""
    if text.isprintable() and text.isascii():
        return text
    return "".join(_escape(c) if _dangerous(c) else c for c in text)


def inert_names(report: ScanReportData) -> ScanReportData:
    """The report with every name that came from the files (path, file names, tensor keys, globals, notes) made
    :func:`inert`; the text and markdown renderers show this copy. Lookups by name still match: every copy of a
    name is escaped the same way."""
    def names(items: Sequence[str]) -> tuple[str, ...]:
        return tuple(inert(n) for n in items)

    return replace(
        report,
        path=inert(report.path),
        files=tuple(
            replace(f, name=inert(f.name), skipped=inert(f.skipped), refused=names(f.refused),
                    refused_unknown=names(f.refused_unknown))  # fmt: skip
            for f in report.files
        ),
        tensors=tuple(replace(t, name=inert(t.name), file=inert(t.file), param=inert(t.param)) for t in report.tensors),
        optimizers=tuple(
            replace(o, path=inert(o.path), file=inert(o.file), param_names=names(o.param_names))
            for o in report.optimizers
        ),
        scalers=tuple(replace(c, path=inert(c.path), file=inert(c.file)) for c in report.scalers),
        findings=tuple(
            replace(f, tensors=names(f.tensors), worst=inert(f.worst), globals=names(f.globals))
            for f in report.findings
        ),
        notes=names(report.notes),
    )
