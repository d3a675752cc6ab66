"""Remedies for the mechanism, with a margin (issue 18, items 2, 3 and 5): a float32 fallback covers every instance
of the origin's mechanism that overflows or sits inside the margin; it is verified only when the re-run keeps the
margin; a fallback that works is listed even when it runs most of the low-precision work in float32."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import assert_untouched, snapshot
from torch import nn

import ampdoctor
from ampdoctor.analysis.mechanisms import mechanism_of, pattern_of
from ampdoctor.capture.stats import format_limits
from ampdoctor.errors import InvalidInput
from ampdoctor.fixes import verify as verify_module
from ampdoctor.records import ModuleCall, PassTrace, TensorRecord, TensorStats


class Parallel(nn.Module):
    """Identical Linear blocks on the same input x = 100: block i outputs 100 * gains[i] in float16.

    gain 1000 -> 100,000 (inf: the origin); gain 400 -> 40,000 (log2(65504/40000) = 0.71 bits: inside a 1-bit
    margin); gain 1 -> 100 (9.4 bits: outside it).
    """

    def __init__(self, gains: tuple[float, ...]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4, bias=False) for _ in gains)
        with torch.no_grad():
            for block, gain in zip(self.blocks, gains):
                block.weight.copy_(torch.eye(4) * gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((b(x).float().sum() for b in self.blocks), torch.zeros(()))


X = torch.full((2, 4), 100.0)


def _diagnose(model: nn.Module, **kw: object) -> ampdoctor.Report:
    return ampdoctor.diagnose(model, X, loss_fn=lambda out, _: out * 1e-6, device_type="cpu", **kw)  # type: ignore[arg-type]


def _fallback(report: ampdoctor.Report) -> ampdoctor.Recommendation:
    return next(r for r in report.recommendations if r.action == "fp32_fallback")


def test_pattern_of_replaces_indices_of_repeated_structures() -> None:
    assert pattern_of("blocks.0.attn") == "blocks.*.attn" and pattern_of("3.fc") == "*.fc"
    assert pattern_of("layer12x.fc") == "layer12x.fc" and pattern_of("") == ""


def test_fallback_covers_every_instance_that_overflows_or_sits_inside_the_margin() -> None:
    model = Parallel((400.0, 1000.0, 1.0))
    before = snapshot(model)
    report = _diagnose(model)
    assert_untouched(model, before)
    assert report.findings.forward_origin is not None and report.findings.forward_origin.module == "blocks.1"
    rec = _fallback(report)
    # blocks.1 overflows, blocks.0 keeps 0.71 bits (< 1): both; blocks.2 keeps 9.4 bits: not.
    assert rec.modules == ("blocks.1", "blocks.0") and rec.verified
    assert "3 Linear instances (blocks.*) run this code; 2 of 3 need it" in rec.evidence
    assert "blocks.0: 0.71 bits to spare" in rec.evidence
    assert "'blocks.1', 'blocks.0'" in rec.snippet


def test_without_margin_the_sibling_is_left_alone() -> None:
    rec = _fallback(_diagnose(Parallel((400.0, 1000.0)), margin_bits=0))
    assert rec.modules == ("blocks.1",) and rec.verified
    assert "2 Linear instances (blocks.*) run this code; 1 of 2 need it" in rec.evidence


def test_a_fix_that_leaves_an_instance_inside_the_margin_only_holds_at_this_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the grouping (each round adds only the origin) and one re-run allowed, blocks.0 stays in float16
    at 0.71 bits: the fallback is listed, not verified, and says how many bits it has to spare."""
    monkeypatch.setattr(verify_module, "_group", lambda ctx, module, chosen: [module])
    monkeypatch.setattr(verify_module, "MAX_FALLBACK_ROUNDS", 1)
    rec = _fallback(_diagnose(Parallel((400.0, 1000.0))))
    assert rec.modules == ("blocks.1",) and not rec.verified
    assert "holds at this step, with 0.71 bits to spare" in rec.title
    assert "inside the 1-bit margin: blocks.0 (0.71 bits to spare)" in rec.evidence


class Big(nn.Module):
    """One Linear does all the matmul work and overflows (x = 100, weight 1000 * I: 100,000 > 65504)."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            self.big.weight.copy_(torch.eye(4) * 1000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.big(x).float()).sum()


def test_a_working_fallback_is_listed_even_when_it_runs_most_of_the_work_in_float32() -> None:
    report = _diagnose(Big())
    rec = _fallback(report)
    assert rec.modules == ("big",) and rec.verified and rec.cost is not None
    assert rec.cost.fp32_matmul_flop_share == 1.0
    assert "runs 100% of the step's low-precision work in float32" in rec.evidence
    # The fallback (a float16 remedy) comes first; bfloat16 says what hardware it needs.
    actions = [r.action for r in report.recommendations]
    assert actions.index("fp32_fallback") < actions.index("bf16")
    bf16 = next(r for r in report.recommendations if r.action == "bf16")
    assert "compute capability 8.0" in bf16.title and "T4 and V100" in bf16.title


@pytest.mark.parametrize("bad", [-1, 9, True, "1"])
def test_margin_bits_is_checked(bad: object) -> None:
    with pytest.raises(InvalidInput, match="margin_bits"):
        _diagnose(Big(), margin_bits=bad)


def test_an_instance_that_hides_an_overflow_needs_the_remedy() -> None:
    """Hidden overflows (capture.hidden's op records) count in the grouping: a sibling whose output is fine but
    whose scores went to -inf under softmax joins the fallback. Hand-built trace: three attention instances with
    outputs |x| <= 10 (12.7 bits of headroom)."""
    limits = format_limits(torch.float16)
    calls = tuple(
        ModuleCall(i, f"blocks.{i}.attn", 0, "SelfAttention", None, i,
                   outputs=(TensorRecord("out", TensorStats("float16", (4,), min=-10.0, max=10.0)),))
        for i in range(3)
    )
    trace = PassTrace(1.0, False, calls, (), (), (), None, False)
    mech = mechanism_of(trace, "blocks.1.attn", limits, 1.0, hiding={"blocks.0.attn"})
    assert mech is not None and mech.needing == ("blocks.0.attn",)
    assert mech.sentence() == (
        "3 SelfAttention instances (blocks.*.attn) run this code; 1 of 3 need it (blocks.0.attn: hides an overflow)"
    )
    assert mechanism_of(trace, "blocks.1.attn", limits, 1.0) is not None
    assert mechanism_of(trace, "blocks.1.attn", limits, 1.0).needing == ()  # type: ignore[union-attr]
    # The records: a flagged op (count None: the survey) and a counted one hide an overflow; count 0 does not.
    ops = tuple(SimpleNamespace(module=m, count=c) for m, c in (("a", None), ("b", 3), ("c", 0)))
    assert verify_module._hiding(SimpleNamespace(op_overflows=ops)) == {"a", "b"}  # type: ignore[arg-type]
