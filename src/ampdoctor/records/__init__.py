"""Typed, frozen records of one instrumented AMP step, and of what ampdoctor recommends.

Nothing here imports torch: a saved report can be re-analysed and re-rendered without it.
Gradient statistics are stored *unscaled* (divided by the loss scale of their pass); counts are unaffected.
Records hold tuples and :class:`FrozenMap` objects, never lists or dicts, so every record (a whole Report too)
is hashable; records that may hold NaN compare NaN fields as equal, so ``Report.from_json(r.to_json()) == r``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Literal, Optional

from .frozen import FrozenMap, NanEq
from .tensor_stats import TensorStats as TensorStats
from .tensor_stats import survey_stats as survey_stats

# A name for things outside any module: the loss function and the batch.
LOSS = "<loss>"
BATCH = "<batch>"

# What the strings mean.
Verdict = Literal["healthy", "overflow", "nan", "underflow", "scale_overflow", "hidden_overflow"]
Direction = Literal["forward", "backward"]
GradKind = Literal["output", "input", "param"]  # a gradient w.r.t. a call's output or input, or a parameter's
Action = Literal[
    "fp32_fallback",  # run named modules in float32
    "loss_scale",  # change GradScaler's scale
    "bf16",  # autocast to bfloat16
    "mask_constant",  # a fill constant that fits the format
    "keep_in_fp32",  # Hugging Face _keep_in_fp32_modules
    "fix_code",  # compute one op in float32 (the origin is the root's own code)
    "fp32_op",  # run one op of named modules in float32 (ampdoctor.fp32_op), without editing code
    "rewrite",  # a code-level rewrite of the origin's line (log(sigmoid(x)) -> F.logsigmoid(x), ...)
    "fix_batch",  # the batch holds inf/NaN
    "fix_loss",  # the loss function made it
    "fix_weights",  # the weights are already non-finite
]
RunStatus = Literal["harmless", "persistent", "open"]  # a run of skipped training steps

@dataclass(frozen=True)
class FormatLimits:
    """Limits of the low-precision format under diagnosis (from ``torch.finfo``), with exact rounding edges."""

    dtype: str
    max: float  # largest finite value (65504 for float16)
    tiny: float  # smallest normal (2**-14 for float16)
    smallest_subnormal: float  # 2**-24 for float16
    overflow_threshold: float  # |x| >= this rounds to inf when cast (65520 for float16)
    flush_threshold: float  # 0 < |x| <= this rounds to zero when cast (2**-25 for float16)


# ``slots=`` is a dataclass option from Python 3.10 on; 3.9 (still supported) gets plain instances.
_SLOTS: dict[str, bool] = {"slots": True} if sys.version_info >= (3, 10) else {}

# A pass makes these by the ten thousand on a model of many small modules: ``slots=True`` (no instance dict) takes
# about 48 bytes less each (80 bytes for a TensorRecord, 88 for a GradEvent); so do ModuleInfo and ParamRecord.
@dataclass(frozen=True, **_SLOTS)
class TensorRecord:
    """One tensor seen at a module boundary: where it sits (``path``) and its statistics."""

    path: str  # "args[0]", "kwargs['mask']", "out", "out[0]", "out['logits']", "out.hidden"
    stats: TensorStats
    requires_grad: bool = False
    producer: Optional[int] = None  # index of the earlier call that returned this very tensor
    ref: int = -1  # same ref within a pass: the same tensor object at the same version
    producer_path: str = ""  # where in the producer's output it sat ("out", "out[0]", ...)


@dataclass(frozen=True, **_SLOTS)
class ParamRecord:
    name: str  # fully qualified, as in named_parameters()
    stats: TensorStats
    requires_grad: bool = True


@dataclass(frozen=True, **_SLOTS)
class ModuleInfo:
    name: str  # "" is the root
    class_name: str
    params: tuple[ParamRecord, ...] = ()  # the module's own parameters (recurse=False)


@dataclass(frozen=True, **_SLOTS)
class ModuleCall:
    index: int  # order of start
    module: str
    call: int  # 0, 1, ... for a module called several times
    class_name: str
    parent: Optional[int]
    end_order: int  # order of completion
    inputs: tuple[TensorRecord, ...] = ()
    outputs: tuple[TensorRecord, ...] = ()
    grad_enabled: bool = True  # False: ran under no_grad (a reentrant checkpoint's first forward)

    @property
    def label(self) -> str:
        return call_label(self.module, self.call)


def call_label(module: str, call: int) -> str:
    name = module if module else "<root>"
    return f"{name}#{call}" if call else name


@dataclass(frozen=True, **_SLOTS)
class GradEvent:
    """A gradient seen during backward, in execution order.

    ``kind``: "output" (gradient w.r.t. a call's output), "input" (w.r.t. a call's input) or "param".
    """

    order: int
    kind: GradKind
    stats: TensorStats  # unscaled
    call: Optional[int] = None
    path: str = ""
    param: Optional[str] = None
    via_base: bool = False  # captured on the view's base tensor (see capture)


@dataclass(frozen=True)
class SourceLocation:
    file: str
    line: int
    function: str
    code: str


@dataclass(frozen=True)
class OpFinding:
    """The op whose non-finite result reached the bad output (see ``capture.zoom``): made from the inputs it used.

    Forward: inside the origin call, ``location`` is the line that ran the op. Backward: ``node`` is the
    autograd node that ran it (``ExpBackward0``) and ``location`` the forward line that created that node.
    """

    op: str  # "aten::bmm"
    module: str
    call: int
    input_dtypes: tuple[str, ...]
    input_abs_max: tuple[Optional[float], ...]
    output_dtype: str
    output_nan_count: int
    output_posinf_count: int
    output_neginf_count: int
    location: Optional[SourceLocation] = None
    direction: Direction = "forward"
    node: Optional[str] = None
    scalar_args: tuple[float, ...] = ()  # Python numbers passed to the op (fill constants)
    # Ops of the same call (in op order) that made non-finite values which never reached the bad output:
    # discarded (torch.where, nan_to_num, masked_fill, turned into integers) or never used. A note, never the
    # origin: fixing one of them leaves the output as it is.
    discarded: tuple[OpFinding, ...] = ()
    # Backward: no backward op made the value; this node read a non-finite value its forward saved (a NaN the
    # forward made and threw away, in the untaken branch of a ``torch.where``) and passed it on.
    from_saved: bool = False


@dataclass(frozen=True)
class OpOverflow:
    """A float16/bfloat16 op that made inf or NaN from finite inputs during the forward (``capture.hidden``).

    Recorded whether or not a later op hid the values; analysis calls it *hidden* when the module call's (or
    the loss's) output stayed finite. Sentinels are never counted: fills (``masked_fill``, ``where``, a
    ``finfo.min`` fill) make nothing, and once ``classified``, elements where an operand of the arithmetic was
    already at or beyond the format's max (an additive ``finfo.min`` mask overflowing to ``-inf``) are in
    ``sentinels``, not in ``count``. The survey only flags an op (``count`` None); the re-run that classifies it
    counts exactly and names its source line.
    """

    module: str  # the innermost module call running the op; LOSS for the loss function
    call: int
    call_index: Optional[int]  # index into the pass's calls; None for the loss
    op: str  # "matmul" (``q @ k``, ``torch.matmul``), "exp", "add", "pow"
    function: str  # what the code called: "Tensor.__matmul__", "torch.exp", "F.linear"
    # 0-based index among the same-named ops of this call, its children's aside (capture.hidden.counted_op)
    occurrence: int
    dtype: str  # the op's output dtype
    numel: int
    count: Optional[int] = None  # elements made non-finite (sentinels excluded); None: flagged, not counted
    sentinels: int = 0  # non-finite elements that are mask arithmetic (classified ops only)
    classified: bool = False  # counted and classified per element (the re-run), not only flagged (the survey)
    hidden_by: str = ""  # the first op that consumed the values and gave a finite (or float32) result
    location: Optional[SourceLocation] = None

    @property
    def label(self) -> str:
        return call_label(self.module, self.call) if self.module != LOSS else LOSS


@dataclass(frozen=True)
class OpPeak:
    """The largest finite magnitude a module call's own low-precision ops produced in the forward (``capture``
    reads it from the hidden-overflow watch's reductions), kept only when it is larger than the call's
    low-precision outputs show: the attention scores inside ``blocks.0.attn``. Ops of child calls count for the
    child; outputs holding inf/NaN are overflows (``OpOverflow``), not peaks; elementwise arithmetic on an operand
    at or beyond the format's max (mask arithmetic) and fills are left out (sentinels, not values)."""

    call_index: int  # index into the pass's calls
    abs_max: float
    op: str  # the op that made it: "matmul", "exp", "add"
    occurrence: int = 0  # its index among the same-named ops of this call (as ``OpOverflow.occurrence``)


