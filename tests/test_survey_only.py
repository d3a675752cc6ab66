"""Fewer passes where they cannot change the answer (issues 18 and 22): the underflow reference and the loss-scale
window settled by the survey alone when its own gradients show it (``analysis.survey_only``), the window left out
while a hidden overflow stands. Models with hand-set magnitudes carry their expected answer in comments."""

from __future__ import annotations

from typing import Any

import torch
from helpers import assert_untouched, snapshot
from test_cost_passes import Counted, X, _passes, _weighted
from test_hidden_overflow import F16_MIN, Net, ScoresBeforeScaling, tokens
from torch import nn

import ampdoctor

FP16 = torch.float16


# C = 1.5 * [2**-4, 2**-6, 2**-8, 2**4] at scale 32: every weight gradient of unit i is C_i * 32 (64 per unit):
# 1.5 * [2, 2**-1, 2**-3, 2**9], and so is the float16 output gradient. No zero anywhere, and the smallest value
# 1.5 * 2**-3 lies 22 binades above float16's flush threshold 2**-25: nothing to lose. The top is 2048 (24 * 2048 =
# 49152 fits, 24 * 4096 = 98304 overflows), and the distance 2048 / 32 is 6 binades, so the band examined is the
# 8 binades (the minimum) above the threshold: empty.
SAFE = [1.5 * 2.0**-4, 1.5 * 2.0**-6, 1.5 * 2.0**-8, 24.0]


def test_no_zero_gradient_and_a_clear_band_skip_the_reference_and_the_window_re_run() -> None:
    model = Counted()
    before = snapshot(model)
    report = ampdoctor.diagnose(model, X, loss_fn=_weighted(SAFE), scale=32.0)
    assert_untouched(model, before)
    assert _passes(report) == [("survey", 32.0, "float16", "ran")]
    assert model.forwards == 1
    assert report.verdict == "healthy" and report.findings.underflow is None
    note = next(n for n in report.run.notes if n.startswith("underflow reference not run"))
    assert "gradients computed in float16 hold 0 zero value(s) of 256" in note
    assert "at most 0.000% of the 256 nonzero values" in note
    assert "put 0.000% of the parameter-gradient values and 0.000% of the float16 gradients' values" in note
    assert "within 8 binades above float16's flush threshold" in note
    assert "up to 2048, the largest finite predicted" in note and 'underflow_reference="always" runs it' in note
    window = report.findings.window
    assert window is not None and (window.min_useful, window.max_safe) == (1.0, 2048.0)
    assert window.reference.startswith("predicted from the survey at scale 32, not re-run")
    assert [(p.scale, p.gradients_finite) for p in window.probes] == [(4096.0, False)]  # by arithmetic
    assert window.module_min_useful == {"": 1.0}
    assert not window.measured
    assert "by arithmetic on the survey's records, not re-run: 4096:inf" in report.to_text()
    assert "measured at" not in report.to_text()
    again = ampdoctor.Report.from_json(report.to_json())
    assert again.to_json() == report.to_json() and again.findings.window is not None
    assert not again.findings.window.measured


def test_always_runs_the_reference_and_finds_what_the_survey_predicted() -> None:
    report = ampdoctor.diagnose(Counted(), X, loss_fn=_weighted(SAFE), scale=32.0, underflow_reference="always")
    assert _passes(report) == [("survey", 32.0, "float16", "ran"), ("underflow reference", 2048.0, "float16", "ran")]
    under = report.findings.underflow
    assert under is not None and (under.lost, under.reference_nonzero) == (0, 256)  # what the skip relied on
    window = report.findings.window
    assert window is not None and (window.min_useful, window.max_safe) == (1.0, 2048.0)
    assert not any(n.startswith("underflow reference not run") for n in report.run.notes)
    assert window.measured and "measured at" in report.to_text()


def test_never_counts_nothing_and_says_so() -> None:
    # C at scale 8 loses unit 2 (1.5 * 2**-27 flushes): with "never" that stays uncounted, as the note says.
    c = [1.5 * 2.0**-10, 1.5 * 2.0**-20, 1.5 * 2.0**-30, 24.0]
    report = ampdoctor.diagnose(Counted(), X, loss_fn=_weighted(c), scale=8.0, underflow_reference="never",
                                scale_window=False)
    assert _passes(report) == [("survey", 8.0, "float16", "ran")]
    assert report.findings.underflow is None and report.verdict == "healthy"
    assert any(n.startswith('underflow reference not run (underflow_reference="never")') for n in report.run.notes)


