"""What the watch keeps of one training step, and the step's single read-back into a :class:`StepRecord`.

During a step the hooks only queue device values (a loss, the aminmax pairs of outputs and gradients, the scale,
GradScaler's found-inf flags) in a :class:`~.collector.Collector`; ``scaler.update`` reads them all back at once
(``update`` synchronises anyway) and :func:`step_record` turns the numbers into the step's record.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from ..capture import sharded
from ..capture.cleanup import uninterrupted
from ..capture.state import RngState
from ..capture.walk import iter_tensors
from ..records import FrozenMap, StepRecord
from .collector import SCATTER_PAIRS, Collector, Folded, Pair, PairKey, PairKind, bad_pair, fold_pairs
from .fastpath import Slabs, remove_handles

__all__ = [  # the collector's names, for the modules and tests that import them from here
    "SCATTER_PAIRS", "Collector", "Folded", "Pair", "PairKey", "PairKind", "bad_pair", "fold_pairs",
]


@dataclass
class MicroBatch:
    """One root forward of the current step (several with gradient accumulation): what a replay needs."""

    args: Any  # the forward's inputs, detached, by reference (no copy per step)
    kwargs: Any
    versions: list[int]  # the inputs' ``_version``: were they modified in place after the forward?
    rng: RngState  # every random stream before the forward: the replay draws the same dropout masks
    targets: Any = None
    loss_slot: Optional[int] = None  # index into the step's collected values
    scaled: bool = False  # scaler.scale (or see_loss) gave this forward's loss
    loss_value: Optional[float] = None  # after the step's read-back
    root_slots: list[int] = field(default_factory=list)  # (lo, hi) pairs of the root outputs: index of each lo
    own_loss: bool = False  # the output carries its loss (scalar, .loss, ['loss']): diagnose finds it
    # sum of the parameters' in-place versions at the forward (did an optimizer step before the step closed?);
    # None with a scaler, whose update closes a step after a skipped (so harmless) optimizer step
    weight_versions: Optional[int] = None
    expected_grads: set[str] = field(default_factory=set)  # output paths whose gradient is kept
    out_grads: dict[str, torch.Tensor] = field(default_factory=dict)  # scaled gradient w.r.t. each output
    not_kept: dict[str, int] = field(default_factory=dict)  # output paths whose gradient was over the cap: bytes

    @classmethod
    def keep(cls, model: torch.nn.Module, args: Any, kwargs: Any, targets: Any, weights: bool) -> MicroBatch:
        """What a root forward of ``model`` leaves for a replay, taken just before it runs: its inputs (detached,
        by reference) and every random stream as it is now (the dropout masks the forward is about to draw).
        ``weights``: fingerprint the parameters too (steps closed by hand may come after an optimizer step)."""
        kept_args, kept_kwargs = detach_tree(args), detach_tree(kwargs) if kwargs else {}
        return cls(
            kept_args, kept_kwargs, tensor_versions(kept_args, kept_kwargs), RngState.capture(), targets=targets,
            weight_versions=weight_versions(model) if weights else None,
        )

    def inputs_changed(self) -> bool:
        """The inputs were modified in place after the forward (a replay sees their later contents)."""
        return tensor_versions(self.args, self.kwargs) != self.versions

    def output_grads(self) -> Optional[dict[str, torch.Tensor]]:
        """The gradient the real loss sent into each output, when every expected one arrived; else None."""
        if not self.expected_grads or set(self.out_grads) != self.expected_grads:
            return None
        return self.out_grads


@dataclass
class StepState:
    """What the hooks gather during one step; the watch starts a fresh one at each step boundary."""

    micro: deque[MicroBatch] = field(default_factory=deque)
    collector: Collector = field(default_factory=Collector)
    orphan_losses: list[int] = field(default_factory=list)  # losses scaled without a root forward this step

    @property
    def seen(self) -> bool:
        """Something of a training step was recorded (a root forward, or a loss scaled without one)."""
        return bool(self.forwards or self.orphan_losses)
    forwards: int = 0
    dropped_micro: int = 0
    kept_bytes: int = 0  # output gradients kept for a replay
    tensor_handles: list[Any] = field(default_factory=list)
    pairs: list[Pair] = field(default_factory=list)  # after the read-back: every measured pair (the forecast's)
    numbers: list[float] = field(default_factory=list)  # after the read-back: every number read
    out_max: dict[str, float] = field(default_factory=dict)  # after the read-back: the record's out_abs_max

    @classmethod
    def on(cls, slabs: Slabs) -> StepState:
        """A new step whose pairs go into the watch's ``slabs``."""
        return cls(collector=Collector(slabs))

    @uninterrupted
    def remove_hooks(self) -> None:
        remove_handles(self.tensor_handles)
        self.tensor_handles.clear()

    def read(
        self, step: int, rank: int, sampled: bool, before: Any, after: Any, found: list[torch.Tensor],
        extras: Sequence[Extra] = (), grad_checks: Sequence[torch.Tensor] = (),
    ) -> tuple[StepRecord, list[bool]]:
        """The step's record, from one read-back of everything collected plus the scales and found-inf flags
        (``before``/``after``: device tensors, or floats for a scaler without one; None: not read), the
        ``extras`` (blocks of statistics gathered elsewhere: a compiled model's buffer, weight norms) and the
        ``grad_checks`` (without an enabled scaler, :class:`~ampdoctor.capture.gradcheck.GradCheck`'s values:
        non-finite when a gradient is)."""
        collector = self.collector
        scale_slots = [collector.add(v) for v in (before, after) if isinstance(v, torch.Tensor)]
        found_slots = [collector.add(v) for v in found]
        check_slots = [collector.add(v) for v in grad_checks]
        extra_slots = [collector.add(e.tensor) for e in extras]
        numbers = collector.read()  # the one host transfer of this step
        tail = iter(numbers[i] for i in scale_slots)
        scale_before = next(tail) if isinstance(before, torch.Tensor) else float(before or 1.0)
        scale_after = next(tail) if isinstance(after, torch.Tensor) else float(after or scale_before)
        scales = StepScales(scale_before, scale_after, sum(numbers[i] for i in found_slots) if found else None)
        # the forecast's pairs: on a sampled step only the ops' (the record's maxima cover the modules), else all
        # (the root's and the few tracked modules')
        pairs = collector.op_pairs(numbers) if sampled else collector.pairs(numbers)
        self.numbers = numbers
        weight_norm: dict[str, float] = {}
        extra_pairs: list[Pair] = []
        for extra, at in zip(extras, extra_slots):
            decoded = extra.decode(numbers[at : at + extra.tensor.numel()])
            extra_pairs += decoded.pairs
            weight_norm.update(decoded.weight_norm)
        pairs += extra_pairs
        self.pairs = pairs
        folded = Folded(self.out_max)
        if sampled:
            collector.fold(numbers, scales.before, folded)
            if extra_pairs:
                fold_pairs(
                    [(kind, module, low) for kind, module, _, _, low in extra_pairs], range(0, 2 * len(extra_pairs), 2),
                    [v for _, _, lo, hi, _ in extra_pairs for v in (lo, hi)], scales.before, folded,
                )
        record, bad = step_record(
            step, rank, numbers, list(self.micro), self.orphan_losses, sampled, self.forwards, scales, folded,
            all(math.isfinite(numbers[i]) for i in check_slots),
        )
        return dataclasses.replace(record, weight_norm=FrozenMap(weight_norm)) if weight_norm else record, bad


