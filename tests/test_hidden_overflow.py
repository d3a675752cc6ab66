"""Hidden overflows: float16 ops that make inf/NaN from finite inputs while the module's output stays finite.

Each model carries its expected answer, with the arithmetic in a comment. Inputs are exact in float16.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from helpers import assert_untouched, snapshot
from torch import nn

import ampdoctor
from ampdoctor.analysis import NOT_VISIBLE, hidden_overflows
from ampdoctor.report import Report

F16_MIN = torch.finfo(torch.float16).min  # -65504


def tokens(*values: float) -> torch.Tensor:
    """A (1, T, 4) batch whose token t is (values[t], 0, 0, 0)."""
    x = torch.zeros(1, len(values), 4)
    x[0, :, 0] = torch.tensor(values)
    return x


class ScoresBeforeScaling(nn.Module):
    """The issue's attention: scores computed before the 1/sqrt(d) scaling.

    q = x, k = -x (identity weights), so score(s, t) = -a_s * a_t. With a = (300, 300, 10, 1): the four pairs
    among the first two tokens give -90000 <= -65520 -> -inf in float16 (4 values); every other pair is finite
    (at most 3000 in magnitude), so each row keeps a finite maximum and softmax turns the -inf into zeros.
    """

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4, bias=False)
        self.k = nn.Linear(4, 4, bias=False)
        self.v = nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            self.q.weight.copy_(torch.eye(4))
            self.k.weight.copy_(-torch.eye(4))
            self.v.weight.copy_(torch.eye(4) / 128)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(-2, -1)  # the hidden overflow: before the scaling
        scores = scores / math.sqrt(4)
        return torch.softmax(scores, dim=-1) @ v


class Net(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn
        self.head = nn.Linear(4, 1)
        with torch.no_grad():
            self.head.weight.fill_(0.25)
            self.head.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x))


def loss_fn(output: torch.Tensor, batch: object) -> torch.Tensor:
    return output.float().sum()


def diagnose(model: nn.Module, batch: torch.Tensor) -> Report:
    # scale 1: nothing overflows in the backward, so the hidden overflow is the only finding
    return ampdoctor.diagnose(model, batch, loss_fn=loss_fn, device_type="cpu", scale=1.0)


def test_attention_scores_before_scaling_are_a_hidden_overflow_with_module_op_line_and_count() -> None:
    model = Net(ScoresBeforeScaling())
    batch = tokens(300, 300, 10, 1)
    before = snapshot(model)
    report = diagnose(model, batch)
    assert_untouched(model, before)
    assert torch._C._len_torch_function_stack() == 0  # the mode is gone
    assert report.forward_origin is None and report.verdict == "hidden_overflow" and report.exit_code == 1
    assert len(report.findings.hidden) == 1
    (h,) = report.findings.hidden
    assert (h.module, h.call, h.class_name, h.op, h.dtype) == ("attn", 0, "ScoresBeforeScaling", "matmul", "float16")
    assert h.count == 4 and h.sentinels == 0 and h.classified and h.occurrences == (0,)
    assert h.hidden_by == "softmax"
    assert h.location is not None and h.location.file == __file__
    assert h.location.code == "scores = q @ k.transpose(-2, -1)  # the hidden overflow: before the scaling"
    # every renderer lists it: module, op, line, count, what hid it
    text = report.to_text()
    assert "HIDDEN_OVERFLOW" in text and "Hidden overflows: 1 op(s)" in text
    row = next(line for line in text.splitlines() if line.startswith("attn "))
    assert "matmul" in row and "scores = q @ k.transpose(-2, -1)" in row and " 4 " in row and "softmax" in row
    assert "scores = q @ k.transpose(-2, -1)" in report.to_markdown()
    assert "Hidden overflows" in report._repr_html_() and "ad-v-hidden_overflow" in report._repr_html_()
    data = json.loads(report.to_json())
    assert data["verdict"] == "hidden_overflow" and data["exit_code"] == 1 and data["schema_version"] == "1.2"
    assert data["findings"]["hidden"][0]["count"] == 4
    assert Report.from_json(report.to_json()) == report


def test_the_same_attention_on_small_inputs_reports_no_hidden_overflow() -> None:
    """a = (30, 30, 10, 1): |score| <= 900, nothing overflows anywhere."""
    report = diagnose(Net(ScoresBeforeScaling()), tokens(30, 30, 10, 1))
    assert report.verdict == "healthy" and report.exit_code == 0
    assert report.findings.hidden == () and report.trace.op_overflows == ()
    assert "Hidden overflows" not in report.to_text()
    assert [p.purpose for p in report.run.passes].count("detail and op zoom") == 0  # nothing to confirm


class Sentinels(nn.Module):
    """The real hidden overflow of ScoresBeforeScaling beside the three kinds of sentinel, none of them counted.

    ``ok`` = -(b_s * b_t) with b = (100, 50, 20, 11): every score in [-10000, -121], finite. Strictly above the
    diagonal (6 elements of 16):
    - ``masked_fill(-inf)`` and ``where(mask, -inf, ok)``: fills with a non-finite scalar;
    - ``masked_fill(finfo.min)`` (finite), then ``* 2``: -65504 * 2 -> -inf, an operand at the max (mask arithmetic);
    - ``ok + additive`` with ``finfo.min`` above the diagonal: -65504 - 121 or less -> -inf (mask arithmetic).
    """

    def __init__(self) -> None:
        super().__init__()
        self.attn = ScoresBeforeScaling()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        real = self.attn(x[:, :4])
        b = x[:, 4:, :1]
        ok = b @ (-b).transpose(-2, -1)  # float16 under autocast, finite
        above = torch.ones(4, 4, dtype=torch.bool).triu(1)
        filled = ok.masked_fill(above, float("-inf"))
        picked = torch.where(above, float("-inf"), ok)
        scaled = ok.masked_fill(above, F16_MIN) * 2
        additive = torch.zeros(4, 4, dtype=torch.float16).masked_fill(above, F16_MIN)
        masked = ok + additive
        probs = [torch.softmax(s, dim=-1) for s in (filled, picked, scaled, masked)]
        return real.sum() + torch.stack(probs).sum()


def test_sentinels_are_not_hidden_overflows_beside_a_real_one() -> None:
    batch = torch.cat([tokens(300, 300, 10, 1), tokens(100, 50, 20, 11)], dim=1)
    report = ampdoctor.diagnose(Sentinels(), batch, device_type="cpu", scale=1.0)
    assert report.verdict == "hidden_overflow"
    assert [(h.label, h.op, h.count, h.hidden_by) for h in report.findings.hidden] == [
        ("attn", "matmul", 4, "softmax")
    ]
    # the survey flagged both mask-arithmetic ops (non-finite from finite inputs); the re-run classified every
    # element as a sentinel and dropped them; the fills were never flagged
    survey_flagged = {(o.op, o.occurrence) for o in _survey_overflows(Sentinels(), batch)}
    assert survey_flagged == {("matmul", 0), ("mul", 0), ("add", 0)}
    assert [o.op for o in report.trace.op_overflows] == ["matmul"]


class MixedAdd(nn.Module):
    """One add with a sentinel and a real overflow side by side, hidden by a clamp.

    a = (-100, 60000, 1, 1), m = (finfo.min, 10000, 0, 0): -100 - 65504 -> -inf (m at the max: a sentinel);
    60000 + 10000 = 70000 -> inf (made from finite values: 1 hidden overflow); the rest finite.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x.half() * 1  # exact: (-100, 60000, 1, 1)
        m = torch.tensor([F16_MIN, 10000.0, 0.0, 0.0], dtype=torch.float16)
        s = a + m
        return torch.clamp(s, -1.0, 1.0)


