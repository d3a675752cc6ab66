"""What the recommendation rules and the verification re-runs read: one record each, defined apart from the rules
and the verifiers so that their helper modules (``rules_rewrites``, ``rules_upcast``, ``verify_upcast``) can name
them without importing the modules that import them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

from torch import nn

from ..analysis import Findings, Origin
from ..records import FormatLimits, ModuleInfo, PassTrace, RunInfo
from ..thresholds import MARGIN_BITS
from .overflows import OpKey

__all__ = ["Context", "RunFn", "VerifyContext"]

RunFn = Callable[[float], PassTrace]


@dataclass(frozen=True)
class Context:
    """What every rule reads: the findings, the run's facts, the modules (with their parameters)."""

    findings: Findings
    run: RunInfo
    modules: tuple[ModuleInfo, ...] = ()
    margin_bits: float = MARGIN_BITS  # a recommended loss scale keeps this many bits below the largest finite one

    @property
    def fwd(self) -> Optional[Origin]:
        return self.findings.forward_origin

    @property
    def bwd(self) -> Optional[Origin]:
        return self.findings.backward_origin

    @property
    def float16(self) -> bool:
        return self.run.limits.dtype == "float16"

    def broken_weights(self) -> list[str]:
        """Parameters of the origin module that already hold inf/NaN."""
        origin = self.fwd or self.bwd
        if origin is None:
            return []
        return [p.name for m in self.modules if m.name == origin.module for p in m.params if not p.stats.is_finite]


@dataclasses.dataclass
class VerifyContext:
    """What verification needs from the diagnosis: the live model and ways to re-run its step."""

    root: nn.Module
    modules: list[ModuleInfo]
    baseline: PassTrace  # the survey at the used scale, without fixes
    low_dtype: str
    run: RunFn  # a survey pass at a scale, same RNG and buffers as the diagnosis
    run_other_dtype: Optional[RunFn]  # the same in bfloat16 (None when not applicable)
    device_type: str = "cpu"  # the autocast device of the user's loop (for snippets)
    # The unchanged step at a scale, served from the passes the diagnosis already ran when it has one.
    run_unchanged: Optional[RunFn] = None
    limits: Optional[FormatLimits] = None  # the format's limits (None: no margin or mechanism check)
    margin_bits: float = MARGIN_BITS
    # (module, call, op, occurrence) of ops the survey flagged and the diagnosis's classifying re-run found to be
    # mask arithmetic only (sentinel_ops()): flagged again by a verification re-run, they are not overflows.
    sentinel_ops: frozenset[OpKey] = frozenset()
