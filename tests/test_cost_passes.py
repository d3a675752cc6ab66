"""Which passes a diagnosis runs (issue 13): probes are backwards on the survey's graph, the loss-scale window is
predicted and its ends confirmed, lost gradient values are counted exactly against the largest finite scale, and
the float32 step is opt-in. Models with hand-set magnitudes carry their expected answer in comments."""

from __future__ import annotations

from typing import Any

import torch
from helpers import assert_untouched, snapshot
from torch import nn

import ampdoctor
from ampdoctor.capture.options import PassOptions
from ampdoctor.capture.passes import PassSpec, SharedForward, run_pass
from ampdoctor.capture.state import StateGuard

FP16 = torch.float16


class Counted(nn.Linear):
    """A Linear(64 -> 4) with weight 1/64 that counts its forwards (its gradients outweigh its activations, so a
    survey keeps its graph for the probes); ``Counted(20)``: 20 outputs."""

    def __init__(self, outputs: int = 4) -> None:
        super().__init__(64, outputs, bias=False)
        with torch.no_grad():
            self.weight.fill_(1 / 64)
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return super().forward(x)


def _weighted(c: list[float]) -> Any:
    weights = torch.tensor(c)
    return lambda out, _batch: (out.float() * weights).sum()


def _passes(report: ampdoctor.Report) -> list[tuple[str, float, str, str]]:
    return [(p.purpose, p.scale, p.dtype, p.status) for p in report.run.passes]


# x = ones(1, 64): out = 64 / 64 = 1 per unit in float16; the loss sum(out * C) sends the gradient C * S back to
# the float16 output, and every weight gradient of unit i is exactly C_i * S (64 per unit).
# C = 1.5 * [2**-10, 2**-20, 2**-30, 2**4]:
#   top: 1.5 * 2**4 * S = 24 S stays below 65520 up to S = 2048 (2**11); 4096 gives 98304 -> inf.
#   bottom: 1.5 * 2**-30 * S flushes to zero while it is below 2**-25: S <= 16; at 32 it rounds to 2**-24.
C = [1.5 * 2.0**-10, 1.5 * 2.0**-20, 1.5 * 2.0**-30, 1.5 * 2.0**4]
X = torch.ones(1, 64)


def test_healthy_model_survey_plus_two_backwards_on_its_graph() -> None:
    model = Counted()
    before = snapshot(model)
    report = ampdoctor.diagnose(model, X, loss_fn=_weighted(C), scale=32.0)
    assert_untouched(model, before)
    assert report.verdict == "healthy" and report.recommendations == ()
    # The top predicted from the survey's largest gradient (24 * 32 = 768) and confirmed at 2048; the bottom
    # predicted from the histogram of the 2048 backward at 32, already measured (the survey), so the other side
    # of that end is confirmed at 16: one forward for all three passes.
    assert _passes(report) == [
        ("survey", 32.0, "float16", "ran"),
        ("underflow reference", 2048.0, "float16", "ran"),
        ("loss-scale window", 16.0, "float16", "ran"),
    ]
    assert model.forwards == 1
    window = report.findings.window
    assert window is not None and (window.min_useful, window.max_safe) == (32.0, 2048.0)
    probes = {p.scale: (p.gradients_finite, p.lost_share) for p in window.probes}
    # 16, 32 and 2048 measured; 4096 follows from 24 * 4096 >= 65520 by exact power-of-two arithmetic
    assert probes == {16.0: (True, 0.25), 32.0: (True, 0.0), 2048.0: (True, 0.0), 4096.0: (False, None)}
    under = report.findings.underflow
    assert under is not None and (under.lost, under.reference_nonzero) == (0, 256)


