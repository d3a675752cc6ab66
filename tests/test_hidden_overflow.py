"""Hidden overflows: float16 ops that make inf/NaN from finite inputs while the module's output stays finite.

Each model carries its expected answer, with the arithmetic in a comment. Inputs are exact in float16.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from helpers import assert_untouched, pass_spec, snapshot
from torch import nn

import ampdoctor
from ampdoctor.analysis import NOT_VISIBLE, hidden_overflows
from ampdoctor.cli.main import main
from ampdoctor.records import PassTrace
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
    assert Report.from_json(report.to_json(absolute_paths=True)) == report


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


def test_the_watch_frees_its_forward_only_tables_before_the_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which node made each live tensor and the occurrence counts are an entry per op, needed by the forward only:
    gone once the forward's values are queued (memory a model of many modules would otherwise hold to the end of
    the pass), while the nodes stay for the readback and the answer is unchanged."""
    from ampdoctor.capture import hidden
    from ampdoctor.capture.passes import run_pass

    watches: list[hidden.HiddenWatch] = []
    queue = hidden.HiddenWatch.queue

    def queued(self: hidden.HiddenWatch, collector: object, output: object = None) -> None:
        assert self._where and self._occurrences  # filled by the forward
        queue(self, collector, output)
        watches.append(self)

    monkeypatch.setattr(hidden.HiddenWatch, "queue", queued)
    trace, _ = run_pass(pass_spec(Net(ScoresBeforeScaling()), tokens(300, 300, 10, 1)), 1.0)
    (watch,) = watches
    assert watch._where == {} and watch._occurrences == {}
    assert watch.nodes
    assert [(o.module, o.op) for o in trace.op_overflows] == [("attn", "matmul")]


def _survey_overflows(model: nn.Module, batch: torch.Tensor) -> tuple[object, ...]:
    """The survey's own flags: the op overflows of a plain pass (no targets: flagged, not classified)."""
    return _survey_overflows_trace(model, batch).op_overflows


def _survey_overflows_trace(model: nn.Module, batch: torch.Tensor) -> PassTrace:
    from ampdoctor.capture.passes import run_pass

    spec = pass_spec(model, batch, backward=False)
    trace, _ = run_pass(spec, 1.0)
    assert all(not o.classified and o.count is None for o in trace.op_overflows)
    return trace


class Hider(nn.Module):
    """p = a * b in float16 with a = (300, 300, 1, 2), b = (-300, -300, 3, 4): 2 elements of -90000 -> -inf, made
    from finite values (neither operand is at the max); then one op hides them and the output is finite."""

    def __init__(self, hide: str) -> None:
        super().__init__()
        self.hide = hide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.half().unbind(0)
        p = a * b
        if self.hide == "softmax":
            return torch.softmax(p, dim=-1)
        if self.hide == "clamp":
            return p.clamp(min=-1000.0)
        if self.hide == "nan_to_num":
            return torch.nan_to_num(p, neginf=0.0)
        if self.hide == "where":
            return torch.where(torch.isinf(p), torch.zeros_like(p), p)
        if self.hide == "masked_fill":
            return p.masked_fill(torch.isinf(p), 0.0)
        if self.hide == "maximum":
            return torch.maximum(p, torch.full_like(p, -1000.0))
        return p.amax(dim=-1, keepdim=True)  # "amax": a max that ignores the -inf


@pytest.mark.parametrize("hide", ["softmax", "clamp", "nan_to_num", "where", "masked_fill", "maximum", "amax"])
def test_each_kind_of_hiding_op_is_named_with_the_exact_count(hide: str) -> None:
    batch = torch.tensor([[300.0, 300.0, 1.0, 2.0], [-300.0, -300.0, 3.0, 4.0]])
    report = diagnose(Hider(hide), batch)
    assert report.verdict == "hidden_overflow"
    assert [(h.label, h.op, h.count, h.hidden_by) for h in report.findings.hidden] == [("<root>", "mul", 2, hide)]
    assert report.findings.hidden[0].location is not None
    assert report.findings.hidden[0].location.code == "p = a * b"


class PassedOn(nn.Module):
    """exp(12) = 162755 -> inf in float16 (made); the float32 detour and the cast back only pass it on; where
    hides it. One hidden overflow (exp, 1 element), nothing else flagged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(x.half())
        f = (e.float() * 2).half()
        return torch.where(torch.isfinite(f), f, torch.zeros_like(f))


def test_values_passed_on_through_float32_and_casts_are_not_made_again() -> None:
    report = diagnose(PassedOn(), torch.tensor([12.0, 1.0, 2.0]))
    assert [(h.op, h.count) for h in report.findings.hidden] == [("exp", 1)]
    assert [o.op for o in report.trace.op_overflows] == ["exp"]
    assert report.findings.hidden[0].hidden_by == "where"  # mul's float32 result and the cast back kept the inf


class TwoBlocks(nn.Module):
    """Two identical attention blocks on the same tokens: both make the same 4 -inf; two findings."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ScoresBeforeScaling(), ScoresBeforeScaling()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x) + self.blocks[1](x)


def test_each_module_call_gets_its_own_finding_and_the_float32_reference_shifts_nothing() -> None:
    batch = tokens(300, 300, 10, 1)
    for reference in (False, True):
        report = ampdoctor.diagnose(TwoBlocks(), batch, loss_fn=loss_fn, device_type="cpu", scale=1.0,
                                    reference=reference)
        assert [(h.label, h.op, h.count, h.hidden_by) for h in report.findings.hidden] == [
            ("blocks.0", "matmul", 4, "softmax"),
            ("blocks.1", "matmul", 4, "softmax"),
        ]