def test_zeros_in_a_float16_computed_gradient_keep_the_reference() -> None:
    # The same C at scale 8: unit 2's gradient 1.5 * 2**-30 * 8 = 1.5 * 2**-27 flushes, so 64 of the 256 weight
    # gradient values are zero (the exact bound: up to 25 % could be lost). The reference runs, as with "always".
    c = [1.5 * 2.0**-10, 1.5 * 2.0**-20, 1.5 * 2.0**-30, 24.0]
    auto = ampdoctor.diagnose(Counted(), X, loss_fn=_weighted(c), scale=8.0)
    always = ampdoctor.diagnose(Counted(), X, loss_fn=_weighted(c), scale=8.0, underflow_reference="always")
    for report in (auto, always):
        assert ("underflow reference", 2048.0, "float16", "ran") in _passes(report)
        under = report.findings.underflow
        assert under is not None and (under.lost, under.reference_nonzero) == (64, 256)
        assert report.verdict == "underflow"
    assert _passes(auto) == _passes(always)


class Ladder(nn.Module):
    """``scale.w`` (float32, ones; its holder is never called) multiplies the input in float32, then an identity
    ``F.linear`` under autocast makes the output and its input gradient float16. The loss weights output j by
    ``2**(-40 j / 63)``: a smooth ladder of gradient magnitudes down to 2**-40 reaching ``w`` through float16.
    No parameter gradient is computed in float16 (the exact bound has nothing to count): only the histogram band
    can see the flush."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Module()
        self.scale.w = nn.Parameter(torch.ones(64))
        self.register_buffer("eye", torch.eye(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x * self.scale.w, self.eye)


LADDER = 2.0 ** (-40 * torch.arange(64.0) / 63)


def _ladder_loss(out: Any, _batch: Any) -> torch.Tensor:
    return (out.float() * LADDER).sum()


def test_a_smooth_ladder_into_the_flush_keeps_the_reference_for_float32_computed_gradients() -> None:
    # At scale 1, w's gradient is the float16 value of 2**(-40 j / 63): flushed for j >= 40 (2**-25.4 and below);
    # the largest, 1, puts the top at 2**15. The histograms put 24 of the 64 values (2**-10 .. 2**-25) within the
    # 15 binades above the threshold, far over 0.1 %: the reference runs, and counts what scale 2**15 keeps.
    model = Ladder()
    before = snapshot(model)
    report = ampdoctor.diagnose(model, torch.ones(1, 64), loss_fn=_ladder_loss, scale=1.0)
    assert_untouched(model, before)
    assert ("underflow reference", 2.0**15, "float16", "ran") in _passes(report)
    grads = []
    for scale in (1.0, 2.0**15):  # the same backward by hand
        w = torch.ones(64, requires_grad=True)
        with torch.autocast("cpu", dtype=FP16):
            out = nn.functional.linear(torch.ones(1, 64) * w, torch.eye(64))
        (grad,) = torch.autograd.grad(_ladder_loss(out, None) * scale, [w])
        grads.append(grad)
    at_used, reference = grads
    under = report.findings.underflow
    assert under is not None
    assert under.lost == int(((reference != 0) & (at_used == 0)).sum()) == 23  # j = 40 .. 62
    assert under.reference_nonzero == int((reference != 0).sum()) == 63
    assert report.verdict == "underflow"
    assert [s.module for s in under.spots] == ["scale"]


def test_a_hidden_overflow_leaves_the_window_out_and_says_why() -> None:
    # test_hidden_overflow's attention (4 scores -> -inf under softmax) at scale 1: survey, the underflow reference,
    # the detailed re-run that counts and places the hidden overflow, the verification of its remedy. The window
    # (which would bisect on a step the remedy changes) is not measured.
    model = Net(ScoresBeforeScaling())
    before = snapshot(model)
    batch = tokens(300, 300, 10, 1)
    loss = lambda out, _b: out.float().sum()  # noqa: E731
    report = ampdoctor.diagnose(model, batch, loss_fn=loss, device_type="cpu", scale=1.0)
    assert_untouched(model, before)
    assert report.verdict == "hidden_overflow"
    purposes = [p.purpose for p in report.run.passes]
    assert "loss-scale window" not in purposes and len(purposes) <= 5
    assert purposes[:3] == ["survey", "underflow reference", "detail and op zoom"]
    assert report.findings.window is None
    note = next(n for n in report.run.notes if n.startswith("loss-scale window not measured"))
    assert "(attn (matmul))" in note and "scale_window=True" in note
    # Forced: measured on this step (its bottom is the used scale 1, its top the reference's backward at 8192).
    forced = ampdoctor.diagnose(model, batch, loss_fn=loss, device_type="cpu", scale=1.0, scale_window=True)
    window = forced.findings.window
    assert window is not None and (window.min_useful, window.max_safe) == (1.0, 8192.0)
    assert forced.verdict == "hidden_overflow"


class MaskArithmetic(nn.Module):
    """Only sentinels: ``finfo.min`` fills doubled (-65504 * 2 -> -inf) and an additive ``finfo.min`` mask
    (-65504 - 121 or less -> -inf) above the diagonal, both flagged by the survey and classified as mask arithmetic
    by the detailed re-run (test_hidden_overflow.Sentinels without its real overflow)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.proj.weight.fill_(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.proj(x[:, :, :1])
        ok = b @ (-b).transpose(-2, -1)
        above = torch.ones(4, 4, dtype=torch.bool).triu(1)
        scaled = ok.masked_fill(above, F16_MIN) * 2
        masked = ok + torch.zeros(4, 4, dtype=torch.float16).masked_fill(above, F16_MIN)
        return torch.stack([torch.softmax(s, dim=-1) for s in (scaled, masked)]).sum()


def test_sentinels_alone_get_their_window_after_the_classification() -> None:
    # The flagged ops turn out to be sentinels only: the step is healthy and its window is measured after the
    # classification, from the passes already run (the used scale 64 and the reference's top 32768: proj's gradient
    # stays finite up to 32768; the bottom at scale 1 predicted with the wide margin).
    model = MaskArithmetic()
    before = snapshot(model)
    report = ampdoctor.diagnose(model, tokens(100, 50, 20, 11), device_type="cpu", scale=64.0)
    assert_untouched(model, before)
    assert report.verdict == "healthy" and report.findings.hidden == ()
    assert [(p.purpose, p.scale) for p in report.run.passes] == [
        ("survey", 64.0), ("underflow reference", 32768.0), ("detail and op zoom", 64.0)
    ]
    window = report.findings.window
    assert window is not None and (window.min_useful, window.max_safe) == (1.0, 32768.0)
    assert window.reference == (
        "backward at scale 32768, the largest finite; scale 1 predicted to lose under 0.1%, not re-run"
    )
    assert not any(n.startswith("loss-scale window not measured") for n in report.run.notes)


def Wide() -> Counted:  # noqa: N802 (reads as the model it builds)
    """A Linear(64 -> 20) with weight 1/64 that counts its forwards."""
    return Counted(20)


# 256 rows of ones through Wide: out = 1. The loss weights unit i by c_i / 256, so each row's float16 output
# gradient is c_i / 256 * S and unit i's 64 weight gradients are c_i * S (the sum of the 256 rows).
#   c_0 = 24: 24 * S fits up to S = 2048 (the top); units 1-18: 1.5 * 2**-4, never lost;
#   unit 19: 1.5 * 2**-20: its weight gradient 1.5 * 2**-20 * S never flushes, but each row's 1.5 * 2**-28 * S
#   flushes at S <= 4 (1.5 * 2**-26 < 2**-25), so its 64 weights (5 % of 1280) are lost below 8.
WIDE = [24.0] + [1.5 * 2.0**-4] * 18 + [1.5 * 2.0**-20]


def test_a_flush_only_activation_gradients_show_is_confirmed_and_searched_upwards() -> None:
    # The parameter histograms at 2048 see nothing lost even at scale 1; the output gradient's histogram shows 5 %
    # of its values lost at 1, 2 and 4: not enough to call them useless (10 %), too much to skip the bottom's
    # re-run (1 %). Scale 1 is re-run and loses 5 %; the search goes up 1, then 2 exponents (2 loses, 8 keeps),
    # and bisects the last step (4 loses): the bottom is 8. (Skipped, the window would have said 1.)
    model = Wide()
    weights = torch.tensor(WIDE) / 256
    report = ampdoctor.diagnose(model, torch.ones(256, 64), loss_fn=lambda out, _: (out.float() * weights).sum(),
                                scale=32.0)
    assert [(p.purpose, p.scale) for p in report.run.passes] == [
        ("survey", 32.0), ("underflow reference", 2048.0),
        ("loss-scale window", 1.0), ("loss-scale window", 2.0), ("loss-scale window", 8.0),
        ("loss-scale window", 4.0),
    ]
    window = report.findings.window
    assert window is not None and (window.min_useful, window.max_safe) == (8.0, 2048.0)
    lost = {p.scale: p.lost_share for p in window.probes if p.gradients_finite}
    assert lost == {1.0: 64 / 1280, 2.0: 64 / 1280, 4.0: 64 / 1280, 8.0: 0.0, 32.0: 0.0, 2048.0: 0.0}
    assert window.module_min_useful == {"": 8.0}
    assert report.verdict == "healthy"  # the used scale 32 keeps every value
