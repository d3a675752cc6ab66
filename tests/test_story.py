"""The stories of issue 18's "done when", as a user would live them: diagnose, apply the first verified remedy
exactly as its snippet says, train. Real CPU float16 autocast throughout.

- The sensor story: a 2-block attention model without LayerNorm on raw readings (mean 400, std 100), scores
  computed before the 1/sqrt(d) scaling. ``blocks.1.attn`` overflows; ``blocks.0.attn``'s scores already made
  -inf values that its softmax turned into zeros (a hidden overflow). The first verified float32 fallback,
  applied by running its snippet, trains 20 AdamW steps (lr 1e-3) under GradScaler defaults with a finite loss at
  every step, taking at least half of them.
- N identical attention blocks on one input: one overflows first, one hides -inf under its softmax, one keeps its
  scores within a bit of 65504 (visible only at the op level), one has room. The fallback covers 3 of the 4.
- A T5-like FFN stack whose ``wo`` outputs grow with depth: the last overflows, the one before sits within a bit.
- A loss computed as ``log(sigmoid(x))``: the fused ``F.logsigmoid`` rewrite, verified, then trained for real.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from helpers import amp_train, assert_untouched, snapshot
from test_remedies_attention import Sensors
from torch import nn

import ampdoctor


def _train(
    model: nn.Module, x: torch.Tensor, loss_fn: Callable[[torch.Tensor], torch.Tensor], steps: int = 20
) -> tuple[list[float], int]:
    """``steps`` AdamW steps (lr 1e-3) on the same batch under GradScaler defaults: (losses, steps taken)."""
    losses, skipped = amp_train(model, x, loss_fn, steps)
    return losses, steps - len(skipped)


def _mean(out: torch.Tensor) -> torch.Tensor:
    return out.float().mean()


def _apply_snippet(snippet: str, model: nn.Module) -> None:
    """Run a recommendation's snippet as the user would paste it, with their model named ``model``."""
    exec(compile(snippet, "<snippet>", "exec"), {"model": model, "torch": torch})  # noqa: S102


# -- the sensor story ---------------------------------------------------------------------------------------


def _sensors() -> tuple[Sensors, torch.Tensor]:
    # Seed 40, d = 8: blocks.0's scores reach -inf in 86 elements (hidden by softmax), blocks.1's reach +inf.
    torch.manual_seed(40)
    model = Sensors(d=8)
    return model, 400 + 100 * torch.randn(4, 8, 8)


@pytest.mark.slow
def test_the_sensor_story_holds_for_20_steps_with_the_first_verified_fallback() -> None:
    model, x = _sensors()
    before = snapshot(model)
    report = ampdoctor.diagnose(model, x, loss_fn=lambda out, _: _mean(out), device_type="cpu")
    assert_untouched(model, before)
    assert report.findings.forward_origin is not None and report.findings.forward_origin.label == "blocks.1.attn"
    # The report names blocks.0.attn's hidden overflow: its scores matmul made -inf that softmax hid.
    hidden = [h for h in report.findings.hidden if h.module == "blocks.0.attn"]
    assert len(hidden) == 1 and hidden[0].op == "matmul" and hidden[0].count == 86
    assert "blocks.0.attn" in report.to_text() and "matmul" in report.to_text()
    fallback = next(r for r in report.recommendations if r.action == "fp32_fallback" and r.verified)
    assert fallback.modules == ("blocks.1.attn", "blocks.0.attn")
    assert "2 of 2 need it (blocks.1.attn: overflows, blocks.0.attn: hides an overflow)" in fallback.evidence
    # Scaling q first is not enough at d = 8 (1/sqrt(8)): the rewritten scores still overflow under the softmax,
    # which the hidden-overflow watch sees, so it is not verified.
    rewrite = next(r for r in report.recommendations if r.rule == "scale_first")
    assert not rewrite.verified and "still makes inf/NaN" in rewrite.evidence
    trained = copy.deepcopy(model)
    _apply_snippet(fallback.snippet, trained)
    losses, taken = _train(trained, x, _mean)
    assert all(math.isfinite(v) for v in losses) and taken >= 10
    # The control: without it the same training loses steps and ends non-finite.
    losses, taken = _train(copy.deepcopy(model), x, _mean)
    assert not all(math.isfinite(v) for v in losses)


