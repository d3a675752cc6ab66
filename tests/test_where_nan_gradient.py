"""The ``torch.where`` NaN-gradient trap: ``where(ok, x, f(x))`` whose untaken branch ``f(x)`` is NaN in the
forward. The forward output is finite (``where`` discards the NaN), but the untaken branch still gets a gradient,
0, and its backward multiplies it by the saved NaN: 0 x NaN = NaN. No backward op *makes* the NaN (it was saved in
the forward), so before the zoom named no op; now it names the node that read the saved value, says so, and
points at the forward line, while an op that really made a value (0 x inf) still comes first.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.report.document import FROM_SAVED


class Gate(nn.Module):
    def __init__(self, branch: str) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.zeros(8))
        self.branch = branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.branch == "sqrt":  # sqrt(-1) = NaN, saved for SqrtBackward0
            safe = torch.where(self.g >= 0, self.g, torch.sqrt(self.g - 1))
        else:  # log(-1) = NaN: LogBackward0 divides the gradient by its saved input (-1): finite; ...
            safe = torch.where(self.g >= 0, self.g, torch.exp(self.g + 100))  # ... exp(100) = inf in float32
        return x * (1 + safe)


@pytest.mark.parametrize(
    "branch, node, from_saved",
    [
        ("sqrt", "SqrtBackward0", True),  # the saved result is NaN: passed on, not made
        ("exp", "ExpBackward0", False),  # the saved result is inf: 0 x inf makes the NaN in the backward
    ],
)
def test_the_untaken_branch_of_where_is_named_with_what_it_did(branch: str, node: str, from_saved: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Gate(branch), nn.Linear(8, 1))
    report = ampdoctor.diagnose(model, torch.rand(4, 8), dtype=torch.bfloat16)
    assert report.verdict == "nan" and report.forward_origin is None
    origin = report.backward_origin
    assert origin is not None and origin.module == "1" and origin.tensor == "grad:1.g"
    assert origin.op is not None and origin.op.node == node and origin.op.from_saved is from_saved
    assert origin.op.location is not None and "torch.where(self.g >= 0" in origin.op.location.code
    assert (FROM_SAVED in str(report)) is from_saved
    rules = [r.rule for r in report.recommendations]
    assert ("safe_branch" in rules) is from_saved
    if from_saved:
        first = report.recommendations[0]
        assert first.rule == "safe_branch" and first.action == "fix_code" and first.modules == ("1",)
        assert not first.verified  # advice on the code: no re-run proves it
        assert "SqrtBackward0 reads a NaN/inf that its forward at test_where_nan_gradient.py:" in first.title
        compile(first.snippet, "<snippet>", "exec")  # valid Python
        # the origin's note says what the node did; the advice is the recommendation's alone (it was in both)
        assert str(report).count("safe inputs") == 1 and "safe inputs" in first.title
    assert (FROM_SAVED.replace("'", "&#x27;") in report.to_html()) is from_saved


def test_the_trap_in_the_loss_is_named_there_and_not_called_a_loss_too_large_for_the_dtype() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))

    def loss_fn(out: torch.Tensor, _: object) -> torch.Tensor:
        o = out.float()
        return torch.where(o > 1e9, torch.sqrt(-o.abs() - 1), o).sum()

    report = ampdoctor.diagnose(model, torch.rand(2, 4), loss_fn=loss_fn, dtype=torch.bfloat16)
    origin = report.backward_origin
    assert origin is not None and origin.label == "<loss>"
    assert origin.op is not None and origin.op.node == "SqrtBackward0" and origin.op.from_saved
    assert [r.rule for r in report.recommendations][:1] == ["safe_branch"]
    assert "loss_gradient" not in [r.rule for r in report.recommendations]  # "reduce it": not the cause
    assert report.recommendations[0].modules == ()  # the loss, not a module
