"""Code-level remedies (issue 18, item 4): log(sigmoid(x)) -> F.logsigmoid(x), log(softmax(x)) -> log_softmax(x),
proposed only where the origin's line has the pattern, and verified by a re-run that computes the rewrite's own
arithmetic (fixes.rewrites.FusedLog), which is checked here against the rewritten code itself."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from helpers import assert_untouched, snapshot
from torch import nn

import ampdoctor
from ampdoctor.fixes.rewrites import FusedLog


def _linear(value: float) -> nn.Linear:
    layer = nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        layer.weight.fill_(value)
    return layer


X = torch.ones(2, 4)  # a Linear filled with -5 makes -20 per element: sigmoid(-20) = 2e-9 rounds to 0 in float16


class LogSigmoidHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = _linear(-5.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.sigmoid(self.fc(x)))


class LogReluHead(nn.Module):
    """The same -inf from log(0), but not from a sigmoid: no logsigmoid to suggest."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = _linear(-5.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.relu(self.fc(x)))


def _loss(out: torch.Tensor, _: object) -> torch.Tensor:
    return -out.float().mean()


def test_log_sigmoid_in_the_model_gets_the_logsigmoid_rewrite_verified_by_its_own_arithmetic() -> None:
    model = LogSigmoidHead()
    before = snapshot(model)
    report = ampdoctor.diagnose(model, X, loss_fn=_loss, device_type="cpu")
    assert_untouched(model, before)
    assert report.findings.forward_origin is not None and report.findings.forward_origin.module == ""
    first = report.recommendations[0]
    assert first.action == "rewrite" and first.rule == "logsigmoid" and first.verified
    assert "F.logsigmoid(x)" in first.title and "logsigmoid(x)" in first.snippet
    assert "computing the rewritten arithmetic (1 time(s) per step)" in first.evidence
    # The rewrite, applied for real, is finite in float16 too.
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.isfinite(F.logsigmoid(model.fc(X))).all()


def test_log_sigmoid_in_the_loss_gets_the_rewrite() -> None:
    model = nn.Sequential(_linear(-5.0))
    report = ampdoctor.diagnose(
        model, X, loss_fn=lambda out, _: -torch.log(torch.sigmoid(out)).mean(), device_type="cpu"
    )
    assert report.findings.forward_origin is not None and report.findings.forward_origin.module == "<loss>"
    first = report.recommendations[0]
    assert first.rule == "loss_logsigmoid" and first.verified


def test_log_of_something_else_gets_no_logsigmoid() -> None:
    report = ampdoctor.diagnose(LogReluHead(), X, loss_fn=_loss, device_type="cpu")
    assert report.findings.forward_origin is not None
    assert not [r for r in report.recommendations if r.action == "rewrite"]


def test_the_emulation_is_the_rewritten_code() -> None:
    """FusedLog's result is bit for bit what the rewritten line computes, in float16 and float32."""
    torch.manual_seed(0)
    for dtype in (torch.float16, torch.float32):
        x = (torch.randn(3, 5) * 30).to(dtype)
        with FusedLog("sigmoid") as mode:
            got = torch.log(torch.sigmoid(x))
        assert mode.applied == 1 and torch.equal(got, F.logsigmoid(x))
        with FusedLog("softmax") as mode:
            got = torch.log(x.softmax(-1))
        assert mode.applied == 1 and torch.equal(got, torch.log_softmax(x, -1))
        with FusedLog("sigmoid") as mode:  # a log of another tensor is left alone
            y = torch.sigmoid(x)
            got = torch.log(y + 0)
        assert mode.applied == 0 and torch.equal(got, torch.log(torch.sigmoid(x) + 0))


class LogSoftmaxHead(nn.Module):
    """Outputs [0, -20, -20, -20] per row: softmax's e^-20 = 2e-9 rounds to 0 in float16, log(0) = -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = _linear(-5.0)
        with torch.no_grad():
            self.fc.weight[0].zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.softmax(self.fc(x), dim=-1))


def test_log_softmax_gets_the_log_softmax_rewrite_and_no_logsigmoid() -> None:
    report = ampdoctor.diagnose(LogSoftmaxHead(), X, loss_fn=_loss, device_type="cpu")
    rules = [r.rule for r in report.recommendations]
    assert rules[0] == "log_softmax" and "logsigmoid" not in rules
    assert report.recommendations[0].verified and "torch.log_softmax(x, dim)" in report.recommendations[0].title
