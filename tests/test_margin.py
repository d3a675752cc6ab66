"""The margin on a remedy's path (issue 18, item 2): consumers up to the next normalisation, op-level peaks with
sentinels left out, hidden overflows that a re-run leaves, the loss scale recommended one margin below the largest
finite one, and the float32 fallback's snippet for weights stored in float16."""

from __future__ import annotations

import math

import pytest
import torch
from test_story import TOKENS, Attn, Siblings
from torch import nn

import ampdoctor
from ampdoctor.analysis.margin import consumers, is_boundary, value_abs_max
from ampdoctor.analysis.scale import gradient_headroom, margin_scale
from ampdoctor.capture.stats import format_limits
from ampdoctor.fixes import verify as verify_module
from ampdoctor.fixes.snippets import fallback_snippet
from ampdoctor.records import GradEvent, ModuleCall, PassTrace, TensorRecord, TensorStats

LIMITS = format_limits(torch.float16)


def _rec(producer: int | None = None, ref: int = -1, dtype: str = "float16", hi: float = 1.0) -> TensorRecord:
    return TensorRecord("args[0]", TensorStats(dtype, (4,), min=-hi, max=hi), producer=producer, ref=ref)


def test_consumers_stop_after_the_next_normalisation_and_skip_other_branches() -> None:
    """a (fixed) -> b -> norm -> d; e reads the batch (another branch); f takes b's output through code between
    modules (a residual add: no producer). Completion order = index here."""
    batch = (TensorRecord("args[0]", TensorStats("float32", (4,), min=0.0, max=1.0), ref=7),)
    calls = (
        ModuleCall(0, "", 0, "Net", None, 9),
        ModuleCall(1, "a", 0, "Linear", 0, 1, inputs=(_rec(ref=7),)),
        ModuleCall(2, "e", 0, "Linear", 0, 2, inputs=(_rec(ref=7),)),
        ModuleCall(3, "b", 0, "Linear", 0, 3, inputs=(_rec(producer=1),)),
        ModuleCall(4, "f", 0, "Linear", 0, 4, inputs=(_rec(),)),
        ModuleCall(5, "norm", 0, "LayerNorm", 0, 5, inputs=(_rec(producer=3),)),
        ModuleCall(6, "d", 0, "Linear", 0, 6, inputs=(_rec(producer=5),)),
    )
    trace = PassTrace(1.0, False, calls, (), batch, (), None, False)
    assert [c.module for c in consumers(trace, calls[1])] == ["b", "f", "norm"]
    assert is_boundary("T5LayerNorm") and is_boundary("LlamaRMSNorm") and is_boundary("Softmax")
    assert not is_boundary("Linear")


def test_value_abs_max_leaves_sentinels_out() -> None:
    def stats(lo: float, hi: float, dtype: str = "float16") -> TensorStats:
        return TensorStats(dtype, (4,), min=lo, max=hi)

    assert value_abs_max(stats(-65504.0, 100.0), LIMITS) == 100.0  # a finfo.min fill
    assert value_abs_max(stats(-math.inf, 3.0), LIMITS) == 3.0  # a -inf mask
    assert value_abs_max(stats(-300.0, 200.0), LIMITS) == 300.0
    assert value_abs_max(stats(-1.0, math.inf), LIMITS) is None  # +inf is an overflow, not a sentinel
    assert value_abs_max(stats(-1.0, 1e6, "float32"), LIMITS) is None  # not held in float16


