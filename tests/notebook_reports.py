"""Reports shared by the notebook-inspection tests (HTML, DataFrame, plot), each built once per process."""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

import ampdoctor
from ampdoctor.demo import DEMO_ORIGIN, demo_loss, make_demo
from ampdoctor.records import GradEvent, ModuleCall, TensorRecord, TensorStats
from ampdoctor.report import Report

EVIL = "<script>&"  # a module name that must come out escaped

__all__ = ["DEMO_ORIGIN", "EVIL", "backward_report", "evil_report", "healthy_report", "long_report", "overflow_report"]


@functools.cache
def overflow_report() -> Report:
    """The demo: float16 overflow whose origin is ``blocks.1.attn`` (its own ``q @ k.T``); detailed statistics."""
    model, tokens, targets = make_demo()
    return ampdoctor.diagnose(model, tokens, loss_fn=lambda out, _: demo_loss(out, targets))


@functools.cache
def healthy_report(dtype: torch.dtype = torch.float16) -> Report:
    """A small healthy MLP: survey-level statistics only (no smallest-nonzero magnitudes)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    return ampdoctor.diagnose(model, torch.randn(4, 8), dtype=dtype)


class _Sqrt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x.abs())  # d sqrt(u)/du = inf at u = 0: the backward makes NaN from finite gradients


@functools.cache
def backward_report() -> Report:
    """Forward finite, backward origin ``1`` (``_Sqrt``): a zero row makes its gradient inf * 0 = NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Sqrt(), nn.Linear(8, 2))
    with torch.no_grad():
        model[0].weight[0] = 0.0
        model[0].bias[0] = 0.0
    return ampdoctor.diagnose(model, torch.randn(4, 8))


class _Evil(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.add_module(EVIL, nn.Linear(4, 4))
        self.out = nn.Linear(4, 1)
        with torch.no_grad():  # 4 inputs of ~1 times weights of 1e5: |x| ~ 1e5 > 65504, inf in float16
            inner = self.get_submodule(EVIL)
            assert isinstance(inner, nn.Linear)
            inner.weight.fill_(1e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(getattr(self, EVIL)(x))


@functools.cache
def evil_report() -> Report:
    """An overflow whose origin module is literally named ``<script>&``."""
    torch.manual_seed(0)
    return ampdoctor.diagnose(_Evil(), torch.rand(2, 4) + 0.5)


def _stats(abs_max: float, dtype: str = "float16", shape: tuple[int, ...] = (4, 16)) -> TensorStats:
    return TensorStats(
        dtype=dtype, shape=shape, min=-abs_max, max=abs_max, zero_count=0, nan_count=0, posinf_count=0,
        neginf_count=0, finite_min=-abs_max, finite_max=abs_max, min_abs_nonzero=abs_max * 2.0**-10,
        subnormal_count=0, cast_overflow_count=0, cast_flush_count=0,
    )


def long_report(n: int, tight_every: int = 0) -> Report:
    """A hand-built healthy report with ``n`` calls (and ``n`` gradient events) named ``layers.<k>``.

    Every call's output has |x|max 2 (14 bits of headroom); with ``tight_every``, every such call's output is
    3e4 instead (1.1 bits: "under 4 bits").
    """
    base = healthy_report()
    calls, events = [], []
    for k in range(n):
        tight = tight_every and k % tight_every == tight_every - 1
        out = _stats(3e4 if tight else 2.0)
        calls.append(
            ModuleCall(
                index=k, module=f"layers.{k}", call=0, class_name="Linear", parent=None, end_order=k,
                inputs=[TensorRecord("args[0]", _stats(2.0), True, k - 1 if k else None, k)],
                outputs=[TensorRecord("out", out, True, None, k + 1)],
            )
        )
        events.append(GradEvent(order=k, kind="output", stats=_stats(2.0**-20), call=n - 1 - k, path="out"))
    trace = dataclasses.replace(base.trace, calls=calls, grad_events=events, op_finding=None)
    return dataclasses.replace(base, modules=[], trace=trace, recommendations=[])
