"""ampdoctor: find out why PyTorch automatic mixed precision (AMP) training breaks, and what to change.

>>> report = ampdoctor.diagnose(model, inputs, loss_fn=lambda out, _: criterion(out, targets), scaler=scaler)
>>> print(report)                     # verdict, origin module and op, near-limit layers, recommendations
>>> report.forward_origin.module      # the module whose own code first made inf/NaN

Reports, analysis and rendering import no torch: ``Report.from_json`` works on a machine without it.
The names that need torch are imported on first use.
"""

from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (
    AmpDoctorError,
    CheckpointError,
    CheckpointRefused,
    InternalError,
    InvalidInput,
    ModelRaised,
    OutOfMemory,
)
from .records import Recommendation
from .report import Report

if TYPE_CHECKING:
    from .api import diagnose
    from .checkpoint.scan import scan
    from .fixes.fallback import Fp32Fallback, fp32_fallback
    from .fixes.upcast import Fp32Op, fp32_op
    from .report.scan_report import ScanReport
    from .training.replay import replay_bundle
    from .training.runtime import Watch, watch

# Names that need torch, imported on first use (Report, ScanReport and the errors do not).
_LAZY = {
    "diagnose": "api",
    "fp32_fallback": "fixes.fallback",
    "Fp32Fallback": "fixes.fallback",
    "fp32_op": "fixes.upcast",
    "Fp32Op": "fixes.upcast",
    "scan": "checkpoint.scan",
    "ScanReport": "report.scan_report",
    "watch": "training.runtime",
    "Watch": "training.runtime",
    "replay_bundle": "training.replay",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'ampdoctor' has no attribute {name!r}")


def __dir__() -> list[str]:
    """What tab completion offers: the public names, the lazily imported ones included."""
    return sorted({*globals(), *_LAZY})


__all__ = [
    "AmpDoctorError",
    "CheckpointError",
    "CheckpointRefused",
    "Fp32Fallback",
    "Fp32Op",
    "InternalError",
    "InvalidInput",
    "ModelRaised",
    "OutOfMemory",
    "Recommendation",
    "Report",
    "ScanReport",
    "Watch",
    "__version__",
    "diagnose",
    "fp32_fallback",
    "fp32_op",
    "replay_bundle",
    "scan",
    "watch",
]
