"""Module hooks through a diagnosis: a one-shot hook that removes itself when it fires still fires in the user's
own next step, and a hook the forward registers is gone."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import ampdoctor

FP16 = torch.float16


def _loss(out: Any, _batch: Any) -> torch.Tensor:
    return out.float().mean() * 1e-3


def test_a_one_shot_hook_still_fires_in_the_users_next_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fired: list[str] = []

    def once(module: nn.Module, args: Any, out: Any) -> None:
        fired.append("once")
        handle.remove()

    handle = model[0].register_forward_hook(once)
    report = ampdoctor.diagnose(model, torch.randn(3, 4), loss_fn=_loss, dtype=FP16, progress=False)
    assert any("module hooks" in n for n in report.run.notes)
    fired.clear()
    model(torch.randn(3, 4))
    assert fired == ["once"]  # the user's step sees it, once
    model(torch.randn(3, 4))
    assert fired == ["once"]


def test_a_hook_the_forward_registers_is_not_left_behind() -> None:
    class Registers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.lin.register_forward_hook(lambda m, a, o: None)
            return self.lin(x)

    model = Registers()
    ampdoctor.diagnose(model, torch.randn(3, 4), loss_fn=_loss, dtype=FP16, progress=False)
    assert not model.lin._forward_hooks


def test_a_one_shot_hook_that_changes_the_output_leaves_the_report_on_the_survey() -> None:
    """Hooks are put back at the end, not between passes (a remedy's re-run holds hooks of its own): the survey
    meets the hook, the re-run does not, and the report stands on the survey, naming the hook as a likely cause."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))

    def scale_once(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        handle.remove()
        return out * 1e6  # overflows float16, in the first pass only

    handle = model[0].register_forward_hook(scale_once)
    report = ampdoctor.diagnose(model, torch.randn(3, 4), loss_fn=_loss, dtype=FP16, progress=False)
    assert report.verdict == "overflow" and not report.trace.detailed  # the survey's records
    (note,) = [n for n in report.run.notes if n.startswith("the step is not the same twice")]
    assert "a hook that removes itself when it fires" in note
    assert len(model[0]._forward_hooks) == 1  # and it is there for the user's step