def test_a_bottom_at_scale_one_predicted_with_a_margin_needs_no_re_run() -> None:
    # C = 1.5 * [2**-4, 2**-6, 2**-8, 2**4]: the top is 2048 again (24 * S), and even at scale 1 the smallest
    # gradient 1.5 * 2**-8 is far above float16's flush threshold 2**-25: scale 1 is predicted to lose nothing,
    # weights and the output gradient alike, so the window needs no second re-run.
    # Measured (scale_window=True): the top confirmed by one re-run, which is also the underflow reference.
    report = ampdoctor.diagnose(Counted(), X, loss_fn=_weighted([1.5 * 2.0**-4, 1.5 * 2.0**-6, 1.5 * 2.0**-8, 24.0]),
                                scale=32.0, scale_window=True)
    assert _passes(report) == [("survey", 32.0, "float16", "ran"), ("underflow reference", 2048.0, "float16", "ran")]
    window = report.findings.window
    assert window is not None and (window.min_useful, window.max_safe) == (1.0, 2048.0)
    assert window.reference.endswith("scale 1 predicted to lose under 0.1%, not re-run")
    under = report.findings.underflow
    assert under is not None and (under.lost, under.reference_nonzero) == (0, 256)


def test_where_activations_outweigh_the_gradients_each_probe_runs_its_own_forward() -> None:
    # 256 rows through a Linear(64 -> 4): the output (2 KiB in float16) outweighs the weight's gradient (1 KiB), so
    # keeping the graph through the backward would cost more than a training step holds: the forward re-runs.
    # (The loss gradient C / 256 * S reaching the output flushes in float16 below S = 8 before any weight sees it:
    # unit 1's 1.5 * 2**-28 * S is lost at S <= 4. The parameter histograms alone would predict the bottom too low;
    # the output gradient's histogram at the top shows a third of its values lost at 4 and none at 8, so the
    # bottom is predicted at 8 and one re-run confirms it.)
    model = Counted()
    report = ampdoctor.diagnose(model, X.expand(256, 64), loss_fn=_weighted([c / 256 for c in C]), scale=32.0)
    assert [(p.purpose, p.scale) for p in report.run.passes] == [
        ("survey", 32.0), ("underflow reference", 2048.0), ("loss-scale window", 8.0),
    ]
    assert model.forwards == len(report.run.passes)
    window = report.findings.window
    assert window is not None and (window.min_useful, window.max_safe) == (8.0, 2048.0)
    assert window.module_min_useful == {"": 8.0}  # never below a scale measured to lose


def test_lost_values_are_counted_exactly_against_the_largest_finite_scale() -> None:
    report = ampdoctor.diagnose(Counted(), X, loss_fn=_weighted(C), scale=8.0)
    # The same backward by hand at the used scale and at the reference scale 2048.
    layer = nn.Linear(64, 4, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1 / 64)
    grads = []
    for scale in (8.0, 2048.0):
        with torch.autocast("cpu", dtype=FP16):
            out = layer(X)
        (grad,) = torch.autograd.grad(_weighted(C)(out, None) * scale, [layer.weight])
        grads.append(grad)
    at_used, reference = grads
    under = report.findings.underflow
    assert under is not None and under.reference == "backward at scale 2048, the largest finite"
    assert under.lost == int(((reference != 0) & (at_used == 0)).sum()) == 64
    assert under.reference_nonzero == int((reference != 0).sum()) == 256
    assert report.verdict == "underflow"  # 25 % >= 5 %
    assert any("fp32_reference=True adds one float32 step" in n for n in report.run.notes)


def test_float32_reference_is_opt_in_and_sees_what_no_scale_keeps() -> None:
    # 2**-40 * S needs S >= 2**16 to survive while 2**4 * S overflows from 4096: lost at every float16 scale.
    spread = [2.0**-40, 2.0**-40, 2.0**-40, 2.0**4]
    default = ampdoctor.diagnose(Counted(), X, loss_fn=_weighted(spread), scale=1024.0)
    assert all(p.dtype != "float32" for p in default.run.passes)
    assert default.findings.window is not None and not default.findings.window.empty  # blind without float32
    opted = ampdoctor.diagnose(Counted(), X, loss_fn=_weighted(spread), scale=1024.0,
                               fp32_reference=True)
    assert ("underflow reference", 1.0, "float32", "ran") in _passes(opted)
    under = opted.findings.underflow
    assert under is not None and (under.lost, under.reference_nonzero) == (192, 256)  # vs float32: 3 of 4 rows
    assert opted.findings.window is not None and opted.findings.window.empty


