"""Mechanisms, not instances: the calls that run the same code (same module class, same place in a repeated
structure: ``blocks.0.attn``, ``blocks.1.attn``) are one mechanism, and a remedy covers every instance that
overflows, hides an overflow, or sits inside the margin. Pure: records in, findings out.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

from ..records import FormatLimits, PassTrace
from .margin import call_headroom
from .origin import forward_creators

_INDEX = re.compile(r"(?:(?<=\.)|^)\d+(?=\.|$)")


def pattern_of(module: str) -> str:
    """The module's name with the indices of repeated structures as ``*``: ``blocks.*.attn``."""
    return _INDEX.sub("*", module)


@dataclass(frozen=True)
class Instance:
    module: str
    reason: str  # "overflows", "hides an overflow", "0.17 bits to spare", or "" (has margin)
    headroom_bits: float  # smallest headroom of its low-precision outputs (inf when none measured)


@dataclass(frozen=True)
class Mechanism:
    """The instances of one mechanism in a pass: same class, same name pattern; who needs the remedy and why."""

    class_name: str
    pattern: str
    instances: tuple[Instance, ...]

    @property
    def needing(self) -> tuple[str, ...]:
        return tuple(i.module for i in self.instances if i.reason)

    def sentence(self, covered: Optional[Iterable[str]] = None) -> str:
        """'2 SelfAttention instances (blocks.*.attn) run this code; 2 of 2 need it (...)'. ``covered``: the
        instances a remedy found it needed (default: those that need it in this pass)."""
        names = {i.module for i in self.instances}
        need = [m for m in covered if m in names] if covered is not None else list(self.needing)
        reasons = {i.module: i.reason for i in self.instances}
        why = ", ".join(f"{m}: {reasons[m]}" if reasons[m] else m for m in need)
        n = len(self.instances)
        return f"{n} {self.class_name} instances ({self.pattern}) run this code; {len(need)} of {n} need it" + (
            f" ({why})" if why else ""
        )


def low_precision_headroom(trace: PassTrace, module: str, limits: FormatLimits) -> tuple[bool, float]:
    """(finite, smallest headroom) over the module's calls' low-precision outputs and their own ops' peaks in
    ``trace`` (sentinels left out: see ``analysis.margin``)."""
    finite, least = True, math.inf
    for c in trace.calls:
        if c.module != module:
            continue
        finite = finite and all(
            r.stats.is_finite for r in c.outputs if r.stats.measured and r.stats.dtype == limits.dtype
        )
        least = min([least, *(bits for _, _, bits in call_headroom(trace, c, limits))])
    return finite, least


def mechanism_of(
    trace: PassTrace,
    module: str,
    limits: FormatLimits,
    margin_bits: float,
    hiding: Iterable[str] = (),
) -> Optional[Mechanism]:
    """The mechanism ``module`` belongs to (None for the root and for names outside the trace). ``hiding``: modules
    with a hidden overflow in ``trace`` (analysis.hidden's findings)."""
    classes = {c.module: c.class_name for c in trace.calls}
    if not module or module not in classes:
        return None
    pattern, cls, hidden = pattern_of(module), classes[module], set(hiding)
    # Overflowing means making the value (a creator), not receiving it from an earlier instance (propagation).
    creators = {c.module for c in forward_creators(trace)}
    instances = []
    for name in dict.fromkeys(c.module for c in trace.calls):
        if classes[name] != cls or pattern_of(name) != pattern:
            continue
        finite, bits = low_precision_headroom(trace, name, limits)
        if not finite and name in creators:
            reason = "overflows"
        elif not finite:
            reason = ""  # carries an earlier call's bad values: whether it needs the remedy shows after the fix
        elif name in hidden:
            reason = "hides an overflow"
        elif bits < margin_bits:
            reason = f"{bits:.2f} bits to spare"
        else:
            reason = ""
        instances.append(Instance(name, reason, bits))
    return Mechanism(cls, pattern, tuple(instances))
