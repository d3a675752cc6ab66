"""Code-level remedies at the origin's source line (issue 18, item 4): exp of unbounded values, squares and sums,
an eps below float16's resolution, a loss computed in float16.

For each: a tiny model with the pattern gets the rewrite first, verified, with the right text and snippet, and the
working float32 fallback still listed after it; a model without the pattern gets no such suggestion; and the mode
that verified it (``fixes.rewrites_lines``) computes exactly what the rewritten code, written here by hand and run
under the same CPU float16 autocast, computes (bit for bit, and the same peak as the evidence reports).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch
from helpers import assert_untouched, snapshot
from torch import nn

import ampdoctor
from ampdoctor.capture.passes import resolve_loss
from ampdoctor.fixes.rewrites import finite_peak
from ampdoctor.fixes.rewrites_lines import Float32AtLine, LossInFloat32, SubtractMax, eps_at_line

FP16_MAX = 65504.0
X = torch.ones(2, 4)


def _linear(rows: list[float]) -> nn.Linear:
    """A Linear whose output on a row of ones is ``4 * rows[i]`` at unit i."""
    layer = nn.Linear(4, len(rows), bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(rows)[:, None].expand(len(rows), 4))
    return layer


class Net(nn.Module):
    """The pattern in a child module (so a float32 fallback of it exists), a Linear after it."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def _diagnose(model: nn.Module, **kwargs: Any) -> ampdoctor.Report:
    before = snapshot(model)
    report = ampdoctor.diagnose(model, X, device_type="cpu", **kwargs)
    assert_untouched(model, before)
    return report


def _loss(out: torch.Tensor, _: object) -> torch.Tensor:
    return out.float().mean()


def _rules(report: ampdoctor.Report) -> list[str]:
    return [r.rule for r in report.recommendations]


def _first_is_verified_rewrite_then_fallback(
    report: ampdoctor.Report, rule: str, times: int = 1
) -> ampdoctor.Recommendation:
    first = report.recommendations[0]
    assert first.rule == rule and first.verified, report.to_text()
    assert f"computing the rewritten arithmetic ({times} time(s) per step)" in first.evidence
    # Ranked before the module fallback, which still is listed and works (never withheld).
    fallback = next(r for r in report.recommendations if r.action == "fp32_fallback")
    assert fallback.modules == ("block",) and fallback.verified
    assert _rules(report).index(rule) < report.recommendations.index(fallback)
    return first


def _origin_line(report: ampdoctor.Report) -> tuple[str, int]:
    origin = report.forward_origin
    assert origin is not None and origin.op is not None and origin.op.location is not None
    return origin.op.location.file, origin.op.location.line


def _spare_bits(evidence: str) -> float:
    return float(evidence.split("keep ")[1].split(" bits")[0])


def _run(model: nn.Module, mode: Any = None) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        if mode is None:
            return model(X)
        with mode:
            return model(X)


# -- exp of unbounded values ---------------------------------------------------------------------------------


