"""Statistics at a bounded cost (issue 13): detailed statistics chunk by chunk, gradient histograms (one at a time
and batched), and fingerprints without temporaries, each checked against a float64 / numpy reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import ampdoctor.capture.stats as stats_module
from ampdoctor.capture.state import fingerprints
from ampdoctor.capture.stats import StatsCollector, chunks, tensor_stats
from ampdoctor.thresholds import HIST_HIGH, HIST_LOW

INF, NAN = math.inf, math.nan
EDGES = [65504.0, 65520.0, -70000.0, 2.0**-25, 2.0**-26, -(2.0**-24), 2.0**-14, 0.0, -0.0, INF, -INF, NAN, 1.0]


def _edgy(n: int, dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(0)
    t = torch.randn(n, dtype=torch.float64) * 2.0 ** torch.randint(-30, 17, (n,)).double()
    t[:: max(1, n // 40)] = 0.0
    for i, value in enumerate(EDGES):  # spread across chunk boundaries
        t[(i * 997) % n] = value
    return t.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_detailed_statistics_in_chunks_equal_one_piece(
    dtype: torch.dtype, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = _edgy(6000, dtype).reshape(60, 100)
    t = {"contiguous": base, "transposed": base.t(), "strided": base[:, ::3]}[layout]
    whole = tensor_stats(t, torch.float16)
    monkeypatch.setattr(stats_module, "CHUNK", 257)  # many chunks, boundaries everywhere
    pieces = list(chunks(t, 257))
    assert len(pieces) > 5 and all(p.numel() <= 257 for p in pieces)
    assert sum(p.numel() for p in pieces) == t.numel()
    assert tensor_stats(t, torch.float16) == whole


@pytest.mark.parametrize("numel", [3000, 1 << 16, 1 << 20, (1 << 22) + 5, 1 << 25])
def test_detailed_pieces_are_small_for_small_tensors_and_few_for_large_ones(
    numel: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each piece's scratch (about 13 bytes an element) stays under 0.25 MiB or near a tenth of the tensor's own
    float16 bytes, and a tensor up to 16M elements takes at most 64 pieces (the Python loop stays short)."""
    seen: list[int] = []
    real = StatsCollector._detail_chunk

    def spy(self: StatsCollector, c: torch.Tensor) -> object:
        seen.append(c.numel())
        return real(self, c)

    monkeypatch.setattr(StatsCollector, "_detail_chunk", spy)
    t = torch.zeros(numel, dtype=torch.float16)
    t[-1] = 70000.0  # in the last piece: still counted
    stats = tensor_stats(t, torch.float16)
    assert stats.posinf_count == 1 and sum(seen) == numel
    assert all(13 * n <= max(2**18, numel * 2 // 9) for n in seen)
    assert len(seen) <= max(64, -(-numel // stats_module.CHUNK_MAX))


def _numpy_binades(t: torch.Tensor) -> list[float]:
    """The histogram layout of ``add_histogram``, by numpy: nonzero finite |x| by binade, ends folded."""
    a = np.abs(t.double().numpy().reshape(-1))
    a = a[np.isfinite(a) & (a > 0)]
    k = np.floor(np.log2(a)).astype(int)
    hist = [0.0] * (HIST_HIGH - HIST_LOW + 2)
    for value in k:
        hist[0 if value < HIST_LOW else (len(hist) - 1 if value >= HIST_HIGH else 1 + value - HIST_LOW)] += 1
    return hist


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_histogram_matches_numpy_binades(dtype: torch.dtype) -> None:
    t = _edgy(5000, dtype)
    t[7] = 1e-40 if dtype == torch.float32 else 0.0  # a float32 subnormal: bottom bin, not a zero
    collector = StatsCollector(torch.float16, False)
    index = collector.add_histogram(t)
    collector.read()
    assert collector.histograms[index] == _numpy_binades(t)


def test_batched_gradient_statistics_match_one_at_a_time() -> None:
    torch.manual_seed(1)
    grads = [torch.randn(4, 4) * 2.0**-20, torch.randn(16), torch.zeros(3), torch.randn(4, 4).half(),
             torch.tensor([1e-40, 0.0, -2.0**100]), torch.randn(16) * 2.0**30, torch.randn(2, 2, 2)]
    grads[1][3] = 0.0
    batched = StatsCollector(torch.float16, False, zeros=False)
    out = batched.add_many(grads, histograms=True)
    batched_stats = batched.read()
    for g, (slot, hist) in zip(grads, out):
        alone = tensor_stats(g, torch.float16, detailed=False)
        assert batched_stats[slot] == alone  # min, max and the zero count, exactly
        assert batched.histograms[hist] == _numpy_binades(g)


def _fingerprinted(change: int = -1) -> list[torch.Tensor]:
    """Tensors of several dtypes, sizes and storage offsets (views); ``change``: the one with its last element
    changed (before any view is taken)."""
    torch.manual_seed(2)
    bases = [torch.randn(1001), torch.randn(7).half(), torch.randn(3, 5), torch.ones(5, dtype=torch.bool),
             torch.randn(100).double()]
    if change >= 0:
        base = bases[change].view(-1)
        base[-1] = False if base.dtype == torch.bool else base[-1] + 1
    return [bases[0], bases[1], bases[2][:, 1:], bases[3], bases[4][1:]]


def test_fingerprints_move_with_any_single_change_and_not_otherwise() -> None:
    before = fingerprints(_fingerprinted())
    assert fingerprints(_fingerprinted()) == before
    for i in range(len(before)):
        after = fingerprints(_fingerprinted(change=i))
        assert after[i] != before[i]
        assert after[:i] + after[i + 1 :] == before[:i] + before[i + 1 :]


def test_fingerprints_of_many_small_tensors_together_name_the_one_changed() -> None:
    # 300 small parameters (the batched path: one concatenation, segmented sums) and one over 64 KiB (alone).
    torch.manual_seed(3)
    tensors = [torch.randn(4, 4) for _ in range(150)] + [torch.randn(3).half() for _ in range(150)]
    tensors.append(torch.randn(20000))
    before = fingerprints(tensors)
    assert len(set(before)) == len(tensors)
    for i in (0, 149, 150, 299, 300):
        flat = tensors[i].view(-1)
        old = flat[1].clone()
        flat[1] += 1
        after = fingerprints(tensors)
        assert [j for j in range(len(tensors)) if after[j] != before[j]] == [i]
        flat[1] = old
        assert fingerprints(tensors) == before


def test_survey_parameter_statistics_measured_together_equal_each_alone() -> None:
    from torch import nn

    from ampdoctor.capture.passes import PassSpec, capture_params

    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(300, 300), nn.Linear(3, 2))
    model[1].weight = model[0].weight  # tied: one parameter, two owners
    model[2].weight.data[0, 0] = float("inf")  # 90,000 elements: measured alone
    model[3].weight.data = model[3].weight.data.double()
    model[3].bias.data = torch.tensor([0.0, -3.5], dtype=torch.bfloat16)
    with torch.no_grad():
        model[0].bias[1] = 0.0
    spec = PassSpec(model, {id(m): n for n, m in model.named_modules()}, list(model.named_parameters()), None,
                    None, "cpu", torch.float16, False)
    infos = capture_params(spec, list(model.named_modules()), detailed=False)
    params = dict(model.named_parameters())
    seen = [(info.name, p.name, p.stats) for info in infos for p in info.params]
    assert [(m, n) for m, n, _ in seen] == [("0", "0.weight"), ("0", "0.bias"), ("1", "0.weight"), ("1", "1.bias"),
                                            ("2", "2.weight"), ("2", "2.bias"), ("3", "3.weight"), ("3", "3.bias")]
    for _, name, stats in seen:
        assert stats == tensor_stats(params[name], torch.float16, detailed=False), name
    assert seen[1][2].zero_count == 1 and seen[4][2].max == INF and seen[7][2].min == -3.5