@dataclass(frozen=True, eq=False)
class Comparison(NanEq):
    """One call's low-precision output against the same call re-run in float32 on its own inputs."""

    module: str
    call: int
    path: str  # which output
    relative_error: float  # ||low - ref|| / ||ref||
    sqnr_db: float  # 10 log10(||ref||^2 / ||low - ref||^2)
    underflow_count: int  # values nonzero in float32 but zero in the low-precision output
    reference_nonzero: int

    @property
    def label(self) -> str:
        return call_label(self.module, self.call)


@dataclass(frozen=True)
class PassTrace:
    """Everything recorded in one forward (+ backward) pass."""

    scale: float
    detailed: bool
    calls: tuple[ModuleCall, ...]
    grad_events: tuple[GradEvent, ...]
    batch: tuple[TensorRecord, ...]
    output: tuple[TensorRecord, ...]
    loss: Optional[TensorStats]
    backward_ran: bool
    op_finding: Optional[OpFinding] = None
    backward_op_finding: Optional[OpFinding] = None
    comparisons: tuple[Comparison, ...] = ()  # diagnose(..., reference=True)
    notes: tuple[str, ...] = ()  # what went wrong inside this pass without stopping it
    autocast: bool = True  # autocast was really in effect during the forward
    uncaptured: tuple[str, ...] = ()  # calls re-run by checkpointing whose gradient could not be captured
    op_overflows: tuple[OpOverflow, ...] = ()  # forward ops that made inf/NaN from finite inputs (capture.hidden)
    op_peaks: tuple[OpPeak, ...] = ()  # calls whose own ops peaked above their low-precision outputs
    # (root call, output path) of returned tensors the forward's own ops also consumed (a KV cache): their
    # gradients are partly the model's own, not only the loss's
    used_inside: tuple[tuple[int, str], ...] = ()
    low_ops: int = 0  # forward ops seen producing the low-precision dtype (inside modules too: x @ W + b)
    unmeasured: int = 0  # module calls and ops inside torch.func transforms (vmap): their values not measured

    def param_grads(self) -> dict[str, TensorStats]:
        return {e.param: e.stats for e in self.grad_events if e.kind == "param" and e.param is not None}

    def gradients_finite(self) -> bool:
        # Asked by several analyses of one diagnosis: walked once per record (records never change), kept beside
        # the fields (not one of them: equality, hashing and JSON ignore it).
        found = self.__dict__.get("_gradients_finite")
        if found is None:
            found = all(e.stats.is_finite for e in self.grad_events)
            object.__setattr__(self, "_gradients_finite", found)
        return found

    def bad_output_calls(self) -> tuple[ModuleCall, ...]:
        """Calls with a measured, non-finite output, in start order: none in a healthy pass (walked once per record,
        kept beside the fields like :meth:`gradients_finite`; asked by the origin, the rows and the mechanisms)."""
        found = self.__dict__.get("_bad_output_calls")
        if found is None:
            found = tuple(c for c in self.calls if any(r.stats.measured and not r.stats.is_finite for r in c.outputs))
            object.__setattr__(self, "_bad_output_calls", found)
        return found

    def forward_finite(self) -> bool:
        """The loss and the model's outputs are finite."""
        return self.loss is not None and self.loss.is_finite and all(r.stats.is_finite for r in self.output)

    def forward_healthy(self) -> bool:
        """Loss and outputs finite, and no call output with NaN or +inf (one holding only ``-inf`` may be a mask)."""
        if not self.forward_finite():
            return False
        found = self.__dict__.get("_outputs_healthy")
        if found is None:  # NaN or +inf makes a record non-finite: only the bad-output calls can hold one
            found = not any(
                r.stats.measured and (r.stats.has_nan or r.stats.has_posinf)
                for c in self.bad_output_calls()
                for r in c.outputs
            )
            object.__setattr__(self, "_outputs_healthy", found)
        return found

    def healthy(self) -> bool:
        """The one definition of a healthy pass: a healthy forward and, when the backward ran, finite gradients."""
        return self.forward_healthy() and (not self.backward_ran or self.gradients_finite())

    def overflow_free(self) -> bool:
        """Healthy, and no op made inf/NaN from finite inputs either, not even one a later op hid (a flagged op
        counts until a classifying re-run finds only sentinels): what a verified remedy's re-run must be."""
        return self.healthy() and not any(o.count != 0 for o in self.op_overflows)