def test_the_story_without_the_hidden_overflow_would_have_fixed_one_block_only() -> None:
    """What the issue's user saw: the re-run with only blocks.1.attn in float32 is finite, but blocks.0.attn
    still makes -inf under its softmax; that re-run is not overflow-free, so a fix of one block is never
    verified."""
    model, x = _sensors()
    with ampdoctor.fp32_fallback(model, ["blocks.1.attn"]):
        report = ampdoctor.diagnose(model, x, loss_fn=lambda out, _: _mean(out), device_type="cpu", verify=False)
    assert report.findings.forward_origin is None
    assert [h.label for h in report.findings.hidden] == ["blocks.0.attn"]
    assert report.trace.forward_healthy() and not report.trace.overflow_free()


# -- N identical blocks ---------------------------------------------------------------------------------------


class Attn(nn.Module):
    """q = g * x, k = x * diag(1, -1), v = x: scores = g * (x0 * x0' - x1 * x1'), before the 1/sqrt(d) scaling."""

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(2, 2, bias=False) for _ in range(3))
        with torch.no_grad():
            self.q.weight.copy_(torch.eye(2) * gain)
            self.k.weight.copy_(torch.diag(torch.tensor([1.0, -1.0])))
            self.v.weight.copy_(torch.eye(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-2, -1)
        return torch.softmax(scores / math.sqrt(2), dim=-1) @ self.v(x)


class Siblings(nn.Module):
    """Four identical attention blocks on the same tokens x0 = (50, 0), x1 = (0, 100): scores [[2500 g, 0],
    [0, -10000 g]].

    blocks.0, g = 10: -100,000 -> -inf in float16, hidden by softmax (row [0, -inf] -> [1, 0]);
    blocks.1, g = 5: scores down to -50,000, finite: log2(65504 / 50000) = 0.39 bits, inside a 1-bit margin, and
    visible only at the op level (the block's output is at most 100; -50,000 is -49,984 in float16);
    blocks.2, g = 30: 75,000 -> +inf: softmax NaN, the origin, the first to overflow;
    blocks.3, g = 0.1: -1,000 (6 bits).
    """

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attn(g) for g in (10.0, 5.0, 30.0, 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((b(x).float() for b in self.blocks), torch.zeros(()))


TOKENS = torch.tensor([[[50.0, 0.0], [0.0, 100.0]]])


def test_the_fallback_covers_every_sibling_that_overflows_hides_one_or_sits_within_a_bit() -> None:
    model = Siblings()
    before = snapshot(model)
    report = ampdoctor.diagnose(model, TOKENS, loss_fn=lambda out, _: out.mean() * 1e-3, device_type="cpu")
    assert_untouched(model, before)
    assert report.findings.forward_origin is not None and report.findings.forward_origin.label == "blocks.2"
    assert [(h.label, h.op) for h in report.findings.hidden] == [("blocks.0", "matmul")]
    peaks = {report.trace.calls[p.call_index].label: p.abs_max for p in report.trace.op_peaks}
    assert peaks["blocks.1"] == 49984.0 and peaks["blocks.3"] == 1000.0  # -50,000 rounds to -49,984 in float16
    rec = next(r for r in report.recommendations if r.action == "fp32_fallback")
    assert rec.modules == ("blocks.2", "blocks.0", "blocks.1") and rec.verified
    assert (
        "4 Attn instances (blocks.*) run this code; 3 of 4 need it "
        "(blocks.2: overflows, blocks.0: hides an overflow, blocks.1: 0.39 bits to spare)"
    ) in rec.evidence
    # The op-level peak is a finding of its own and shows in the headroom table.
    near = [(n.label, n.tensor) for n in report.findings.near_limit]
    assert ("blocks.1", "op:matmul") in near
    assert "matmul 49984 (0.39 bits)" in report.to_text()
    # The snippet, run as pasted, makes the step finite.
    trained = copy.deepcopy(model)
    _apply_snippet(rec.snippet, trained)
    with torch.autocast("cpu", dtype=torch.float16):
        out = trained(TOKENS)
    assert torch.isfinite(out).all()


# -- a T5-like FFN stack ---------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class DenseReluDense(nn.Module):
    def __init__(self, d: int, gain: float) -> None:
        super().__init__()
        self.wi, self.wo = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        with torch.no_grad():
            self.wi.weight.copy_(torch.eye(d))
            self.wo.weight.copy_(torch.eye(d) * gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(torch.relu(self.wi(x)))


class FFLayer(nn.Module):
    def __init__(self, d: int, gain: float) -> None:
        super().__init__()
        self.norm, self.ffn = RMSNorm(d), DenseReluDense(d, gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(self.norm(x))


class T5Stack(nn.Module):
    """Four T5 FFN layers on a constant input: each norm gives ones, so layer l's ``wo`` outputs exactly its gain:
    100, 1,000, 40,000 (log2(65504 / 40000) = 0.71 bits), 100,000 (inf in float16: the origin)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(FFLayer(d, g) for g in (100.0, 1000.0, 40000.0, 100000.0))
        self.final = RMSNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.final(x)


def test_a_t5_like_stack_whose_wo_outputs_grow_with_depth() -> None:
    model, x = T5Stack(), torch.full((2, 3, 8), 2.0)
    report = ampdoctor.diagnose(model, x, loss_fn=lambda out, _: out.mean(), device_type="cpu")
    assert report.findings.forward_origin is not None
    assert report.findings.forward_origin.label == "layers.3.ffn.wo"
    rec = next(r for r in report.recommendations if r.action == "fp32_fallback")
    assert rec.modules == ("layers.3.ffn.wo", "layers.2.ffn.wo") and rec.verified
    assert (
        "4 Linear instances (layers.*.ffn.wo) run this code; 2 of 4 need it "
        "(layers.3.ffn.wo: overflows, layers.2.ffn.wo: 0.71 bits to spare)"
    ) in rec.evidence
    trained = copy.deepcopy(model)
    _apply_snippet(rec.snippet, trained)
    losses, taken = _train(trained, x, lambda out: out.mean(), steps=5)
    assert all(math.isfinite(v) for v in losses) and taken >= 3


# -- a loss computed as log(sigmoid(x)) ----------------------------------------------------------------------


class Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)
        with torch.no_grad():
            self.fc.weight.fill_(-10.0)
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _log_sigmoid_loss(out: torch.Tensor, _: object = None) -> torch.Tensor:
    return -torch.log(torch.sigmoid(out)).mean()  # sigmoid(-40) is 0 in float16: log gives -inf


def _fused_loss(out: torch.Tensor, _: object = None) -> torch.Tensor:
    return -torch.nn.functional.logsigmoid(out).mean()


def test_a_log_sigmoid_loss_gets_the_fused_rewrite_and_it_trains() -> None:
    model, x = Scorer(), torch.ones(3, 4)  # scores -40
    report = ampdoctor.diagnose(model, x, loss_fn=_log_sigmoid_loss, device_type="cpu")
    assert report.findings.forward_origin is not None and report.findings.forward_origin.module == "<loss>"
    first = report.recommendations[0]
    assert first.rule == "loss_logsigmoid" and first.verified
    assert "F.logsigmoid" in first.title and "logsigmoid(x)" in first.snippet
    losses, _ = _train(copy.deepcopy(model), x, _log_sigmoid_loss, steps=3)
    assert not all(math.isfinite(v) for v in losses)  # the control
    losses, taken = _train(copy.deepcopy(model), x, _fused_loss, steps=5)
    assert all(math.isfinite(v) for v in losses) and taken >= 3