class SoftmaxByHand(nn.Module):
    """exp(12) = 162755 is past 65504: inf, and inf / inf = NaN in the normalisation."""

    def __init__(self, rows: list[float]) -> None:
        super().__init__()
        self.fc = _linear(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(self.fc(x))
        return e / e.sum(-1, keepdim=True)


class SoftmaxSubtractMax(SoftmaxByHand):
    """The rewrite, by hand."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        e = (h - h.amax(-1, keepdim=True)).exp()
        return e / e.sum(-1, keepdim=True)


UNBOUNDED = [3.0, 2.5, 2.0, 1.5]  # logits 12, 10, 8, 6
BOUNDED = [2.0, 1.5, 1.0, 0.5]  # logits 8, 6, 4, 2: exp(8) = 2981, the sum 3484 fits


def test_exp_of_unbounded_values_gets_subtract_the_max_verified() -> None:
    report = _diagnose(Net(SoftmaxByHand(UNBOUNDED)), loss_fn=_loss)
    assert report.verdict == "overflow"  # NaN that follows from an inf (inf / inf)
    first = _first_is_verified_rewrite_then_fallback(report, "subtract_max")
    assert first.action == "rewrite" and first.modules == ("block",)
    assert "subtract the max before exp" in first.title and "logsumexp" in first.title
    assert "# was: e = torch.exp(self.fc(x))" in first.snippet
    assert "e = (x - x.amax(-1, keepdim=True)).exp()" in first.snippet
    # The evidence's margin is the rewritten exp's peak: exp(0) = 1, log2(65504 / 1) = 16.00 bits.
    hand = SoftmaxSubtractMax(UNBOUNDED)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        h = hand.fc(X)
        peak = finite_peak((h - h.amax(-1, keepdim=True)).exp())
    assert _spare_bits(first.evidence) == pytest.approx(math.log2(FP16_MAX / peak), abs=0.005)


def test_a_finite_exp_gets_no_subtract_the_max() -> None:
    report = _diagnose(Net(SoftmaxByHand(BOUNDED)), loss_fn=_loss)
    assert report.verdict == "healthy" and "subtract_max" not in _rules(report)


def test_subtract_max_emulation_is_the_rewritten_code() -> None:
    model = Net(SoftmaxByHand(UNBOUNDED))
    report = _diagnose(model, loss_fn=_loss)
    hand = Net(SoftmaxSubtractMax(UNBOUNDED))
    hand.load_state_dict(model.state_dict())
    mode = SubtractMax(*_origin_line(report))
    emulated, rewritten = _run(model, mode), _run(hand)
    assert mode.applied == 1 and torch.isfinite(rewritten).all()
    assert torch.equal(emulated, rewritten)
    assert not torch.isfinite(_run(model)).all()  # and the original is what diagnose saw


# -- squares, norms and long sums ----------------------------------------------------------------------------


class Power(nn.Module):
    """An STFT-like log power spectrum: 200**2 = 40000 fits float16, 200**2 + 200**2 = 80000 does not."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.re = _linear([value] * 4)
        self.im = _linear([value] * 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        re, im = self.re(x), self.im(x)
        return torch.log(re**2 + im**2)


class PowerFloat32(Power):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        re, im = self.re(x), self.im(x)
        return torch.log(re.float() ** 2 + im.float() ** 2)


class Variance(nn.Module):
    """A standard deviation by hand: deviations of +-300 square to 90000, past float16 (the std is inf)."""

    def __init__(self, spread: float) -> None:
        super().__init__()
        self.fc = _linear([spread, -spread, spread, -spread])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        u = h.mean(-1, keepdim=True)
        return (h - u).pow(2).mean(-1, keepdim=True).sqrt().expand_as(h)


class VarianceFloat32(Variance):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        u = h.mean(-1, keepdim=True)
        return (h - u).float().pow(2).mean(-1, keepdim=True).sqrt().expand_as(h)


# (pattern, its rewrite by hand, weight that overflows, weight that fits, origin op, float16 ops cast up: the two
# squares; or the square, whose float32 result the mean then takes as it comes)
SQUARES: list[tuple[Callable[[float], nn.Module], Callable[[float], nn.Module], float, float, str, int]] = [
    (Power, PowerFloat32, 50.0, 20.0, "aten::add", 2),  # 4 * 50 = 200 per component; 80 with 20
    (Variance, VarianceFloat32, 75.0, 25.0, "aten::pow", 1),  # deviations 300; 100 squares to 10000 and fits
]


@pytest.mark.parametrize("make, _, big, small, op, times", SQUARES, ids=["stft_power", "variance"])
def test_squares_that_overflow_get_accumulate_in_float32_verified(
    make: Callable[[float], nn.Module], _: Any, big: float, small: float, op: str, times: int
) -> None:
    report = _diagnose(Net(make(big)), loss_fn=_loss)
    assert report.verdict == "overflow"
    origin = report.forward_origin
    assert origin is not None and origin.op is not None and origin.op.op.startswith(op)
    first = _first_is_verified_rewrite_then_fallback(report, "squares_fp32", times)
    assert "square and sum in float32" in first.title and "x.float().pow(2)" in first.snippet
    assert first.snippet.startswith("# was: " + origin.op.location.code.strip())  # type: ignore[union-attr]


@pytest.mark.parametrize("make, _, big, small, op, times", SQUARES, ids=["stft_power", "variance"])
def test_squares_that_fit_get_no_float32_rewrite(
    make: Callable[[float], nn.Module], _: Any, big: float, small: float, op: str, times: int
) -> None:
    report = _diagnose(Net(make(small)), loss_fn=_loss)
    assert report.forward_origin is None and "squares_fp32" not in _rules(report)


@pytest.mark.parametrize("make, by_hand, big, small, op, times", SQUARES, ids=["stft_power", "variance"])
def test_squares_emulation_is_the_rewritten_code(
    make: Callable[[float], nn.Module], by_hand: Callable[[float], nn.Module], big: float, small: float, op: str,
    times: int,
) -> None:
    model = Net(make(big))
    report = _diagnose(model, loss_fn=_loss)
    hand = Net(by_hand(big))
    hand.load_state_dict(model.state_dict())
    mode = Float32AtLine(*_origin_line(report))
    emulated, rewritten = _run(model, mode), _run(hand)
    assert mode.applied == times and torch.isfinite(rewritten).all()
    assert torch.equal(emulated, rewritten)
    block_out = _run(hand.block)
    assert block_out.dtype == torch.float32  # kept in float32: no cast back


# -- an eps below float16's resolution -----------------------------------------------------------------------


class Standardize(nn.Module):
    """(h - mean) / (std + 1e-12) on constant rows: std = 0, and 1e-12 is 0 in float16, so 0 / 0 = NaN."""

    def __init__(self, rows: list[float]) -> None:
        super().__init__()
        self.fc = _linear(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return (h - h.mean(-1, keepdim=True)) / (h.std(-1, keepdim=True) + 1e-12)


class StandardizeRepresentable(Standardize):
    """The same with an eps float16 holds (1e-3 is a normal float16 number): 0 / 1e-3 = 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return (h - h.mean(-1, keepdim=True)) / (h.std(-1, keepdim=True) + 1e-3)


class StandardizeNoEps(Standardize):
    """A division by zero with no eps at all: no eps to replace, so no finfo suggestion."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return (h - h.mean(-1, keepdim=True)) / h.std(-1, keepdim=True)


class StandardizeFinfo(Standardize):
    """The rewrite, by hand."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        s = h.std(-1, keepdim=True)
        return (h - h.mean(-1, keepdim=True)) / (s + torch.finfo(s.dtype).eps)


CONSTANT = [0.5, 0.5, 0.5, 0.5]


def test_an_eps_that_rounds_to_zero_gets_an_eps_from_finfo_verified() -> None:
    report = _diagnose(Net(Standardize(CONSTANT)), loss_fn=_loss)
    assert report.verdict == "nan"
    first = _first_is_verified_rewrite_then_fallback(report, "finfo_eps")
    assert "1e-12 is below float16's smallest normal (6.10352e-05)" in first.title
    assert "torch.finfo(std.dtype).eps" in first.snippet
    # The evidence's peak is the rewritten add's: std 0 + finfo(float16).eps = 2**-10.
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        s = Standardize(CONSTANT).fc(X).std(-1, keepdim=True)
        peak = finite_peak(s + torch.finfo(s.dtype).eps)
    assert peak == 2.0**-10 and _spare_bits(first.evidence) == pytest.approx(math.log2(FP16_MAX / peak), abs=0.005)


@pytest.mark.parametrize("block", [StandardizeRepresentable(CONSTANT), Standardize([0.5, 0.25, 0.5, 0.25])],
                         ids=["representable_eps", "nonzero_std"])
def test_a_representable_eps_or_no_division_by_zero_gets_no_finfo_suggestion(block: nn.Module) -> None:
    report = _diagnose(Net(block), loss_fn=_loss)
    assert report.forward_origin is None and "finfo_eps" not in _rules(report)


def test_a_division_by_zero_without_an_eps_gets_no_finfo_suggestion() -> None:
    report = _diagnose(Net(StandardizeNoEps(CONSTANT)), loss_fn=_loss)
    assert report.verdict == "nan" and "finfo_eps" not in _rules(report)
    assert report.recommendations[0].action == "fp32_fallback"


def test_eps_emulation_is_the_rewritten_code() -> None:
    model = Net(Standardize(CONSTANT))
    report = _diagnose(model, loss_fn=_loss)
    hand = Net(StandardizeFinfo(CONSTANT))
    hand.load_state_dict(model.state_dict())
    mode = eps_at_line(*_origin_line(report))
    emulated, rewritten = _run(model, mode), _run(hand)
    assert mode.applied == 1 and torch.isfinite(rewritten).all()
    assert torch.equal(emulated, rewritten)


# -- a loss computed in float16 ------------------------------------------------------------------------------

TARGET = torch.zeros(2, 8, dtype=torch.float16)  # targets stored in float16, as many datasets do


def _mse_sum(out: torch.Tensor, _: object) -> torch.Tensor:
    return ((out - TARGET) ** 2).sum()  # 200**2 = 40000 per element fits; their sum (640000) does not


def _mse_sum_float32(out: torch.Tensor, _: object) -> torch.Tensor:
    return ((out.float() - TARGET.float()) ** 2).mean()


def _mse_model() -> nn.Module:
    return nn.Sequential(_linear([50.0] * 8))


def test_a_loss_that_overflows_in_float16_gets_the_loss_outside_autocast_verified() -> None:
    report = _diagnose(_mse_model(), loss_fn=_mse_sum)
    origin = report.forward_origin
    assert origin is not None and origin.module == "<loss>" and origin.op is not None
    assert origin.op.op == "aten::sum" and origin.op.output_dtype == "float16"
    first = report.recommendations[0]
    assert first.rule == "loss_fp32" and first.action == "fix_loss" and first.verified, report.to_text()
    assert "compute the loss outside autocast, in float32" in first.title and "aten::sum" in first.title
    assert first.snippet == "with torch.autocast('cpu', enabled=False):\n    loss = loss_fn(output.float(), targets)"


def test_a_loss_in_float32_already_gets_no_loss_rewrite() -> None:
    report = _diagnose(_mse_model(), loss_fn=_mse_sum_float32)
    assert report.forward_origin is None and "loss_fp32" not in _rules(report)


def test_loss_emulation_is_the_loss_outside_autocast() -> None:
    """LossInFloat32 acts on the loss (what capture's ``resolve_loss`` runs) and on nothing else."""
    model = _mse_model()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        with LossInFloat32() as mode:
            out = model(X)
            emulated, _ = resolve_loss(out, X, _mse_sum)
        # The sub takes the float16 output (counted); pow and sum follow in float32; the model's Linear is left.
        assert out.dtype == torch.float16 and mode.applied == 1
        with torch.autocast("cpu", enabled=False):
            rewritten = _mse_sum(out.float(), X)
        assert not torch.isfinite(_mse_sum(out, X))
    assert emulated.dtype == torch.float32 and torch.isfinite(rewritten)
    assert torch.equal(emulated, rewritten)


def _square(t: torch.Tensor) -> torch.Tensor:
    return t * t  # its own line: not the origin's


class SquareOfHelper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = _linear([4.0] * 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(_square(self.fc(x)) ** 2)  # 16**2 = 256 fits; 256**2 = 65536 does not


def test_the_line_rewrite_acts_at_its_line_only() -> None:
    """Ops of a function called from the origin's line run at their own line (the op zoom's innermost user
    frame): the helper's square stays float16, only the line's own square runs in float32."""
    model = Net(SquareOfHelper())
    report = _diagnose(model, loss_fn=_loss)
    origin = report.forward_origin
    assert origin is not None and origin.op is not None and origin.op.op.startswith("aten::pow")
    assert report.recommendations[0].rule == "squares_fp32" and report.recommendations[0].verified
    mode = Float32AtLine(*_origin_line(report))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        with mode:
            emulated = model.block(X)
        inner = _square(model.block.fc(X))
        rewritten = torch.log(inner.float() ** 2)
    assert mode.applied == 1 and inner.dtype == torch.float16 and torch.equal(emulated, rewritten)
