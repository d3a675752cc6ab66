"""Gradient values lost to zero at the used scale, against a reference backward."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Optional

from ..records import (
    ModuleInfo,
    PassTrace,
)
from .findings import UnderflowFinding, UnderflowSpot
from .origin import param_owners


def lost_gradients(
    at_scale: PassTrace, references: Iterable[PassTrace], modules: Iterable[ModuleInfo], reference: str
) -> Optional[UnderflowFinding]:
    """Parameter-gradient values nonzero in a reference backward and zero at the used scale.

    Underflowed values are already zero in the run itself, so the reference is another backward: per
    parameter, the largest nonzero count seen in any pass where that gradient was finite.
    """
    best: dict[str, int] = {}
    for trace in (at_scale, *references):
        for name, stats in trace.param_grads().items():
            if stats.is_finite and stats.nonzero_count is not None:
                best[name] = max(best.get(name, 0), stats.nonzero_count)
    owners = param_owners(modules)
    lost_by_module: dict[str, int] = defaultdict(int)
    ref_by_module: dict[str, int] = defaultdict(int)
    for name, stats in at_scale.param_grads().items():
        if name not in best or not stats.is_finite or stats.nonzero_count is None:
            continue
        module = owners.get(name, name)
        lost_by_module[module] += max(0, best[name] - stats.nonzero_count)
        ref_by_module[module] += best[name]
    if not ref_by_module:
        return None
    spots = [UnderflowSpot(m, lost_by_module[m], ref_by_module[m]) for m in ref_by_module if lost_by_module[m]]
    spots.sort(key=lambda s: (-s.share, -s.lost))
    return UnderflowFinding(reference, sum(lost_by_module.values()), sum(ref_by_module.values()), tuple(spots))

