"""Code-level remedies of the loss and of mask constants (issue 18, item 4): BCE with logits after a sigmoid, and
the additive mask ``(1 - mask) * -1e9``; their emulations against the rewritten code run by hand; a rewrite held
over training steps (``verify_steps``).

The diagnoses of the real failures themselves are in test_real_failures.py (test_bce_remedy_is_bce_with_logits,
test_additive_mask_minus_1e9_offers_the_finfo_min_constant).
"""

from __future__ import annotations

import pytest
import real_failures_models as cases
import torch
import torch.nn.functional as F
from helpers import assert_untouched, snapshot
from real_failures_models import AdditiveMaskAttention, AdditiveMaskModel
from torch import nn

import ampdoctor
from ampdoctor.fixes.recommend import recommend
from ampdoctor.fixes.rewrites_lines import BceWithLogits, mask_constant_at_line

# -- BCE after a sigmoid -------------------------------------------------------------------------------------


def _bce_target() -> torch.Tensor:
    return torch.randint(0, 2, (8, 2), generator=torch.Generator().manual_seed(2)).float()


def test_bce_emulation_is_bce_with_logits_on_the_logits() -> None:
    """What the mode computes for ``BCELoss()(model(x), y)`` is, value and gradients, what
    ``F.binary_cross_entropy_with_logits(model[0](x), y)`` computes under the same autocast."""
    model, batch, kwargs = cases.sigmoid_bce()
    target = _bce_target()
    with torch.autocast("cpu", dtype=torch.float16):
        with BceWithLogits() as mode:
            emulated = kwargs["loss_fn"](model(batch), batch)
        rewritten = F.binary_cross_entropy_with_logits(model[0](batch), target)
    assert mode.applied == 1 and torch.equal(emulated, rewritten)
    got = torch.autograd.grad(emulated, list(model.parameters()))
    want = torch.autograd.grad(rewritten, list(model.parameters()))
    assert all(torch.isfinite(g).all() and torch.equal(g, w) for g, w in zip(got, want))


def test_a_sigmoid_that_reaches_no_bce_gets_no_bce_with_logits() -> None:
    """The rule's hint (a Sigmoid module, a loss gradient past float16 at scale 1) proposes it; the re-run never
    meets sigmoid -> binary_cross_entropy, so diagnose drops it instead of offering it unproven."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2), nn.Sigmoid())
    before = snapshot(model)
    report = ampdoctor.diagnose(model, torch.ones(2, 4), loss_fn=lambda o, _: (o.float() * 1e6).sum(),
                                device_type="cpu")
    assert_untouched(model, before)
    assert report.backward_origin is not None and report.backward_origin.module == "<loss>"
    proposed = recommend(report.findings, report.run, list(report.modules))
    assert "bce_with_logits" in [r.rule for r in proposed]
    assert "bce_with_logits" not in [r.rule for r in report.recommendations]
    assert report.recommendations[0].rule == "loss_gradient"


def test_without_a_sigmoid_no_bce_is_proposed() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    report = ampdoctor.diagnose(model, torch.ones(2, 4), loss_fn=lambda o, _: (o.float() * 1e6).sum(),
                                device_type="cpu")
    assert "bce_with_logits" not in [r.rule for r in recommend(report.findings, report.run, list(report.modules))]
    assert not [m for m in report.modules if m.class_name == "Sigmoid"]


# -- the additive mask constant ------------------------------------------------------------------------------


class FittingMaskAttention(AdditiveMaskAttention):
    """The same attention with -1e4, which float16 holds: an empty row is a finite uniform softmax."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / 4.0
        extended = (1.0 - mask[:, None, :].to(scores.dtype)) * -1e4
        return self.out((scores + extended).softmax(dim=-1) @ v)


class FinfoMaskAttention(AdditiveMaskAttention):
    """The rewrite, by hand."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / 4.0
        extended = (1.0 - mask[:, None, :].to(scores.dtype)) * torch.finfo(scores.dtype).min
        return self.out((scores + extended).softmax(dim=-1) @ v)


def _with_attention(cls: type[AdditiveMaskAttention]) -> AdditiveMaskModel:
    model, _, _ = cases.additive_mask_minus_1e9(empty_sequence=True)
    other = AdditiveMaskModel()
    other.attn = cls()
    other.load_state_dict(model.state_dict())
    return other


def test_mask_constant_emulation_is_the_rewritten_line() -> None:
    model, batch, kwargs = cases.additive_mask_minus_1e9(empty_sequence=True)
    report = ampdoctor.diagnose(model, batch, **kwargs)
    origin = report.forward_origin
    assert origin is not None and origin.op is not None and origin.op.location is not None
    mode = mask_constant_at_line(origin.op.location.file, origin.op.location.line)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        with mode:
            emulated = model(*batch)
        rewritten = _with_attention(FinfoMaskAttention)(*batch)
        assert not torch.isfinite(model(*batch)).all()
    assert mode.applied == 1 and torch.isfinite(rewritten).all() and torch.equal(emulated, rewritten)


def test_a_mask_constant_that_fits_gets_no_mask_suggestion() -> None:
    _, batch, kwargs = cases.additive_mask_minus_1e9(empty_sequence=True)
    model = _with_attention(FittingMaskAttention)
    report = ampdoctor.diagnose(model, batch, **kwargs)
    assert report.forward_origin is None
    assert not [r for r in report.recommendations if r.action == "mask_constant"]


class Amplify(nn.Module):
    """A multiply past the float16 max that is no mask (a positive gain, no 'mask' on the line)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 1e6


def test_a_large_gain_is_not_called_a_mask_constant() -> None:
    torch.manual_seed(0)
    report = ampdoctor.diagnose(nn.Sequential(Amplify(), nn.Linear(4, 2)), torch.ones(2, 4), device_type="cpu")
    origin = report.forward_origin
    assert origin is not None and origin.op is not None and origin.op.op.startswith("aten::mul")
    assert not [r for r in report.recommendations if r.action == "mask_constant"]


# -- a rewrite held over training steps ----------------------------------------------------------------------


@pytest.mark.slow
def test_verify_steps_trains_with_the_line_rewrite() -> None:
    """The first verified rewrite (the finite mask constant) trained on a copy for 4 AdamW steps holds."""
    model, batch, kwargs = cases.additive_mask_minus_1e9(empty_sequence=True)
    before = snapshot(model)
    report = ampdoctor.diagnose(model, batch, verify_steps=4, **kwargs)
    assert_untouched(model, before)
    first = report.recommendations[0]
    assert first.rule == "scaled_mask_constant" and first.verified
    assert "trained 4 steps on the batch with it (" in first.evidence
    assert "GradScaler defaults): holds; loss non-finite at 0 step(s)" in first.evidence