class Amplified(nn.Module):
    """An attention whose scores overflow (+inf, then NaN: the origin), then a Linear consumer that multiplies its
    output by 800: once the attention runs in float32 both softmax rows pick token 0, so its output is at most 50
    and the consumer holds 40,000 in float16 (log2(65504 / 40000) = 0.71 bits), a different mechanism on the fix's
    path."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn(30.0)
        self.amp = nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            self.amp.weight.copy_(torch.eye(2) * 800.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.amp(self.attn(x)).float()


def _fallback(report: ampdoctor.Report) -> ampdoctor.Recommendation:
    return next(r for r in report.recommendations if r.action == "fp32_fallback")


def test_a_tight_consumer_keeps_the_fallback_from_being_verified() -> None:
    report = ampdoctor.diagnose(Amplified(), TOKENS, loss_fn=lambda out, _: out.mean() * 1e-3, device_type="cpu")
    assert report.findings.forward_origin is not None and report.findings.forward_origin.label == "attn"
    rec = _fallback(report)
    assert rec.modules == ("attn",) and not rec.verified
    assert "holds at this step, with 0.71 bits to spare" in rec.title
    assert "inside the 1-bit margin on its path: amp out (0.71 bits)" in rec.evidence
    # Half a bit of margin: the same fix is verified.
    loose = ampdoctor.diagnose(Amplified(), TOKENS, loss_fn=lambda out, _: out.mean() * 1e-3, device_type="cpu",
                               margin_bits=0.5)
    assert _fallback(loose).verified and "bits to spare" not in _fallback(loose).title


def test_a_hidden_overflow_left_in_the_rerun_is_never_verified(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the grouping and with one re-run allowed, the fallback of the origin (blocks.2) leaves blocks.0's
    scores making -inf under its softmax: the re-run is finite, but not overflow-free, so not verified."""
    monkeypatch.setattr(verify_module, "_group", lambda ctx, module, chosen: [module])
    monkeypatch.setattr(verify_module, "MAX_FALLBACK_ROUNDS", 1)
    report = ampdoctor.diagnose(Siblings(), TOKENS, loss_fn=lambda out, _: out.mean() * 1e-3, device_type="cpu")
    rec = _fallback(report)
    assert rec.modules == ("blocks.2",) and not rec.verified
    assert "an op still makes inf/NaN from finite inputs (hidden or not): blocks.0 (matmul)" in rec.evidence


class Masked(nn.Module):
    """Scores x @ x.T (|s| <= 8) plus an additive causal mask of finfo(float16).min: the sum holds -65504-ish
    values that are mask arithmetic, not a peak."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = x @ x.transpose(-2, -1)
        mask = torch.full(scores.shape, torch.finfo(torch.float16).min, dtype=torch.float16).triu(1)
        return torch.softmax(scores + mask, dim=-1) @ x


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Masked()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


def test_op_peaks_leave_an_additive_finfo_min_mask_out() -> None:
    x = torch.full((1, 4, 2), 2.0)
    report = ampdoctor.diagnose(Wrapper(), x, loss_fn=lambda out, _: out.float().mean(), device_type="cpu")
    peaks = {report.trace.calls[p.call_index].label: (p.op, p.abs_max) for p in report.trace.op_peaks}
    assert peaks == {"attn": ("matmul", 8.0)}  # 2*2 + 2*2; the masked sum (-65496) is not a peak
    assert not report.findings.near_limit
    assert report.verdict == "healthy"


def test_op_peaks_survive_the_json_round_trip_and_show_in_every_rendering() -> None:
    report = ampdoctor.diagnose(Siblings(), TOKENS, loss_fn=lambda out, _: out.mean() * 1e-3, device_type="cpu",
                                verify=False)
    again = ampdoctor.Report.from_json(report.to_json(absolute_paths=True))
    assert again == report and again.trace.op_peaks == report.trace.op_peaks
    assert "op_peaks" in report.to_json()
    assert "matmul 49984 (0.39 bits)" in report.to_markdown()
    assert "op inside: matmul 49984 (0.39 bits)" in report.to_html()


def test_margin_scale_and_gradient_headroom() -> None:
    assert margin_scale(1024.0, 1.0) == 512.0 and margin_scale(1024.0, 0.0) == 1024.0
    assert margin_scale(1024.0, 1.5) == 256.0  # whole bits: the scale stays a power of two
    assert margin_scale(1.0, 1.0) == 1.0  # never below 1
    events = (GradEvent(0, "output", TensorStats("float16", (2,), min=-2.0, max=1.0), call=0),)
    calls = (ModuleCall(0, "fc", 0, "Linear", None, 0, outputs=(_rec(),)),)
    trace = PassTrace(1024.0, False, calls, events, (), (), None, True)
    assert gradient_headroom(trace, LIMITS) == pytest.approx(math.log2(65504 / 2048))


def test_the_recommended_loss_scale_keeps_the_margin_and_is_verified_there() -> None:
    """The scale-overflow case of the sensor model on small readings: finite up to 1024; recommended 512."""
    from test_remedies_attention import Sensors

    torch.manual_seed(0)
    model = Sensors()
    x = (400 + 100 * torch.randn(4, 8, 16)) * 0.1
    report = ampdoctor.diagnose(model, x, loss_fn=lambda out, _: out.float().mean(), device_type="cpu")
    assert report.findings.scale is not None and report.findings.scale.largest_finite_scale == 1024.0
    rec = report.recommendations[0]
    assert rec.rule == "safe_scale" and rec.verified
    assert "init_scale=512.0" in rec.snippet and "start at 512, 1 bit(s) below it" in rec.title
    assert "re-ran the step at scale 512: finite, 0.00% of gradient values lost to zero" in rec.evidence
    assert "keeps 1.15 bits below the float16 max" in rec.evidence


def _recipe(snippet: str) -> str:
    """The snippet's 'without ampdoctor' code lines, uncommented."""
    return "\n".join(line[4:] for line in snippet.splitlines() if line.startswith("#   "))