def test_a_hidden_overflow_in_the_loss_function_is_named_as_the_loss() -> None:
    """log(sigmoid(x)) in float16: sigmoid(-20) = 2e-9 -> 0 in float16, log(0) = -inf; the clamp hides it."""

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(1, 1, bias=False)
            with torch.no_grad():
                self.lin.weight.fill_(1.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    def log_sigmoid_loss(output: torch.Tensor, batch: object) -> torch.Tensor:
        return (-torch.log(torch.sigmoid(output))).clamp(max=50.0).mean()

    batch = torch.tensor([[-20.0], [-30.0], [1.0]])
    report = ampdoctor.diagnose(Logits(), batch, loss_fn=log_sigmoid_loss, device_type="cpu", scale=1.0)
    assert [(h.label, h.class_name, h.op, h.count) for h in report.findings.hidden] == [("<loss>", "loss", "log", 2)]
    assert report.findings.hidden[0].hidden_by == "clamp"  # through neg: -(-inf) is still non-finite


def test_cuda_policy_emulated_sees_softmax_in_float32_as_the_hider() -> None:
    """Under CUDA's lists softmax runs in float32: its result is measured (it consumed float16 values)."""
    report = ampdoctor.diagnose(Net(ScoresBeforeScaling()), tokens(300, 300, 10, 1), loss_fn=loss_fn,
                                device_type="cpu", policy="cuda", scale=1.0)
    assert [(h.label, h.op, h.count, h.hidden_by) for h in report.findings.hidden] == [
        ("attn", "matmul", 4, "softmax")
    ]


def test_without_the_detailed_re_run_the_survey_flag_still_prevents_healthy() -> None:
    trace = _survey_overflows_trace(Net(ScoresBeforeScaling()), tokens(300, 300, 10, 1))
    (h,) = hidden_overflows(trace)
    assert (h.label, h.op, h.count, h.classified, h.location, h.hidden_by) == ("attn", "matmul", None, False, None,
                                                                             "softmax")


class TwoMatmuls(nn.Module):
    """Two matmuls in one call, the second overflows: a = (2x2 of 2) @ (2x4 of 100) = 400 everywhere (finite);
    a @ b with b = 200 per unit, inner size 4: 4 * 400 * 200 = 320000 -> inf, all 4 elements; the clamp hides it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = x.reshape(2, 2) @ torch.full((2, 4), 100.0)  # occurrence 0
        b = torch.full((4, 2), 200.0)
        return (a @ b).clamp(-1.0, 1.0)  # occurrence 1


def test_the_occurrence_index_finds_the_same_op_again() -> None:
    from torch.overrides import TorchFunctionMode

    from ampdoctor.capture.hidden import counted_op

    report = diagnose(TwoMatmuls(), torch.full((4,), 2.0))
    (h,) = report.findings.hidden
    assert (h.op, h.occurrences, h.count) == ("matmul", (1,), 4)

    class Count(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, bool]] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            name = counted_op(func, args, out)
            if name == "matmul":
                self.seen.append((name, bool(torch.isinf(out).any())))
            return out

    counter = Count()
    with torch.autocast("cpu", dtype=torch.float16), counter:
        TwoMatmuls()(torch.full((4,), 2.0))
    assert counter.seen == [("matmul", False), ("matmul", True)]  # the k-th matmul is the one that overflows


FACTORY = '''
import math
import torch
from torch import nn


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4, bias=False)
        self.k = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        q, k = self.q(x), self.k(x)
        scores = q @ k.transpose(-2, -1)
        return torch.softmax(scores / math.sqrt(4), dim=-1) @ q


def build():
    model = nn.Sequential(Attn(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].q.weight.copy_(torch.eye(4))
        model[0].k.weight.copy_(-torch.eye(4))
    return model
'''


def test_the_cli_exits_1_and_writes_the_hidden_overflow_in_its_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "hidden_factory_for_cli.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import hidden_factory_for_cli

    torch.save(hidden_factory_for_cli.build().state_dict(), tmp_path / "ckpt.pt")
    torch.save(tokens(300, 300, 10, 1) / 1000, tmp_path / "batch.pt")  # the checkpoint's q and k: identity, -identity
    argv = ["diagnose", "ckpt.pt", "--model", "hidden_factory_for_cli:build", "--batch", "batch.pt",
            "--format", "json", "-o", "out.json", "-q"]
    assert main(argv) == 0  # 1/1000 of the tokens: nothing overflows
    torch.save(tokens(300, 300, 10, 1), tmp_path / "batch.pt")
    assert main(argv) == 1
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["exit_code"] == 1
    assert [(h["module"], h["op"], h["count"], h["hidden_by"]) for h in data["findings"]["hidden"]] == [
        ("0", "matmul", 4, "softmax")
    ]


class DropoutScaling(nn.Module):
    """Dropout in training scales what it keeps by 1/(1-p): 40000 * 2 = 80000 -> inf in float16 for every kept
    element (made by dropout, not a view of its input); the clamp hides them (Pegasus' fp16 clamp, for one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kept = torch.nn.functional.dropout(x.half(), p=0.5, training=True)
        return kept.clamp(-1.0, 1.0)


def test_dropout_scaling_that_overflows_is_made_by_dropout() -> None:
    torch.manual_seed(0)
    kept = int(torch.count_nonzero(torch.nn.functional.dropout(torch.ones(64, dtype=torch.float16), 0.5, True)))
    torch.manual_seed(0)  # diagnose replays the dropout masks drawn from the RNG state it starts in
    report = diagnose(DropoutScaling(), torch.full((64,), 40000.0))
    assert 0 < kept < 64
    assert [(h.op, h.count, h.hidden_by) for h in report.findings.hidden] == [("dropout", kept, "clamp")]
