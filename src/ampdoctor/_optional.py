"""Optional dependencies, imported on first use with an error that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import AmpDoctorError

NOTEBOOK_EXTRA = "pip install 'ampdoctor[notebook]'"


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature`` (e.g. ``"report.plot()"``), or say which extra provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        raise AmpDoctorError(f"{feature} needs {top}, which is not installed: {NOTEBOOK_EXTRA}") from exc