@dataclass(frozen=True, eq=False)
class StepRecord(NanEq):
    """One optimizer step seen by ``ampdoctor.watch`` (gradient statistics unscaled, like everywhere else)."""

    step: int
    scale: float  # the scale used for this step's backward
    skipped: bool  # GradScaler found inf/NaN and skipped the optimizer step
    loss: Optional[float] = None
    rank: int = 0
    forward_finite: bool = True
    forward_origin: Optional[str] = None  # label of the forward origin call, when the step was captured
    backward_origin: Optional[str] = None
    nonfinite_params: tuple[str, ...] = ()  # parameters with inf/NaN gradients (a capture's, or the check below)
    new_scale: Optional[float] = None  # the scale after update()
    micro_batches: int = 0  # training forwards of the root module folded into this step (gradient accumulation)
    sampled: bool = False  # per-module statistics were taken on this step
    # Sampled steps: largest finite |x| per module over its low-precision outputs / output gradients (unscaled).
    out_abs_max: FrozenMap[str, float] = field(default_factory=FrozenMap)
    grad_abs_max: FrozenMap[str, float] = field(default_factory=FrozenMap)
    nonfinite_outputs: tuple[str, ...] = ()  # modules with inf/NaN outputs, completion order
    nonfinite_grads: tuple[str, ...] = ()  # modules with inf/NaN output gradients, backward order
    local_nonfinite: bool = False  # this rank's own forward or pre-reduction gradients went non-finite
    # False: no GradScaler checked this step (bfloat16, a disabled scaler) and a parameter's gradient held inf/NaN
    # at its end (the optimizer applies it); nonfinite_params names them
    grads_finite: bool = True
    grads_nan: bool = False  # of those gradients, some held NaN and none inf
    captured: bool = False  # a full capture (diagnose of the failing inputs) ran on this step
    capture_verdict: Optional[Verdict] = None
    explained_by: Optional[int] = None  # a skipped step not captured itself: the step whose capture explains it
    run: Optional[RunStatus] = None  # in a run of skipped steps (set by report())
    # L2 norm of each module's own parameters (this rank's shard under FSDP), on sampled steps and on the first
    # step of each run of bad steps: how fast weights grow before a divergence.
    weight_norm: FrozenMap[str, float] = field(default_factory=FrozenMap)

    @property
    def unguarded(self) -> bool:
        """Its gradients held inf/NaN and nothing skipped it (no enabled GradScaler): the optimizer applies them."""
        return not self.grads_finite and not self.skipped

    @property
    def checked_params(self) -> tuple[str, ...]:
        """The parameters the step's own gradient check named (without an enabled scaler); else none."""
        return () if self.grads_finite else self.nonfinite_params


