"""The loss-scale window on a model with hand-set gradient magnitudes (CPU, float16)."""

from __future__ import annotations

import torch
from helpers import assert_untouched, snapshot
from torch import nn

import ampdoctor

# out = Linear(1 -> 4, weight 1) of x = 1, so out = [1, 1, 1, 1] in float16 and the loss sum(out * C) sends
# the gradient C * S back to the float16 output (S the loss scale); the weight gradient is exactly that.
#   overflow: 2**4 * S >= 65520 first at S = 2**12 (65536 -> inf): the largest safe scale is 2**11 = 2048.
#   underflow: 2**-30 * S rounds to zero while it is <= 2**-25, i.e. for S <= 2**5 = 32; 2**-20 * S never does
#   for S >= 1. One of the four gradient values (25 %) is lost below 64: the smallest useful scale is 2**6 = 64.
C = torch.tensor([2.0**-10, 2.0**-20, 2.0**-30, 2.0**4])


def _model() -> nn.Linear:
    layer = nn.Linear(1, 4, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    return layer


def _loss(out: torch.Tensor, _batch: torch.Tensor) -> torch.Tensor:
    return (out.float() * C).sum()


def test_window_from_hand_set_gradient_magnitudes() -> None:
    model = _model()
    before = snapshot(model)
    report = ampdoctor.diagnose(model, torch.ones(1, 1), loss_fn=_loss, scale=8.0)
    assert_untouched(model, before)
    window = report.findings.window
    assert window is not None
    assert (window.min_useful, window.max_safe) == (64.0, 2048.0)
    assert not window.empty and not window.contains_current  # 8 loses a quarter of the gradient
    assert window.module_min_useful == {"": 64.0}
    probes = {p.scale: p for p in window.probes}
    assert probes[4096.0].gradients_finite is False
    assert probes[32.0].lost_share == 0.25 and probes[64.0].lost_share == 0.0
    # at the used scale 8: 1 of 4 values lost -> underflow verdict, and the fix is a scale inside the window
    assert report.findings.underflow is not None and report.findings.underflow.lost == 1
    assert report.verdict == "underflow"
    assert report.recommendations[0].action == "loss_scale"
    assert "init_scale=1024.0" in report.recommendations[0].snippet  # 1 bit below the top 2048
    assert report.recommendations[0].verified and "0.00% of gradient values lost" in report.recommendations[0].evidence
    assert "Loss-scale window" in str(report)


def test_default_scale_overflows_harmlessly_and_the_window_says_where_to_go() -> None:
    report = ampdoctor.diagnose(_model(), torch.ones(1, 1), loss_fn=_loss)  # 65536: 2**4 * 65536 overflows
    assert report.verdict == "scale_overflow"
    scale = report.findings.scale
    assert scale is not None and scale.largest_finite_scale == 2048.0 and scale.harmless
    window = report.findings.window
    assert window is not None and (window.min_useful, window.max_safe) == (64.0, 2048.0)
    assert report.exit_code == 0


def test_empty_window_when_float16_is_too_narrow() -> None:
    # Add 2**-40: it needs S >= 2**16 to survive, while 2**4 * S overflows from 2**12 on. No scale fits. Values
    # lost at every float16 scale show only against a float32 backward, which is opt-in.
    spread = torch.tensor([2.0**-40, 2.0**-40, 2.0**-40, 2.0**4])
    report = ampdoctor.diagnose(
        _model(), torch.ones(1, 1), loss_fn=lambda out, _: (out.float() * spread).sum(), scale=1024.0,
        fp32_reference=True,
    )
    window = report.findings.window
    assert window is not None and window.empty and window.min_useful is None and window.max_safe == 2048.0
    assert any("too narrow" in w for w in report.findings.warnings)
    assert report.recommendations[0].action == "bf16"
