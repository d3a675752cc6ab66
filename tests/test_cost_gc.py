"""The cyclic garbage collector is off while diagnose runs (records by the hundred thousand on a model of many
modules), and the caller's setting is back afterwards, enabled or not, also when the model raises."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import ampdoctor


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


@pytest.mark.parametrize("enabled", [True, False])
def test_gc_off_during_diagnose_and_back_after(enabled: bool) -> None:
    seen: list[bool] = []

    def loss_fn(out: torch.Tensor, _batch: object) -> torch.Tensor:
        return out.float().pow(2).mean()

    def progress(purpose: str, index: int, total: object) -> None:  # called as each pass starts, between passes
        seen.append(gc.isenabled())

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        report = ampdoctor.diagnose(_model(), torch.randn(3, 4), loss_fn=loss_fn, progress=progress)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
    assert len(seen) >= 2 and not any(seen)  # off between passes too, not only inside each
    assert str(report.verdict) == "healthy"


def test_gc_back_after_the_model_raises() -> None:
    def loss_fn(out: torch.Tensor, _batch: object) -> torch.Tensor:
        raise RuntimeError("boom in the loss")

    assert gc.isenabled()
    with pytest.raises(ampdoctor.AmpDoctorError):
        ampdoctor.diagnose(_model(), torch.randn(3, 4), loss_fn=loss_fn, progress=False)
    assert gc.isenabled()