def test_the_fallback_snippet_for_float16_stored_weights_runs_as_written() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 1)).half()
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4) * 1000.0)
    x = torch.full((2, 4), 100.0, dtype=torch.float16)
    report = ampdoctor.diagnose(model, x, loss_fn=lambda out, _: out.float().mean() * 1e-6, device_type="cpu")
    rec = _fallback(report)
    # Layer 1 takes layer 0's float32 100,000 and casts it to float16 again: it joins the set.
    assert rec.modules == ("0", "1") and rec.verified
    assert "stored in float16" in rec.snippet and "functional_call" in rec.snippet
    # The recipe, run as written on the float16-stored module: float32 out, gradients reach the float16 weights.
    module, inputs = model[0], (x,)
    scope = {"torch": torch, "module": module, "inputs": inputs}
    with torch.autocast("cpu", dtype=torch.float16):
        exec(_recipe(rec.snippet), scope)  # noqa: S102
    out = scope["out"]
    assert out.dtype == torch.float32 and torch.isfinite(out).all() and out.max().item() == 100000.0
    out.sum().backward()
    assert module.weight.grad is not None and module.weight.grad.dtype == torch.float16
    # The recipe for float32 weights (what the snippet said before) fails on them: the weights stay float16.
    plain = fallback_snippet(["0"], "cpu")
    assert "functional_call" not in plain
    with pytest.raises(RuntimeError, match="dtype"), torch.autocast("cpu", dtype=torch.float16):
        exec(_recipe(plain), scope)  # noqa: S102


