"""Pure analysis of recorded passes (no torch: a test checks it; it works on a report loaded from JSON).

``findings`` (the records analysis produces), ``origin`` (forward/backward origins, masks, propagation),
``headroom``, ``underflow``, ``precision``, ``scale`` (loss-scale probes and window, through a runner callback),
``analyze`` (everything together).
"""

from .analyze import analyze
from .findings import (
    Divergence,
    Findings,
    Growth,
    NearLimit,
    Origin,
    PrecisionFinding,
    ScaleFinding,
    ScaleProbe,
    ScaleWindow,
    UnderflowFinding,
    UnderflowSpot,
    WindowProbe,
)
from .headroom import headroom_bits, near_limit
from .origin import backward_origin, classify, forward_creators, forward_origin, is_fill_mask, is_mask, origin_event

__all__ = [
    "Divergence",
    "Findings",
    "Growth",
    "NearLimit",
    "Origin",
    "PrecisionFinding",
    "ScaleFinding",
    "ScaleProbe",
    "ScaleWindow",
    "UnderflowFinding",
    "UnderflowSpot",
    "WindowProbe",
    "analyze",
    "backward_origin",
    "classify",
    "forward_creators",
    "forward_origin",
    "headroom_bits",
    "is_fill_mask",
    "is_mask",
    "near_limit",
    "origin_event",
]
