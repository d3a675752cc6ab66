"""Proof over steps (``diagnose(..., verify_steps=K)``): train K steps on the batch with a remedy applied, on a
copy of the model, under a fresh GradScaler, and say whether the remedy holds for training, not just one step.

Nothing the user owns changes: the model is deep-copied (parameters, buffers), the optimizer is rebuilt from the
user's optimizer's type and hyperparameters (never stepped), the scaler is a new one, and the RNG states are
forked (put back afterwards). Memory: a copy of the parameters and the optimizer's state (2-4x the parameters).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Optional

import torch
from torch import nn

from ..capture.gradcheck import GradCheck
from ..capture.options import inner_optimizer
from ..capture.passes import LossFn, resolve_loss
from ..capture.walk import call_model
from ..records import Recommendation

DEFAULT_LR = 1e-3


@dataclasses.dataclass(frozen=True)
class StepsResult:
    steps: int
    losses: tuple[float, ...]
    skipped: tuple[bool, ...]
    optimizer: str  # what was trained with: "AdamW(lr=0.001) (the default: no optimizer given)"
    # without a GradScaler (bfloat16) nothing skips a step: the steps whose gradients held inf/NaN (applied)
    bad_grads: tuple[bool, ...] = ()
    scaled: bool = True  # under a GradScaler (float16); else no loss scaling (bfloat16)

    @property
    def backoff(self) -> int:
        """Skipped steps at the start: the scaler backing off from its initial scale."""
        return next((i for i, s in enumerate(self.skipped) if not s), len(self.skipped))

    @property
    def holds(self) -> bool:
        """Loss finite at every step, no skipped step after the initial back-off, and (without a scaler) finite
        gradients at every step."""
        return all(math.isfinite(v) for v in self.losses) and not any(self.skipped[self.backoff:]) and (
            self.backoff < self.steps
        ) and not any(self.bad_grads)

    def sentence(self) -> str:
        bad = sum(not math.isfinite(v) for v in self.losses)
        later = sum(self.skipped[self.backoff:])
        scaler = "GradScaler defaults" if self.scaled else "no GradScaler"
        head = f"trained {self.steps} steps on the batch with it ({self.optimizer}, {scaler}): "
        if self.steps and self.backoff == self.steps:
            return head + (
                "does not hold; every step was skipped (GradScaler found inf/NaN at "
                + (f"each of its {self.steps} scales, 65536 down to {2.0 ** (17 - self.steps):g}"
                   if self.steps > 1 else "its scale, 65536")
                + f"); loss non-finite at {bad} step(s)"
            )
        grads = f"gradients non-finite at {sum(self.bad_grads)} step(s) with no GradScaler to skip them, " if any(
            self.bad_grads) else ""
        return (
            head + ("holds" if self.holds else "does not hold")
            + f"; loss non-finite at {bad} step(s), {grads}{self.backoff} skipped during the initial back-off, "
            f"{later} skipped after it"
        )


def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _optimizer(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> tuple[torch.optim.Optimizer, str]:
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer is not None:
        optimizer = inner_optimizer(optimizer)  # the torch optimizer inside a framework's wrapper
        try:
            rebuilt = type(optimizer)(params, **optimizer.defaults)
            lr = optimizer.defaults.get("lr")
            return rebuilt, f"{type(optimizer).__name__}(lr={lr:g})" if isinstance(lr, float) else type(
                optimizer
            ).__name__
        except Exception as exc:  # a custom optimizer whose constructor takes other arguments
            why = " ".join(str(exc).split())[:80]
            return torch.optim.AdamW(params, lr=DEFAULT_LR), (
                f"AdamW(lr={DEFAULT_LR:g}) (the given {type(optimizer).__name__} could not be rebuilt: {why})"
            )
    return torch.optim.AdamW(params, lr=DEFAULT_LR), f"AdamW(lr={DEFAULT_LR:g}) (the default: no optimizer given)"


def train_steps(
    root: nn.Module,
    batch: Any,
    loss_fn: Optional[LossFn],
    device_type: str,
    dtype: torch.dtype,
    steps: int,
    remedy: Callable[[nn.Module], AbstractContextManager[Any]],
    optimizer: Optional[torch.optim.Optimizer] = None,
) -> StepsResult:
    """Train ``steps`` steps of a copy of ``root`` on ``batch`` with ``remedy(copy)`` in effect."""
    model = copy.deepcopy(root)
    model.train(root.training)
    devices = [p.device.index or 0 for p in model.parameters() if p.is_cuda][:1]
    losses: list[float] = []
    skipped: list[bool] = []
    bad_grads: list[bool] = []
    with torch.random.fork_rng(devices=devices), remedy(model):
        opt, described = _optimizer(model, optimizer)
        scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device_type, dtype=dtype):
                loss, _ = resolve_loss(call_model(model, batch), batch, loss_fn)
            scaler.scale(loss.float()).backward()
            before = scaler.get_scale()
            if not scaler.is_enabled():  # nothing skips non-finite gradients: the optimizer would apply them
                check = GradCheck(model)
                flagged = not all(math.isfinite(v.item()) for v in check.values())
                bad_grads.append(flagged and check.nonfinite()[1] > 0)  # (not a finite norm that overflowed)
            scaler.step(opt)
            scaler.update()
            losses.append(float(loss.detach().float()))
            skipped.append(scaler.is_enabled() and scaler.get_scale() < before)
    return StepsResult(steps, tuple(losses), tuple(skipped), described, tuple(bad_grads), scaler.is_enabled())


def no_remedy(model: nn.Module) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


def with_steps(rec: Recommendation, result: StepsResult) -> Recommendation:
    """The recommendation with the steps' outcome in its evidence."""
    said = result.sentence()
    return dataclasses.replace(rec, evidence=f"{rec.evidence}; {said}" if rec.evidence else said)
