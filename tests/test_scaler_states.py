"""A GradScaler whose scale collapsed (0, after enough skipped steps) or went inf/NaN is the state people bring:
diagnose runs at the scale a fresh GradScaler starts from and says why, instead of dividing by zero."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampdoctor

FP16 = torch.float16


def _collapsed_scaler() -> torch.amp.GradScaler:
    """A scaler driven to 0 by real skipped steps (every gradient inf), as in a run whose loss went NaN."""
    param = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**-140)  # a few halvings from 0 in float32
    while scaler.get_scale() > 0:
        opt.zero_grad()
        scaler.scale((param * float("inf")).sum()).backward()
        scaler.step(opt)
        scaler.update()
    return scaler


@pytest.mark.parametrize("scale", [0.0, float("inf"), float("nan")])
def test_an_unusable_scale_is_diagnosed_at_the_default_and_named(scale: float) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    scaler = _collapsed_scaler() if scale == 0.0 else torch.amp.GradScaler("cpu", init_scale=scale)
    before = scaler.state_dict()
    report = ampdoctor.diagnose(model, torch.randn(3, 4), scaler=scaler, dtype=FP16, progress=False)
    assert report.run.scale == 65536.0
    assert report.run.scale_source.startswith("GradScaler default (the given scaler's scale is ")
    (note,) = [n for n in report.run.environment if n.startswith("your GradScaler's scale is")]
    assert ("collapsed" in note) == (scale == 0.0)
    assert "ampdoctor.watch" in note
    after = scaler.state_dict()
    assert after.keys() == before.keys()
    assert all(after[k] == before[k] or (after[k] != after[k] and before[k] != before[k]) for k in before)
