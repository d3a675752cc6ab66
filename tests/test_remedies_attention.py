"""Scores before scaling (issue 18, items 3 and 4): a 2-block attention model without LayerNorm on raw sensor
readings computes q @ k^T before the 1/sqrt(d) scaling. The report proposes scaling q first, verified by a re-run
that computes the rewritten arithmetic (fixes.rewrites.ScaleFirst, checked here against the rewritten module), and
a float32 fallback that covers both instances of the attention."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_untouched, snapshot
from torch import nn

import ampdoctor
from ampdoctor.fixes.rewrites import ScaleFirst


class SelfAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(-2, -1)
        attn = torch.softmax(scores / math.sqrt(q.shape[-1]), dim=-1)
        return self.o(attn @ v)


SCORES_LINE = SelfAttention.forward.__code__.co_firstlineno + 2  # the `scores = q @ k...` line


class ScaledFirst(SelfAttention):
    """The rewrite, as a user would write it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
        return self.o(torch.softmax(scores, dim=-1) @ v)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = SelfAttention(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x)


class Sensors(nn.Module):
    def __init__(self, d: int = 16, n: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _readings() -> torch.Tensor:
    return (400 + 100 * torch.randn(4, 8, 16)) * 0.5  # raw readings, no normalisation


def test_scores_before_scaling_get_scale_q_first_and_a_fallback_for_both_blocks() -> None:
    torch.manual_seed(0)
    model = Sensors()
    x = _readings()
    before = snapshot(model)
    report = ampdoctor.diagnose(model, x, loss_fn=lambda out, _: out.float().mean(), device_type="cpu")
    assert_untouched(model, before)
    origin = report.findings.forward_origin
    assert origin is not None and origin.class_name == "SelfAttention" and origin.module.startswith("blocks.")
    first = report.recommendations[0]
    assert first.rule == "scale_first" and first.verified
    assert "q.shape[-1] ** -0.5" in first.snippet and "scaled_dot_product_attention" in first.snippet
    assert "(2 time(s) per step)" in first.evidence  # both blocks run the line
    fallback = next(r for r in report.recommendations if r.action == "fp32_fallback")
    assert set(fallback.modules) == {"blocks.0.attn", "blocks.1.attn"} and fallback.verified
    assert "2 SelfAttention instances (blocks.*.attn) run this code; 2 of 2 need it" in fallback.evidence


def test_the_emulation_is_the_rewritten_code() -> None:
    torch.manual_seed(1)
    plain, rewritten = SelfAttention(16), ScaledFirst(16)
    rewritten.load_state_dict(plain.state_dict())
    x = _readings() * 0.1
    with torch.autocast("cpu", dtype=torch.float16):
        with ScaleFirst(__file__, SCORES_LINE) as mode:
            emulated = plain(x)
        expected = rewritten(x)
    assert mode.applied == 1 and mode.missed == 0
    assert emulated.dtype == expected.dtype == torch.float16 and torch.equal(emulated, expected)
    # Another line is left alone: nothing applied, the plain result.
    with torch.autocast("cpu", dtype=torch.float16):
        with ScaleFirst(__file__, SCORES_LINE + 1) as mode:
            again = plain(x)
        assert torch.equal(again, plain(x))
    assert mode.applied == 0 and mode.missed == 0


class Wide(nn.Module):
    """A plain Linear overflow (x = 100, weight 1000 * I): a matmul, but no attention scores."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(4) * 1000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_no_scale_first_without_scores() -> None:
    report = ampdoctor.diagnose(Wide(), torch.full((2, 4), 100.0), loss_fn=lambda out, _: out.float().mean() * 1e-6,
                                device_type="cpu")
    assert report.findings.forward_origin is not None
    assert "scale_first" not in [r.rule for r in report.recommendations]


@pytest.mark.slow
def test_a_rewrite_inside_the_margin_only_holds_at_this_step() -> None:
    """The rewritten scores peak 1.52 bits below 65504 here: verified at the default 1-bit margin, not at 2."""
    torch.manual_seed(0)
    model = Sensors()
    report = ampdoctor.diagnose(model, _readings(), loss_fn=lambda out, _: out.float().mean(), device_type="cpu",
                                margin_bits=2)
    first = report.recommendations[0]
    assert first.rule == "scale_first" and not first.verified
    assert "holds at this step, with 1.52 bits to spare" in first.title
    assert "inside the 2-bit margin" in first.evidence