@dataclass
class Decoded:
    """What an :class:`Extra` block holds, once read back."""

    pairs: list[Pair] = field(default_factory=list)
    weight_norm: dict[str, float] = field(default_factory=dict)


@dataclass
class Extra:
    """A 1-D device tensor read back with the step, and how to read its numbers."""

    tensor: torch.Tensor
    decode: Callable[[list[float]], Decoded]


@dataclass(frozen=True)
class StepScales:
    """The scale before and after ``update`` and the sum of GradScaler's found-inf flags (None: not read)."""

    before: float
    after: float
    found_inf: Optional[float]


def step_record(
    step: int,
    rank: int,
    numbers: list[float],
    micro: list[MicroBatch],
    orphans: list[int],
    sampled: bool,
    forwards: int,
    scales: StepScales,
    folded: Optional[Folded] = None,
    grads_finite: bool = True,
) -> tuple[StepRecord, list[bool]]:
    """The step's record from the numbers read back and, on a sampled step, its pairs ``folded`` per module
    (:func:`fold_pairs`); and which micro-batches had a non-finite forward.

    ``orphans`` are losses seen by ``scaler.scale`` without a root forward of this step (kept for the mean loss).
    """
    for m in micro:
        m.loss_value = numbers[m.loss_slot] if m.loss_slot is not None else None
    losses = [m.loss_value for m in micro if m.loss_value is not None] + [numbers[i] for i in orphans]
    bad_micro = [
        (m.loss_value is not None and not math.isfinite(m.loss_value))
        or any(bad_pair(numbers[i], numbers[i + 1]) for i in m.root_slots)
        for m in micro
    ]
    forward_finite = not any(bad_micro) and all(math.isfinite(numbers[i]) for i in orphans)
    skipped = scales.found_inf > 0 if scales.found_inf is not None else scales.after < scales.before
    f = folded if folded is not None and sampled else Folded()
    record = StepRecord(
        step=step,
        scale=scales.before,
        skipped=skipped,
        loss=(sum(losses) / len(losses)) if losses else None,
        rank=rank,
        forward_finite=forward_finite,
        new_scale=scales.after,
        micro_batches=forwards,
        sampled=sampled,
        out_abs_max=FrozenMap(f.out_max),
        grad_abs_max=FrozenMap(f.grad_max),
        nonfinite_outputs=tuple(f.bad_out),
        nonfinite_grads=tuple(f.bad_grad),
        # this rank's own forward, or its own gradients before any all-reduce, went non-finite
        local_nonfinite=not forward_finite or bool(f.bad_out) or bool(f.bad_grad),
        grads_finite=grads_finite,
    )
    return record, bad_micro


