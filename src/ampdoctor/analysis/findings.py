"""What analysis finds: origins, near-limit tensors, underflow, loss-scale and precision findings (records)."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Optional

from ..records import (
    BATCH,
    LOSS,
    Comparison,
    Direction,
    FrozenMap,
    OpFinding,
    TensorStats,
    Verdict,
    call_label,
)
from ..thresholds import SCALE_WINDOW_LOSS_SHARE
from .hidden import HiddenOverflow

# Ops whose non-finite result comes from a pole (log(0), 1/0), not from running out of range: "nan" verdict.
POLE_OPS = frozenset(
    {"aten::log", "aten::log2", "aten::log10", "aten::reciprocal", "aten::rsqrt", "aten::xlogy", "aten::digamma"}
)



@dataclass(frozen=True)
class Origin:
    """Where a non-finite value was first made: a module call, the loss function, or the batch itself."""

    direction: Direction
    module: str  # qualified name; LOSS or BATCH outside the model
    call: int
    class_name: str
    tensor: str  # path of the first non-finite tensor it made
    bad: TensorStats  # that tensor's statistics
    input_abs_max: Optional[float]  # largest finite input (forward) or incoming gradient (backward) magnitude
    op: Optional[OpFinding] = None
    exact: bool = True  # False when the rule could not place it and the first non-finite call is named instead
    event_order: Optional[int] = None  # backward: ``order`` of the gradient event that proves it
    # Diagnosed under CPU autocast with an op CUDA runs in float32: this finding may not happen on CUDA.
    policy_note: str = ""

    @property
    def label(self) -> str:
        return call_label(self.module, self.call) if self.module not in (LOSS, BATCH) else self.module


@dataclass(frozen=True)
class NearLimit:
    """A tensor within ``HEADROOM_WARN_BITS`` of the format's max (still finite)."""

    module: str
    call: int
    tensor: str  # "out", "param:weight", "grad:out" ...
    abs_max: float
    headroom_bits: float

    @property
    def label(self) -> str:
        return call_label(self.module, self.call)


@dataclass(frozen=True)
class UnderflowSpot:
    module: str
    lost: int  # gradient values nonzero in the reference, zero at the used scale
    reference_nonzero: int

    @property
    def share(self) -> float:
        return self.lost / self.reference_nonzero if self.reference_nonzero else 0.0


@dataclass(frozen=True)
class UnderflowFinding:
    """Parameter-gradient values lost to zero at the used scale, against a reference backward."""

    reference: str  # how the reference was made
    lost: int
    reference_nonzero: int
    spots: tuple[UnderflowSpot, ...] = ()

    @property
    def share(self) -> float:
        return self.lost / self.reference_nonzero if self.reference_nonzero else 0.0


@dataclass(frozen=True)
class ScaleProbe:
    scale: float
    gradients_finite: bool


@dataclass(frozen=True)
class ScaleFinding:
    """Gradients non-finite at the used scale: at which lower power-of-two scale do they become finite?"""

    used_scale: float
    probes: tuple[ScaleProbe, ...]
    largest_finite_scale: Optional[float]  # None: non-finite even at scale 1
    lost_share_at_largest: Optional[float]  # share of gradient values lost to zero at that scale
    # The lowest scale seen non-finite: the backward origin is placed there, where the first gradient to
    # overflow is alone (at the used scale, the loss gradient itself may already be inf in float16).
    analysed_scale: Optional[float] = None

    @property
    def harmless(self) -> bool:
        return (
            self.largest_finite_scale is not None
            and self.lost_share_at_largest is not None
            and self.lost_share_at_largest < SCALE_WINDOW_LOSS_SHARE
        )


@dataclass(frozen=True)
class WindowProbe:
    scale: float
    gradients_finite: bool
    lost_share: Optional[float]  # share of reference-nonzero gradient values that are zero at this scale


@dataclass(frozen=True)
class ScaleWindow:
    """Loss scales that neither overflow (``<= max_safe``) nor lose >= 1 % of gradient values (``>= min_useful``)."""

    current: float
    max_safe: Optional[float]  # largest power of two with finite gradients (None: not even scale 1)
    min_useful: Optional[float]  # smallest power of two losing < 1 % (None: none does)
    probes: tuple[WindowProbe, ...]
    module_min_useful: FrozenMap[str, float]  # per module with parameters: smallest probed scale losing < 1 %
    reference: str
    # False when predicted from the survey alone (``scale_window="auto"``): the probes are then arithmetic on the
    # survey's records, not re-runs.
    measured: bool = True

    @property
    def empty(self) -> bool:
        """float16's range is too narrow for this model: no scale both avoids overflow and keeps gradients."""
        return self.max_safe is None or self.min_useful is None or self.min_useful > self.max_safe

    @property
    def contains_current(self) -> bool:
        return not self.empty and self.min_useful is not None and self.max_safe is not None and (
            self.min_useful <= self.current <= self.max_safe
        )


@dataclass(frozen=True)
class PrecisionFinding:
    """Each compared call against its own float32 re-run (``diagnose(..., reference=True)``)."""

    comparisons: tuple[Comparison, ...]
    jump: Optional[str]  # the call whose relative error stands out (>= JUMP_FACTOR x the median), if any
    underflow_calls: tuple[str, ...]  # calls with outputs nonzero in float32 but zero in the low precision


# A call's relative error "jumps" when it is at least this many times the median over compared calls.

GrowthKind = typing.Literal["weights", "activations"]


@dataclass(frozen=True)
class Growth:
    """A module's weights (norm) or low-precision activations (abs max) growing between two steps."""

    module: str
    what: GrowthKind
    before: float
    after: float
    from_step: int
    to_step: int

    @property
    def factor(self) -> float:
        return self.after / self.before if self.before > 0 else float("inf")


@dataclass(frozen=True)
class Divergence:
    """Training diverged into a run of skipped steps (``ampdoctor.watch``): the loss left its range, or a layer's
    weights or activations grew fast, shortly before. Not harmless: GradScaler backing off does not fix it."""

    began: int  # the first step whose loss left its range (else the first sample that showed the growth)
    skipped_from: int  # the first step of the run of bad steps it led to
    loss_median: Optional[float]  # the median of the recent losses before ``began``
    loss_peak: Optional[float]  # the largest loss from ``began`` on (inf or NaN when the loss went non-finite)
    peak_step: Optional[int]
    growth: tuple[Growth, ...]  # the modules that grew fastest, fastest first
    advice: tuple[str, ...]  # what to try


@dataclass(frozen=True)
class Findings:
    verdict: Verdict
    forward_origin: Optional[Origin]
    backward_origin: Optional[Origin]
    propagation: tuple[str, ...]  # labels of calls after the origin with non-finite outputs, in completion order
    near_limit: tuple[NearLimit, ...]
    underflow: Optional[UnderflowFinding]
    scale: Optional[ScaleFinding]
    not_captured: tuple[str, ...]  # calls whose output gradient was expected but never observed
    warnings: tuple[str, ...] = ()
    window: Optional[ScaleWindow] = None
    precision: Optional[PrecisionFinding] = None
    divergence: Optional[Divergence] = None  # ampdoctor.watch: a run of skipped steps that a divergence led into
    # Ops that made inf/NaN from finite inputs inside a call whose output stayed finite: never healthy.
    hidden: tuple[HiddenOverflow, ...] = ()