PassStatus = Literal["ran", "failed", "skipped"]


@dataclass(frozen=True)
class PassRecord:
    """One pass a diagnosis ran (or tried): what it was for, at which scale and dtype, and how it went."""

    purpose: str  # "survey", "detail and op zoom", "scale probe", "float32 reference", ...
    scale: float
    dtype: str  # the autocast dtype, or "float32" for a pass with autocast off
    status: PassStatus = "ran"
    reason: str = ""  # why it failed or was skipped (one line)
    seconds: float = field(default=0.0, compare=False)  # run-to-run: kept out of equality and golden files


@dataclass(frozen=True)
class RunInfo:
    """Facts of the run that a reader needs to trust (or distrust) the findings."""

    torch_version: str
    ampdoctor_version: str
    device: str
    device_type: str
    limits: FormatLimits
    scale: float
    scale_source: str
    loss_source: str
    model_class: str
    autocast_note: str
    notes: tuple[str, ...] = ()
    huggingface: bool = False  # a transformers PreTrainedModel (has _keep_in_fp32_modules)
    # Facts about this machine that change what the report means (shown first): a disabled scaler, ...
    environment: tuple[str, ...] = ()
    backward_checked: bool = True  # False: no gradient was computed (the report covers the forward only)
    backward_note: str = ""  # why no gradient was computed
    passes: tuple[PassRecord, ...] = ()
    policy: str = "native"  # "native" (torch.autocast on device_type) or "cuda_emulated" (CUDA lists on CPU)
    # Non-empty when the batch was drawn at random (the CLI's --input-shape): what was drawn, e.g.
    # "8x32x16 float32, seed 0". The verdict then says nothing about real data; every renderer says so first.
    random_input: str = ""


@dataclass(frozen=True)
class Cost:
    """What a float32 fallback costs, estimated from the captured shapes."""

    extra_activation_bytes: int  # outputs of the fallback calls held in float32 instead of the low dtype
    fp32_matmul_flop_share: float  # share of the model's Linear/Conv FLOPs that move to float32
    note: str = ""


@dataclass(frozen=True)
class Recommendation:
    """One thing to change. ``modules`` names module calls' modules as in the report (``""`` is the root)."""

    action: Action
    modules: tuple[str, ...]
    title: str
    snippet: str
    verified: bool = False  # True only when a re-run with the change applied came out finite
    evidence: str = ""  # what the verification run showed (or why there was none)
    cost: Optional[Cost] = None
    rule: str = ""  # the name of the rule that proposed it (fixes.rules.RULES); "" in older reports
