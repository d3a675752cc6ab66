"""Float32 fallbacks chosen by cost, not by parameter count; recommendations that read on their own."""

from __future__ import annotations

import math

import torch
from helpers import assert_untouched, snapshot
from torch import nn

import ampdoctor

HOP, N_FFT, BINS = 64, 128, 64


class Compress(nn.Module):
    """log(1 + |x|) of the front end's output, as a one-channel image (bins x frames)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log1p(x.abs()).unsqueeze(1)


def audio_model() -> nn.Sequential:
    """A fixed cosine basis (8,192 parameters: most of the model) as a strided Conv1d, then a small Conv2d net
    over the spectrogram (2,464 parameters, but ~20x the front end's FLOPs: it runs at every bin and frame)."""
    torch.manual_seed(0)
    front = nn.Conv1d(1, BINS, N_FFT, stride=HOP, bias=False)
    n, k = torch.arange(float(N_FFT)), torch.arange(float(BINS))[:, None]
    with torch.no_grad():
        front.weight.copy_(torch.cos(2 * math.pi * k * n / N_FFT)[:, None, :])
    return nn.Sequential(
        front, Compress(), nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.Flatten(1)
    )


def test_a_front_end_with_most_parameters_but_little_work_is_a_fallback_candidate() -> None:
    # A tone at bin 4 of amplitude 2,000: the basis row 4 sums 128 * 2000 / 2 = 128,000 > 65504 -> inf in
    # float16. In float32 the front end is fine and the log brings its output to ~12 for the float16 convs.
    model = audio_model()
    x = 2000 * torch.cos(2 * math.pi * 4 * torch.arange(float(HOP * 32)) / N_FFT).reshape(1, 1, -1)
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in model.named_children()}
    assert params["0"] > sum(params.values()) / 2  # the front end holds most of the parameters
    before = snapshot(model)
    report = ampdoctor.diagnose(model, x, loss_fn=lambda out, _: out.float().mean() * 1e-3, device_type="cpu")
    assert report.verdict == "overflow" and report.forward_origin is not None
    assert report.forward_origin.module == "0"
    first = report.recommendations[0]
    assert first.action == "fp32_fallback" and first.modules == ("0",) and first.verified, str(report)
    assert first.cost is not None and first.cost.fp32_matmul_flop_share < 0.1
    assert_untouched(model, before)


def test_recommendations_read_on_their_own_verified_first() -> None:
    from ampdoctor.demo import demo_loss, make_demo

    model, tokens, targets = make_demo()
    report = ampdoctor.diagnose(model, tokens, loss_fn=lambda out, _: demo_loss(out, targets), device_type="cpu")
    titles = [r.title for r in report.recommendations]
    assert titles and not any(t.lower().startswith("or ") for t in titles)
    assert not any(r.evidence and r.title in r.evidence for r in report.recommendations)
    proven = [r.verified for r in report.recommendations]
    assert proven == sorted(proven, reverse=True)  # verified alternatives first
    bf16 = next(r for r in report.recommendations if r.action == "bf16")
    assert bf16.title.startswith("autocast to bfloat16") and bf16.verified


def test_loss_scale_snippets_are_exact_powers_of_two() -> None:
    from ampdoctor.fixes.recommend import scale_literal

    assert scale_literal(2.0**40) == "2.0**40" and eval(scale_literal(2.0**40)) == 2.0**40
    assert scale_literal(65536.0) == "65536.0" and scale_literal(32.0) == "32.0"
