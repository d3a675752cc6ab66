"""Hand-written layers whose float32 bias brings every module boundary back to float32 (``relu(x @ W + b)``):
autocast still ran their matmuls in float16, so the step is diagnosed, not refused as one autocast changed nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampdoctor

FP16 = torch.float16


class Dense(nn.Module):
    def __init__(self, fan_in: int, fan_out: int, scale: float) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.full((fan_in, fan_out), scale))
        self.b = nn.Parameter(torch.zeros(fan_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.W + self.b)


def _loss(out: torch.Tensor, _batch: object) -> torch.Tensor:
    return out.float().mean() * 1e-4


def test_a_float16_matmul_inside_float32_boundaries_is_diagnosed() -> None:
    model = nn.Sequential(Dense(4, 4, 0.5), Dense(4, 4, 3e4), Dense(4, 2, 0.1))
    report = ampdoctor.diagnose(model, torch.ones(3, 4), loss_fn=_loss, dtype=FP16, progress=False)
    assert report.verdict == "overflow"
    assert report.findings.forward_origin is not None and report.findings.forward_origin.module == "1"
    assert all(r.stats.dtype == "float32" for c in report.trace.calls for r in c.outputs)  # the premise
    assert report.trace.low_ops >= 3


def test_a_healthy_one_is_diagnosed_healthy() -> None:
    model = nn.Sequential(Dense(4, 4, 0.5), Dense(4, 2, 0.1))
    assert ampdoctor.diagnose(model, torch.ones(3, 4), loss_fn=_loss, dtype=FP16, progress=False).verdict == "healthy"


def test_a_model_without_any_low_precision_op_is_still_refused() -> None:
    class Elementwise(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * self.w).relu()

    with pytest.raises(ampdoctor.InvalidInput, match="changed nothing"):
        ampdoctor.diagnose(Elementwise(), torch.ones(3, 4), loss_fn=_loss, dtype=FP16, progress=False)
