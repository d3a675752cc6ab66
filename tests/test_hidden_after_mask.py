"""An overflow made after an additive -inf mask: the masked scores carry the mask's -inf, so every later op on them
has a non-finite input; each elementwise one is still measured where its operands are finite, so an inf it makes
beside the mask's -inf is found and counted, and the mask passed on is not."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ampdoctor

FP16 = torch.float16


class ScaledMaskedAttention(nn.Module):
    def __init__(self, scale: float, clamp: bool) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.scale, self.clamp = scale, clamp

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) + mask  # an additive causal -inf mask
        scores = scores * self.scale
        if self.clamp:
            scores = scores.clamp(max=1e4)  # hides the +inf the scaling made
        return torch.softmax(scores, -1) @ self.v(x)


class MaskedExp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        z = self.lin(x) + mask  # -inf where masked
        return torch.exp(z * 3.0).clamp(max=1.0)


def _causal() -> torch.Tensor:
    return torch.full((4, 4), float("-inf")).triu(1).half()


def _loss(out: Any, _batch: Any) -> torch.Tensor:
    return out.float().mean()


@pytest.mark.parametrize("policy", ["native", "cuda"])
def test_an_overflow_after_the_mask_is_found_with_its_count(policy: str) -> None:
    torch.manual_seed(0)
    model, x, mask = ScaledMaskedAttention(60000.0, clamp=True), torch.randn(1, 4, 8), _causal()
    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
        masked = model.q(x) @ model.k(x).transpose(-1, -2) + mask
        made = int((torch.isinf(masked * 60000.0) & torch.isfinite(masked)).sum())
        assert made > 0 and bool(torch.isfinite(model(x, mask)).all())  # the premise: made, then hidden
    report = ampdoctor.diagnose(model, (x, mask), loss_fn=_loss, dtype=FP16, policy=policy, progress=False)
    assert report.verdict == "hidden_overflow"
    assert [(h.module, h.op, h.count) for h in report.findings.hidden] == [("", "mul", made)]


def test_an_elementwise_overflow_after_the_mask_counts_only_what_it_made() -> None:
    torch.manual_seed(0)
    model, x = MaskedExp(), torch.randn(4, 8) * 8
    mask = torch.zeros(4, 8)
    mask[:, :3] = float("-inf")
    mask = mask.half()
    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
        z = (model.lin(x) + mask) * 3.0
        made = int((torch.isinf(torch.exp(z)) & torch.isfinite(z)).sum())
    assert made > 0
    report = ampdoctor.diagnose(model, (x, mask), loss_fn=_loss, dtype=FP16, progress=False)
    assert [(h.op, h.count, h.sentinels) for h in report.findings.hidden] == [("exp", made, 0)]


def test_the_mask_passed_on_through_scaling_and_softmax_is_no_overflow() -> None:
    torch.manual_seed(0)
    model = ScaledMaskedAttention(0.125, clamp=False)
    report = ampdoctor.diagnose(model, (torch.randn(1, 4, 8), _causal()), loss_fn=_loss, dtype=FP16, progress=False)
    assert report.verdict == "healthy"
    assert not report.findings.hidden


class CatChain(nn.Module):
    """A concatenation (which may hold a mask) fed through a long chain of elementwise ops."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.lin(x), self.lin(x)], -1)
        for _ in range(10):
            h = torch.tanh(h * 1.01 + 0.1)
        return h


def test_a_possible_mask_is_followed_three_elementwise_ops_deep_and_no_further(monkeypatch: Any) -> None:
    from ampdoctor.capture.hidden import HiddenWatch

    measured: list[str] = []
    original = HiddenWatch._measure_unmasked

    def counting(self: HiddenWatch, node: Any, *args: Any) -> None:
        original(self, node, *args)
        if node.unmasked >= 0:
            measured.append(node.name)

    monkeypatch.setattr(HiddenWatch, "_measure_unmasked", counting)
    torch.manual_seed(0)
    report = ampdoctor.diagnose(CatChain(), torch.randn(4, 8), loss_fn=_loss, dtype=FP16, progress=False)
    assert report.verdict == "healthy"
    assert measured == ["mul", "add", "tanh"]  # each extra reduction costs the op's size: bounded per mask
