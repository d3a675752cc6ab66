"""``verify_steps``' verdict on a remedy (:mod:`ampdoctor.fixes.steps`): what its sentence says in the cases a
plain count of non-finite losses hides: every step skipped, and bfloat16 gradients that nothing skips."""

from __future__ import annotations

import torch
from torch import nn

from ampdoctor.fixes.steps import StepsResult, no_remedy, train_steps

OPT = "AdamW(lr=0.001)"


def test_every_step_skipped_is_said_as_such_not_as_an_initial_back_off() -> None:
    result = StepsResult(4, (1.0, 1.0, 1.0, 1.0), (True, True, True, True), OPT)
    assert not result.holds
    assert result.sentence() == (
        "trained 4 steps on the batch with it (AdamW(lr=0.001), GradScaler defaults): does not hold; every step "
        "was skipped (GradScaler found inf/NaN at each of its 4 scales, 65536 down to 8192); loss non-finite at "
        "0 step(s)"
    )


def test_a_back_off_then_good_steps_holds() -> None:
    result = StepsResult(4, (1.0,) * 4, (True, False, False, False), OPT)
    assert result.holds
    assert result.sentence().endswith("holds; loss non-finite at 0 step(s), 1 skipped during the initial "
                                      "back-off, 0 skipped after it")


class ZeroGain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.zeros(4))  # sqrt(gain * gain) at 0: a NaN gradient under a finite loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (1 + torch.sqrt(self.gain * self.gain))


def test_bfloat16_steps_whose_gradients_are_nan_do_not_hold_even_with_a_finite_loss() -> None:
    torch.manual_seed(0)
    model = ZeroGain()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = train_steps(model, torch.rand(2, 4), None, "cpu", torch.bfloat16, 1, no_remedy)
    assert result.losses[0] == result.losses[0]  # finite: one step, the NaN weights never ran
    assert result.bad_grads == (True,) and result.skipped == (False,)
    assert not result.holds
    assert result.sentence() == (
        "trained 1 steps on the batch with it (AdamW(lr=0.001) (the default: no optimizer given), no GradScaler): "
        "does not hold; loss non-finite at 0 step(s), gradients non-finite at 1 step(s) with no GradScaler to skip "
        "them, 0 skipped during the initial back-off, 0 skipped after it"
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # trained a copy


def test_healthy_bfloat16_steps_hold() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    result = train_steps(model, torch.rand(2, 4), None, "cpu", torch.bfloat16, 3, no_remedy)
    assert result.holds and result.bad_grads == (False, False, False) and not result.scaled
