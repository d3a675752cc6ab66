"""ampdoctor: find out why PyTorch automatic mixed precision (AMP) training breaks, and what to change.

>>> report = ampdoctor.diagnose(model, inputs, loss_fn=lambda out, _: criterion(out, targets), scaler=scaler)
>>> print(report)                     # verdict, origin module and op, near-limit layers, recommendations
>>> report.forward_origin.module      # the module whose own code first made inf/NaN

Reports, analysis and rendering import no torch: ``Report.from_json`` works on a machine without it.
The names that need torch are imported on first use.
"""

from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import AmpDoctorError
from .report import Recommendation, Report

if TYPE_CHECKING:
    from .api import diagnose
    from .fixes import Fp32Fallback, fp32_fallback
    from .stats import tensor_stats

_LAZY = {
    "diagnose": "api",
    "fp32_fallback": "fixes",
    "Fp32Fallback": "fixes",
    "tensor_stats": "stats",
    "scan": "checkpoint",
    "watch": "watch",
    "replay_bundle": "watch",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'ampdoctor' has no attribute {name!r}")


__all__ = [
    "AmpDoctorError",
    "Fp32Fallback",
    "Recommendation",
    "Report",
    "__version__",
    "diagnose",
    "fp32_fallback",
    "replay_bundle",
    "scan",
    "tensor_stats",
    "watch",
]
