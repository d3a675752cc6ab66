"""The op line's operands read as they are: a saved forward value holding an inf (exp's output, made by an
overflow the forward hid) shows |x|max inf, not its largest finite value."""

from __future__ import annotations

import math

import torch
from torch import nn

import ampdoctor


class HiddenExp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.lin(x) * 20).clamp(max=1.0)  # exp overflows; the clamp hides it; 0 * inf in backward


def test_a_saved_operand_holding_inf_reads_inf() -> None:
    torch.manual_seed(0)
    report = ampdoctor.diagnose(HiddenExp(), torch.randn(4, 8), loss_fn=lambda o, _: o.float().mean(),
                                dtype=torch.float16, progress=False)
    origin = report.findings.backward_origin
    assert origin is not None and origin.op is not None and origin.op.node == "ExpBackward0"
    assert origin.op.input_abs_max[1] == math.inf  # exp's saved output
    assert origin.op.input_abs_max[0] is not None and math.isfinite(origin.op.input_abs_max[0])
    assert "float16 |x|max inf) -> float16 in autograd node ExpBackward0" in report.to_text()
    assert ampdoctor.Report.from_json(report.to_json(absolute_paths=True)) == report
