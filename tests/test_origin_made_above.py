"""A -inf that a parent's own code made (log of an underflowed softmax, x * -1e5) is that overflow, not a mask the
child receiving it was handed: the parent is the origin. A real mask the parent builds (a -inf fill) still is one."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import ampdoctor

FP16 = torch.float16


def _loss(out: Any, _batch: Any) -> torch.Tensor:
    return out.float().mean()


class LogOfSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.log(torch.softmax(self.a(x) * 30, -1)))  # -inf where the softmax underflowed


class NegativeOverflow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).abs() * -1e5)  # overflows float16 to -inf only


class Scores(nn.Module):
    """Attention scores with the mask added; the scaling overflows (the child's own code)."""

    def forward(self, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (q @ q.transpose(-1, -2) + mask) * 6e4


class MaskedParent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.scores = Scores()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.full((4, 4), float("-inf"), dtype=FP16).triu(1)  # a real mask, built here
        return self.scores(self.q(x), mask).float().softmax(-1)


def test_the_parent_whose_log_made_the_inf_is_the_origin() -> None:
    torch.manual_seed(0)
    report = ampdoctor.diagnose(LogOfSoftmax(), torch.randn(4, 8), loss_fn=_loss, dtype=FP16, progress=False)
    origin = report.findings.forward_origin
    assert origin is not None and (origin.module, origin.class_name) == ("", "LogOfSoftmax")
    assert origin.op is not None and origin.op.op.startswith("aten::log")


def test_the_parent_whose_product_overflowed_to_minus_inf_is_the_origin() -> None:
    torch.manual_seed(0)
    report = ampdoctor.diagnose(NegativeOverflow(), torch.randn(4, 8), loss_fn=_loss, dtype=FP16, progress=False)
    assert report.verdict == "overflow"
    origin = report.findings.forward_origin
    assert origin is not None and origin.module == ""
    assert origin.op is not None and origin.op.op.startswith("aten::mul")


def test_a_mask_the_parent_fills_is_still_a_mask_for_the_child() -> None:
    torch.manual_seed(0)
    report = ampdoctor.diagnose(MaskedParent(), torch.randn(4, 8), loss_fn=_loss, dtype=FP16, progress=False)
    origin = report.findings.forward_origin
    assert origin is not None and origin.module == "scores"


class OverflowingAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = (self.q(x) @ self.k(x).transpose(-1, -2)) * 1e6 + mask  # the real origin
        return scores.float().softmax(-1).to(x.dtype) @ x


class GatedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.side = nn.Linear(8, 8)
        self.attn = OverflowingAttention()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        gate = (self.side(x) * 1e5).clamp(-1.0, 1.0)  # an unrelated overflow of the block's own, hidden
        return self.attn(x, mask) * gate


class MaskingRoot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = GatedBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.full((x.shape[0], x.shape[0]), float("-inf"), dtype=FP16).triu(1)  # the root's mask
        return self.block(x, mask)


def test_a_mask_handed_down_through_a_parent_with_its_own_overflow_is_still_a_mask() -> None:
    torch.manual_seed(0)
    report = ampdoctor.diagnose(MaskingRoot(), torch.randn(5, 8), loss_fn=_loss, dtype=FP16, progress=False,
                                verify=False)
    origin = report.findings.forward_origin
    assert origin is not None and origin.module == "block.attn"
