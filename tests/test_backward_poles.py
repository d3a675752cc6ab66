"""A NaN gradient made at a pole of a backward formula from finite values, in any precision: the distance between
equal points written as ``sqrt(((a - b) ** 2).sum())`` (d sqrt/du = inf at 0, times 0), and ``acos`` of the cosine
of equal vectors. The first recommendation is the code fix (rule ``keep_off_pole``), not a float32 fallback,
which cannot help; a float16 overflow in a backward is not such a case.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampdoctor


class PairDistance(nn.Module):
    """Embeds points and returns every pairwise distance, the diagonal (a point and itself) included."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 8)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.proj(x).float()
        if self.kind == "sqrt":
            return torch.sqrt(((e[:, None] - e[None]) ** 2).sum(-1))
        unit = e / e.norm(dim=-1, keepdim=True)
        return torch.acos((unit[:, None] * unit[None]).sum(-1).clamp(-1, 1))


@pytest.mark.parametrize("kind, node", [("sqrt", "SqrtBackward0"), ("acos", "AcosBackward0")])
def test_a_pole_in_the_backward_gets_the_code_fix_first(kind: str, node: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(PairDistance(kind))
    report = ampdoctor.diagnose(model, torch.rand(3, 4), loss_fn=lambda out, _: out.mean(), dtype=torch.bfloat16)
    assert report.verdict == "nan" and report.forward_origin is None
    origin = report.backward_origin
    assert origin is not None and origin.module == "0" and origin.op is not None and origin.op.node == node
    first = report.recommendations[0]
    assert first.rule == "keep_off_pole" and first.action == "fix_code" and first.modules == ("0",)
    assert first.title.startswith(f"{node} made the NaN from finite values: {kind}")
    assert not first.verified
    assert "test_backward_poles.py" in first.title  # the forward line that created the node


def test_a_float16_overflow_in_the_same_backward_node_is_no_pole() -> None:
    """sqrt of 1e-4 in float16: its derivative (50) times a scaled gradient of 8000 is 4e5, past the float16 max,
    in SqrtBackward0 too; but that is an overflow a fallback or bfloat16 fixes, not a pole."""

    class Root(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt(x)

    lin = nn.Linear(4, 4)
    with torch.no_grad():
        lin.weight.fill_(2.5e-5)
        lin.bias.zero_()
    report = ampdoctor.diagnose(nn.Sequential(lin, Root()), torch.ones(2, 4), dtype=torch.float16, scale=4.0,
                                loss_fn=lambda out, _: out.float().sum() * 2000)
    origin = report.backward_origin
    assert report.verdict == "overflow"
    assert origin is not None and origin.op is not None and origin.op.node == "SqrtBackward0"
    assert "keep_off_pole" not in [r.rule for r in report.recommendations]
