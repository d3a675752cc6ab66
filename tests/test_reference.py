"""diagnose(..., reference=True): each leaf call against a float32 re-run of itself (CPU, fp16 and bf16)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_untouched, snapshot
from torch import nn

import ampdoctor

# Output magnitudes of the "tiny" layer: 8 inputs of 1 times the weight. float16 flushes |x| <= 2**-25
# (~3e-8) to zero, so weights of 1e-10 give 8e-10: zero in float16, fine in float32. bfloat16 has float32's
# exponent range but flushes below ~9e-41 (its smallest subnormal / 2), and its weight cast flushes 1e-43.
TINY_WEIGHT = {torch.float16: 1e-10, torch.bfloat16: 1e-43}


def _model(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2), nn.BatchNorm1d(8), nn.Linear(8, 8, bias=False), nn.ReLU())
    with torch.no_grad():
        model[3].weight.fill_(TINY_WEIGHT[dtype])
    return model


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_flags_the_layer_whose_tiny_outputs_flush_to_zero(dtype: torch.dtype) -> None:
    model = _model(dtype)
    model.train()
    before = snapshot(model)
    batch = torch.ones(4, 8)
    report = ampdoctor.diagnose(
        model, batch, loss_fn=lambda out, _: out.float().mean(), dtype=dtype, reference=True, verify=False
    )
    assert_untouched(model, before)  # BatchNorm statistics and the dropout RNG are untouched by the re-runs
    precision = report.findings.precision
    assert precision is not None
    by_call = {c.label: c for c in precision.comparisons}
    assert set(by_call) == {"0", "1", "2", "3", "4"}  # the leaves; not the Sequential itself
    tiny = by_call["3"]
    assert tiny.underflow_count == tiny.reference_nonzero == 4 * 8  # every float32-nonzero value is 0 here
    assert tiny.relative_error == 1.0
    assert precision.jump == "3"
    assert "3" in precision.underflow_calls
    # dropout re-ran with the same mask (same RNG state), so it matches float32 up to rounding
    assert by_call["1"].relative_error < 1e-2 and by_call["1"].underflow_count == 0
    assert "Against a float32 re-run of each call" in str(report)


def test_reference_at_a_chosen_depth() -> None:
    inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    model = nn.Sequential(inner, nn.Linear(4, 2))
    report = ampdoctor.diagnose(model, torch.ones(2, 4), reference=1, verify=False, scale_window=False)
    precision = report.findings.precision
    assert precision is not None
    assert [c.label for c in precision.comparisons] == ["0", "1"]  # depth 1: the Sequential child and the head


def test_reference_is_off_by_default() -> None:
    report = ampdoctor.diagnose(_model(torch.float16), torch.ones(4, 8), verify=False, scale_window=False)
    assert report.findings.precision is None and report.trace.comparisons == ()