def test_one_op_with_a_sentinel_and_a_real_overflow_counts_each_element() -> None:
    report = diagnose(MixedAdd(), torch.tensor([-100.0, 60000.0, 1.0, 1.0]))
    assert [(h.label, h.op, h.count, h.sentinels, h.hidden_by) for h in report.findings.hidden] == [
        ("<root>", "add", 1, 1, "clamp")
    ]
    assert report.findings.hidden[0].location is not None
    assert report.findings.hidden[0].location.code == "s = a + m"


class Discarded(nn.Module):
    """exp(12) = 162755 > 65504 -> inf in float16 (CPU autocast keeps exp in float16), then nan_to_num."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(x.half())
        return torch.nan_to_num(e, posinf=0.0)


def test_nan_to_num_hides_an_overflow() -> None:
    report = diagnose(Discarded(), torch.tensor([12.0, 1.0, 12.0]))
    assert [(h.op, h.count, h.hidden_by) for h in report.findings.hidden] == [("exp", 2, "nan_to_num")]
    assert report.exit_code == 1


def test_analysis_keeps_only_ops_whose_call_output_stayed_finite() -> None:
    """A visible overflow (the call's output is non-finite) is the origin's business, not a hidden one."""
    report = diagnose(Net(ScoresBeforeScaling()), tokens(300, 300, 10, 1))
    trace = report.trace
    index = trace.op_overflows[0].call_index
    assert index is not None and trace.calls[index].module == "attn"
    out = trace.calls[index].outputs[0]
    visible = dataclasses.replace(out, stats=dataclasses.replace(out.stats, max=math.inf, posinf_count=1))
    calls = tuple(dataclasses.replace(c, outputs=(visible,)) if c.index == index else c for c in trace.calls)
    assert hidden_overflows(dataclasses.replace(trace, calls=calls)) == ()
    no_consumer = dataclasses.replace(trace.op_overflows[0], hidden_by="")
    (h,) = hidden_overflows(dataclasses.replace(trace, op_overflows=(no_consumer,)))
    assert h.hidden_by == NOT_VISIBLE and h.count == 4


def test_no_mode_stays_behind_after_the_forward_raises() -> None:
    class Raises(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    with pytest.raises(ampdoctor.errors.ModelRaised):
        ampdoctor.diagnose(Raises(), torch.ones(2), device_type="cpu")
    assert torch._C._len_torch_function_stack() == 0


def _survey_overflows(model: nn.Module, batch: torch.Tensor) -> tuple[object, ...]:
    """The survey's own flags: the op overflows of a plain pass (no targets: flagged, not classified)."""
    from ampdoctor.capture.passes import PassSpec, run_pass

    spec = PassSpec(
        root=model,
        names={id(m): n for n, m in model.named_modules()},
        params=list(model.named_parameters()),
        batch=batch,
        loss_fn=None,
        device_type="cpu",
        dtype=torch.float16,
        backward=False,
    )
    trace, _ = run_pass(spec, 1.0, detailed=False)
    assert all(not o.classified and o.count is None for o in trace.op_overflows)
    return trace.op_overflows