def test_used_scale_at_the_top_is_confirmed_one_scale_up() -> None:
    # 24 * 2048 = 49152 fits, 24 * 4096 does not: the used scale 2048 is the top, confirmed by a backward at 4096.
    # 49152 is within a bit of the float16 max: the near-limit warning asks for the detailed re-run.
    report = ampdoctor.diagnose(Counted(), X, loss_fn=_weighted(C), scale=2048.0)
    assert _passes(report) == [
        ("survey", 2048.0, "float16", "ran"),
        ("underflow reference", 4096.0, "float16", "ran"),
        ("loss-scale window", 32.0, "float16", "ran"),
        ("detail and op zoom", 2048.0, "float16", "ran"),
    ]
    assert report.findings.underflow is None  # no scale keeps more than the used one
    assert any("already the largest finite one" in n for n in report.run.notes)
    window = report.findings.window
    assert window is not None and (window.min_useful, window.max_safe) == (32.0, 2048.0)


def test_scale_overflow_probes_one_then_the_predicted_top() -> None:
    # At 65536 the output gradient 24 * 65536 is inf. Scale 1 is finite; its largest gradient 24 predicts 2048.
    model = Counted()
    report = ampdoctor.diagnose(model, X, loss_fn=_weighted(C))
    assert report.verdict == "scale_overflow"
    scale = report.findings.scale
    assert scale is not None and scale.largest_finite_scale == 2048.0 and scale.harmless
    assert scale.analysed_scale == 4096.0  # the detailed re-run places the backward origin where it starts
    purposes = _passes(report)
    assert purposes[:3] == [
        ("survey", 65536.0, "float16", "ran"),
        ("scale probe", 1.0, "float16", "ran"),
        ("scale probe", 2048.0, "float16", "ran"),
    ]
    assert ("detail and op zoom", 4096.0, "float16", "ran") in purposes
    assert report.exit_code == 0


def test_a_probe_on_the_shared_graph_equals_a_fresh_pass() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.GELU(), nn.Linear(16, 4))
    spec = PassSpec(
        root=model, names={id(m): n for n, m in model.named_modules()}, params=list(model.named_parameters()),
        batch=torch.randn(4, 8), loss_fn=None, device_type="cpu", dtype=FP16, backward=True,
    )
    guard = StateGuard(model, spec.params)
    share = SharedForward()
    histograms = PassOptions(histograms=1)
    try:
        run_pass(spec, 1024.0, histograms, guard, share=share)
        # The graph is kept for the next backward; no forward runs on it, so the modules' hooks are gone already.
        assert share.step is not None
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
        shared, _ = run_pass(spec, 2.0**20, histograms, guard, share=share)
        shared_hist = dict(share.histograms)
    finally:
        share.release()
    fresh_share = SharedForward()
    try:
        fresh, _ = run_pass(spec, 2.0**20, histograms, guard, share=fresh_share)
    finally:
        fresh_share.release()  # a kept graph holds its pass's hooks and global state until released
    guard.restore()
    assert shared == fresh  # the same dropout masks (rewound RNG), the same gradients
    assert shared_hist and shared_hist.keys() == {name for name, _ in model.named_parameters()}


def test_the_loss_scale_verification_reuses_the_probe_at_that_scale() -> None:
    # big's input gradient is 1280 * scale: finite up to 32. The loss-scale recommendation (32) is checked
    # against the probe that already ran at 32: each (scale, dtype) plain pass runs once per diagnosis.
    from helpers import constant_linear

    model = nn.Sequential()
    model.add_module("pre", constant_linear(64, 64, 1e-4))
    model.add_module("big", constant_linear(64, 64, 20.0))
    report = ampdoctor.diagnose(model, torch.full((4, 64), 1e-3), loss_fn=lambda out, _: out.float().sum(),
                                device_type="cpu")
    assert report.recommendations[0].action == "loss_scale" and report.recommendations[0].verified
    plain = [(p.scale, p.dtype) for p in report.run.passes if p.purpose != "detail and op zoom"]
    assert len(plain) == len(set(plain)), report.run.passes