class TwoHeads(nn.Module):
    """fc: x = 100 times 1000 * I -> 100,000 (inf in float16: the origin). g: outputs (-20, 1) per row, which the
    loss multiplies by 5000 in float16 (-100,000 -> -inf) before a softmax hides it: a hidden overflow in the loss,
    which no float32 fallback of a module can cover."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.g = nn.Linear(4, 4, bias=False), nn.Linear(4, 2, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(4) * 1000.0)
            self.g.weight.zero_()
            self.g.weight[0, 0], self.g.weight[1, 0] = -0.2, 0.01

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(x), self.g(x)


def _two_heads_loss(out: tuple[torch.Tensor, torch.Tensor], _: object) -> torch.Tensor:
    a, b = out
    return a.float().mean() * 1e-6 + torch.softmax(b * 5000.0, dim=-1)[:, 1].float().mean()


def test_a_fix_whose_rerun_keeps_a_hidden_overflow_elsewhere_is_not_verified() -> None:
    """The re-run with fc in float32 is healthy (PassTrace.healthy), every margin is kept, but the loss still makes
    -inf that its softmax hides: not overflow-free, so the fallback is listed, not verified."""
    report = ampdoctor.diagnose(TwoHeads(), torch.full((2, 4), 100.0), loss_fn=_two_heads_loss, device_type="cpu")
    assert report.findings.forward_origin is not None and report.findings.forward_origin.label == "fc"
    # At the diagnosed step the loss is inf anyway (fc's inf reaches it); its mul is recorded all the same.
    assert [(o.label, o.op) for o in report.trace.op_overflows if o.module == "<loss>"] == [("<loss>", "mul")]
    rec = _fallback(report)
    assert rec.modules == ("fc",) and not rec.verified
    assert "bits to spare" not in rec.title
    assert "an op still makes inf/NaN from finite inputs (hidden or not): <loss> (mul)" in rec.evidence


@pytest.mark.slow
def test_a_loss_scale_whose_margin_loses_gradients_is_not_verified() -> None:
    """test_window's hand-set gradients: the window is [64, 2048]. One bit of margin recommends 1024 (useful:
    verified); six bits recommend 2048 / 64 = 32, where a quarter of the gradient values flush to zero (measured
    by the window), so it is listed, not verified."""
    from test_window import _loss, _model

    def first(margin: float) -> ampdoctor.Recommendation:
        report = ampdoctor.diagnose(_model(), torch.ones(1, 1), loss_fn=_loss, scale=8.0, margin_bits=margin)
        assert report.findings.window is not None and report.findings.window.max_safe == 2048.0
        return next(r for r in report.recommendations if r.rule == "raise_scale")

    one = first(1.0)
    assert "init_scale=1024.0" in one.snippet and one.verified
    six = first(6.0)
    assert "init_scale=32.0" in six.snippet and not six.verified
    assert "re-ran the step at scale 32: finite, 25.00% of gradient values lost to zero" in six.evidence


class MaskedRoot(nn.Module):
    """The root's own code adds a causal mask of finfo(float16).min twice (Hugging Face style mask arithmetic:
    -65504 - 65504 -> -inf, a sentinel, not an overflow), then fc overflows (x 100 times 1000 * I: the origin)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.fc = nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(4) * 1000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.q(x) @ self.q(x).transpose(-2, -1)
        mask = (torch.triu(torch.ones(s.shape[-1], s.shape[-1]), 1) * torch.finfo(torch.float16).min).to(s.dtype)
        return self.fc(torch.softmax(s + mask + mask, -1) @ x * 100)


def test_mask_arithmetic_flagged_again_by_a_verification_rerun_does_not_block_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Verification re-runs are survey passes: they flag the mask sum again without classifying it. The
    diagnosis's classifying re-run already found it all sentinel, so the fallback is verified; without that
    knowledge (sentinel_ops empty) the same re-run would read as an overflow left behind."""
    torch.manual_seed(0)

    def fallback() -> ampdoctor.Recommendation:
        report = ampdoctor.diagnose(MaskedRoot(), torch.ones(2, 3, 4), loss_fn=lambda out, _: out.float().mean() * 1e-6,
                                    device_type="cpu")
        assert report.findings.forward_origin is not None and report.findings.forward_origin.label == "fc"
        assert not report.findings.hidden and [o.label for o in report.trace.op_overflows] == ["fc"]
        return _fallback(report)

    rec = fallback()
    assert rec.modules == ("fc",) and rec.verified and "inf/NaN" not in rec.evidence
    monkeypatch.setattr(ampdoctor.api, "sentinel_ops", lambda survey, final: frozenset())
    rec = fallback()
    assert not rec.verified and "(hidden or not): <root> (add)" in rec.evidence
