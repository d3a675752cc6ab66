"""Source paths as reports show them: relative to the working directory, or to the package root for library code
(``transformers/models/gpt2/modeling_gpt2.py``), so that a report shared or committed does not carry the user's
home directory. ``absolute_paths=True`` on the Report's renderers keeps them as captured. Pure: no file is read.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from ..records import (
    Comparison,
    FormatLimits,
    GradEvent,
    ModuleCall,
    ModuleInfo,
    OpPeak,
    ParamRecord,
    PassRecord,
    SourceLocation,
    TensorRecord,
    TensorStats,
)

_PACKAGE_DIRS = ("site-packages", "dist-packages")  # where installed libraries live
_OWN_PACKAGE = Path(__file__).resolve().parents[1]  # ampdoctor itself (its demo model is model code)

T = TypeVar("T")


def shown_path(file: str, cwd: Optional[str] = None) -> str:
    """``file`` relative to ``cwd`` (default: the working directory) when it lies inside it; library code from
    its package root; anything else as it is."""
    if not os.path.isabs(file):
        return file
    norm = os.path.normpath(file)
    parts = norm.split(os.sep)
    for marker in _PACKAGE_DIRS:
        if marker in parts:
            at = len(parts) - 1 - parts[::-1].index(marker)
            return "/".join(parts[at + 1 :])
    base = os.path.normpath(cwd if cwd is not None else os.getcwd())
    if norm == base or norm.startswith(base.rstrip(os.sep) + os.sep):
        return os.path.relpath(norm, base).replace(os.sep, "/")
    own = str(_OWN_PACKAGE)
    if norm.startswith(own + os.sep):
        return "ampdoctor/" + os.path.relpath(norm, own).replace(os.sep, "/")
    return file


def with_shown_paths(obj: T, cwd: Optional[str] = None) -> T:
    """A copy of a report record with every :class:`SourceLocation`'s file as :func:`shown_path` gives it, and
    the same path written inside any text of the record (a recommendation's title quoting the line) replaced
    too. The parts that hold none are shared, not copied."""
    files: set[str] = set()
    _walk(obj, files)
    shown = {f: shown_path(f, cwd) for f in files}
    shown = {f: s for f, s in shown.items() if s != f}
    if not shown:
        return obj
    longest_first = sorted(shown, key=len, reverse=True)

    def text(value: str) -> str:
        for f in longest_first:
            if f in value:
                value = value.replace(f, shown[f])
        return value

    return _rewrite(obj, text)  # type: ignore[no-any-return]


# Records that hold no SourceLocation at any depth (their fields are names, numbers, statistics and each other;
# tests/test_cost_analysis.py checks it from their type hints): the walk for files does not visit them, so a report
# of ten thousand module calls is not walked record by record (four seconds per rendering).
_NO_LOCATION = (TensorStats, TensorRecord, ParamRecord, ModuleInfo, ModuleCall, GradEvent, FormatLimits, OpPeak,
                Comparison, PassRecord)


def _walk(obj: Any, files: set[str]) -> None:
    if isinstance(obj, SourceLocation):
        files.add(obj.file)
    elif isinstance(obj, _NO_LOCATION):
        return
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            _walk(getattr(obj, field.name), files)
    elif isinstance(obj, tuple) and obj and not isinstance(obj[0], (str, int, float)):
        for value in obj:
            _walk(value, files)


def _rewrite(obj: Any, fn: Callable[[str], str]) -> Any:
    if isinstance(obj, str):
        new = fn(obj)
        return obj if new == obj else new
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changed = {}
        for field in dataclasses.fields(obj):
            if not field.init:
                continue
            value = getattr(obj, field.name)
            new = _rewrite(value, fn)
            if new is not value:
                changed[field.name] = new
        return dataclasses.replace(obj, **changed) if changed else obj
    if isinstance(obj, tuple) and obj and not isinstance(obj[0], (int, float)):
        items = tuple(_rewrite(v, fn) for v in obj)
        return items if any(a is not b for a, b in zip(items, obj)) else obj
    return obj
