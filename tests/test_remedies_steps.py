"""Proof over steps (issue 18, item 6, and the story of its 'done when'): the first verified float32 fallback of
the 2-block sensor model, applied as its snippet says, trains 20 AdamW steps (lr 1e-3) under GradScaler defaults
with a finite loss at every step, taking at least half of them; diagnose(..., verify_steps=20) says so itself, on
a copy, changing nothing the user owns."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import amp_train, assert_untouched, snapshot
from test_remedies_attention import Sensors

import ampdoctor
from ampdoctor.errors import InvalidInput


def _story() -> tuple[Sensors, torch.Tensor]:
    torch.manual_seed(0)
    model = Sensors()
    return model, (400 + 100 * torch.randn(4, 8, 16)) * 0.5


def _loss(out: torch.Tensor, _: object) -> torch.Tensor:
    return out.float().mean()


def _train(model: torch.nn.Module, x: torch.Tensor, steps: int = 20) -> tuple[list[float], int]:
    losses, skipped = amp_train(model, x, lambda out: _loss(out, None), steps)
    return losses, steps - len(skipped)


@pytest.mark.slow
def test_the_first_verified_fallback_holds_for_20_adamw_steps_and_verify_steps_says_so() -> None:
    model, x = _story()
    before, rng = snapshot(model), torch.get_rng_state()
    report = ampdoctor.diagnose(model, x, loss_fn=_loss, device_type="cpu", verify_steps=20)
    assert_untouched(model, before)
    assert torch.equal(torch.get_rng_state(), rng)
    fallback = next(r for r in report.recommendations if r.action == "fp32_fallback" and r.verified)
    # The user applies exactly that, on their own model, and trains.
    trained = copy.deepcopy(model)
    with ampdoctor.fp32_fallback(trained, list(fallback.modules)):
        losses, taken = _train(trained, x)
    assert all(torch.isfinite(torch.tensor(v)) for v in losses) and taken >= 10
    # verify_steps trained the first verified fallback and the first verified rewrite, each on a copy.
    assert "AdamW(lr=0.001) (the default: no optimizer given)" in fallback.evidence
    assert ": holds; loss non-finite at 0 step(s)" in fallback.evidence
    rewrite = report.recommendations[0]
    assert rewrite.rule == "scale_first" and "trained 20 steps on the batch with it" in rewrite.evidence
    assert any("verify_steps=20: trained a copy of the model" in n for n in report.run.notes)


def test_without_the_remedy_the_same_training_does_not_hold() -> None:
    """The control: the story's model trained as it is loses steps to non-finite values."""
    model, x = _story()
    losses, taken = _train(model, x)
    assert taken < 20


@pytest.mark.slow
def test_verify_steps_uses_the_users_optimizer_type_and_hyperparameters_without_touching_it() -> None:
    model, x = _story()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    report = ampdoctor.diagnose(model, x, loss_fn=_loss, device_type="cpu", verify_steps=3, optimizer=opt)
    assert not opt.state  # never stepped
    assert any("SGD(lr=0.01)" in r.evidence for r in report.recommendations)


@pytest.mark.parametrize(("key", "bad"), [("verify_steps", -1), ("verify_steps", 2.5), ("optimizer", "adam")])
def test_verify_steps_options_are_checked(key: str, bad: object) -> None:
    model, x = _story()
    with pytest.raises(InvalidInput, match=key):
        ampdoctor.diagnose(model, x, loss_fn=_loss, device_type="cpu", **{key: bad})  # type: ignore[arg-type]