class WeightNorms:
    """Each module's own parameters' L2 norm (this rank's shard of a sharded parameter), as one block."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.root = root
        self.owned: Optional[list[tuple[str, torch.Tensor]]] = None  # (module name, parameter), found once

    def block(self) -> Extra:
        if self.owned is None:  # the model's structure does not change
            seen: set[int] = set()
            self.owned = []
            for name, module in self.root.named_modules():
                for p in module.parameters(recurse=False):
                    if id(p) not in seen:
                        seen.add(id(p))
                        self.owned.append((name, p))
        owners = [name for name, _ in self.owned]
        norms = torch._foreach_norm([sharded.local(p).detach() for _, p in self.owned]) if owners else []
        block = torch.stack(list(norms)).float() if norms else torch.zeros(0)

        def decode(numbers: list[float]) -> Decoded:
            squares: dict[str, float] = {}
            for owner, value in zip(owners, numbers):
                squares[owner] = squares.get(owner, 0.0) + value * value
            return Decoded(weight_norm={k: v**0.5 for k, v in squares.items()})

        return Extra(block, decode)


def tensor_versions(args: Any, kwargs: Any) -> list[int]:
    """The in-place versions of every tensor in a call's inputs."""
    return [t._version for _, t in iter_tensors((args, kwargs), "")]


def weight_versions(model: torch.nn.Module) -> int:
    """A cheap fingerprint of in-place updates to the parameters (optimizer steps bump ``_version``)."""
    return sum(p._version for p in model.parameters())


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` off the graph (no copy), still asking for a gradient when it did: a replay of a reentrant activation
    checkpoint only back-propagates into its region when an input requires grad."""
    out = t.detach()
    return out.requires_grad_() if t.requires_grad and t.is_floating_point() else out


def detach_tree(obj: Any) -> Any:
    """The same structure with every tensor detached (no copy, no graph kept alive)."""
    if isinstance(obj, torch.Tensor):
        return _detached(obj)
    if type(obj) is tuple and all(isinstance(v, torch.Tensor) for v in obj):  # the common case, without pytree
        return tuple(_detached(v) for v in obj)
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: _detached(v) if isinstance(v, torch.Tensor) else v, obj)


def loss_value(outputs: Any) -> Optional[torch.Tensor]:
    """What ``scaler.scale`` was given, as one 0-d tensor on its device (a sum over several losses)."""
    tensors = [t for _, t in iter_tensors(outputs, "loss") if t.is_floating_point() and t.numel()]
    if not tensors:
        return None
    value = tensors[0].detach()
    value = value.reshape(()) if value.numel() == 1 else value.float().sum()
    for extra in tensors[1:]:
        value = value.float() + extra.detach().float().sum()
    return value


def scale_value(scaler: Any) -> Union[torch.Tensor, float]:
    """The scaler's scale as a device tensor (no sync), or 1.0 without an enabled scaler."""
    if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
        return 1.0
    tensor = getattr(scaler, "_scale", None)
    if isinstance(tensor, torch.Tensor):
        if tensor.numel() == 1 and not tensor.requires_grad:
            return tensor.clone()  # one number (the read-back takes 1-D values as they are): one op
        return tensor.detach().clone().reshape(())
    return float(scaler.get_scale())


def found_inf_flags(scaler: Any) -> list[torch.Tensor]:
    """GradScaler's own found-inf flags of this step (read before ``update`` clears them)."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, Mapping):
        return []
    found = []
    for state in states.values():
        per_device = state.get("found_inf_per_device", {}) if isinstance(state, Mapping) else {}
        found += [v for v in per_device.values() if isinstance(v, torch.Tensor) and v.numel() == 1]
    return found
