"""Code-level remedies for a hidden overflow (issue 18, items 1 and 4): with no forward origin, the rewrite rules read
the first hidden overflow's op and line; the re-run that verifies one must leave no inf/NaN at that line, hidden or
not.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_untouched, snapshot
from torch import nn

import ampdoctor
from ampdoctor.fixes import rewrites_lines
from ampdoctor.fixes.rewrites_lines import Float32AtLine

X = torch.ones(2, 4)


class HandNorm(nn.Module):
    """A layer norm written by hand (as BERT's BertLayerNorm): deviations of +-300 square to 90000, inf in float16;
    sqrt(inf) = inf and (h - u) / inf = 0, so the output is finite and all zeros: a hidden overflow."""

    def __init__(self, spread: float) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.tensor([spread, -spread, spread, -spread])[:, None].expand(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        u = h.mean(-1, keepdim=True)
        s = (h - u).pow(2).mean(-1, keepdim=True)
        return (h - u) / torch.sqrt(s + 1e-5)


class HandNormFloat32(HandNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        u = h.mean(-1, keepdim=True)
        s = (h - u).float().pow(2).mean(-1, keepdim=True)
        return (h - u) / torch.sqrt(s + 1e-5)


class Net(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


def _diagnose(model: nn.Module) -> ampdoctor.Report:
    before = snapshot(model)
    report = ampdoctor.diagnose(model, X, loss_fn=lambda out, _: out.float().mean(), device_type="cpu")
    assert_untouched(model, before)
    return report


def test_a_hidden_variance_overflow_gets_the_float32_rewrite_verified() -> None:
    torch.manual_seed(0)
    report = _diagnose(Net(HandNorm(75.0)))
    assert report.verdict == "hidden_overflow" and report.forward_origin is None
    (hidden,) = report.findings.hidden
    assert (hidden.module, hidden.op) == ("norm", "pow")
    first = report.recommendations[0]
    assert first.rule == "hidden_squares_fp32" and first.verified and first.modules == ("norm",), report.to_text()
    assert "a later op hides the inf today" in first.title
    assert "# was: s = (h - u).pow(2).mean(-1, keepdim=True)" in first.snippet


def test_a_variance_that_fits_gets_no_rewrite() -> None:
    torch.manual_seed(0)
    report = _diagnose(Net(HandNorm(25.0)))  # deviations 100: squares 10000 fit
    assert not report.findings.hidden and "hidden_squares_fp32" not in [r.rule for r in report.recommendations]


def test_the_hidden_emulation_is_the_rewritten_code_and_keeps_the_information() -> None:
    torch.manual_seed(0)
    model = Net(HandNorm(75.0))
    report = _diagnose(model)
    loc = report.findings.hidden[0].location
    assert loc is not None
    hand = Net(HandNormFloat32(75.0))
    hand.load_state_dict(model.state_dict())
    mode = Float32AtLine(loc.file, loc.line)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        with mode:
            emulated = model.norm(X)
        rewritten, original = hand.norm(X), model.norm(X)
    assert mode.applied == 1 and torch.equal(emulated, rewritten)
    assert bool((original == 0).all()) and bool((rewritten.abs() > 0.9).all())  # +-1 again, not zeros


def test_a_rewrite_that_leaves_the_hidden_overflow_is_not_verified(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step stays finite either way (the overflow is hidden); only the check that the re-run made no inf at
    that line tells a working rewrite from this broken one."""
    # Broken: the line's ops run with autocast off but on their float16 inputs (never cast up).
    monkeypatch.setattr(rewrites_lines, "_float32", lambda value: value)
    torch.manual_seed(0)
    report = _diagnose(Net(HandNorm(75.0)))
    rec = next(r for r in report.recommendations if r.rule == "hidden_squares_fp32")
    assert not rec.verified, rec.evidence
    assert "pow (hidden by" in rec.evidence and "at that line still makes inf/NaN" in rec.evidence
