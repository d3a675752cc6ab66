"""Binade histograms stored sparse (records.histograms, capture.binades; issue 22's memory): the rows a pass reads
back are the dense per-parameter lists they were, by index and by name, and the loss predictions made from them
equal those made from plain lists."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from ampdoctor.analysis.prediction import LossPrediction
from ampdoctor.capture.binades import named_histograms
from ampdoctor.capture.options import PassOptions
from ampdoctor.capture.passes import PassSpec, SharedForward, run_pass
from ampdoctor.capture.staging import HIST_BINS
from ampdoctor.capture.state import StateGuard
from ampdoctor.capture.stats import StatsCollector
from ampdoctor.records.histograms import BinadeHistograms, HistogramRows
from ampdoctor.thresholds import GRADIENT_KEY, HIST_HIGH, HIST_LOW


def _binades(t: torch.Tensor) -> list[int]:
    """The histogram layout, by numpy in float64: nonzero finite |x| by binade, the ends folded."""
    a = np.abs(t.detach().double().numpy().reshape(-1))
    a = a[np.isfinite(a) & (a > 0)]
    hist = [0] * HIST_BINS
    for k in np.floor(np.log2(a)).astype(int):
        hist[0 if k < HIST_LOW else (HIST_BINS - 1 if k >= HIST_HIGH else 1 + k - HIST_LOW)] += 1
    return hist


def test_rows_round_trip_dense_blocks_and_take() -> None:
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 5, size=(n, 7)) * (rng.random((n, 7)) < 0.3) for n in (3, 1, 0, 4)]
    blocks[0][1] = 0  # an empty row
    blocks[3][2, 6] = 2**40  # a count beyond int32: kept exactly
    rows = HistogramRows.from_dense(blocks, 7)
    dense = np.concatenate(blocks)
    assert len(rows) == 8
    assert [rows[i] for i in range(8)] == dense.tolist()
    assert all(isinstance(v, int) for v in rows[7])
    picked = rows.take([5, 0, 5, 1])
    assert [picked[i] for i in range(4)] == dense[[5, 0, 5, 1]].tolist()
    assert len(rows.take([])) == 0
    assert rows.nbytes < dense.nbytes
    with pytest.raises(IndexError):
        rows.dense(8)


def test_names_keep_dict_semantics() -> None:
    table = HistogramRows.from_dense([np.arange(3 * HIST_BINS).reshape(3, HIST_BINS) % 3], HIST_BINS)
    total = [1] * HIST_BINS
    named = named_histograms(table, [("a", 0), ("b", 1), ("a", 2)], GRADIENT_KEY, total)
    expected = {"a": table[2], "b": table[1], GRADIENT_KEY: total}  # as a dict comprehension builds it
    assert isinstance(named, BinadeHistograms)
    assert list(named) == list(expected) and dict(named) == expected
    assert "a" in named and "c" not in named
    assert dict(named_histograms(table, [("b", 1)], GRADIENT_KEY, None)) == {"b": table[1]}
    assert not named_histograms(HistogramRows.empty(HIST_BINS), [], GRADIENT_KEY, None)


def test_collector_rows_equal_numpy_binades_in_add_order() -> None:
    torch.manual_seed(0)
    small = [torch.randn(4, 4) * 2.0**e for e in (-30, 0, 12)] + [torch.zeros(5), torch.randn(7).half()]
    large = torch.randn(70000) * 2.0**-8
    large[::5] = 0.0
    collector = StatsCollector(torch.float16, False, zeros=False)
    first = collector.add_histogram(large)
    batched = collector.add_many(small, histograms=True)
    last = collector.add_histogram(small[1] * 3)
    collector.read()
    assert collector.histograms[first] == _binades(large)
    assert [collector.histograms[h] for _, h in batched] == [_binades(t) for t in small]
    assert collector.histograms[last] == _binades(small[1] * 3)


def test_a_survey_pass_reads_every_parameter_gradients_histogram() -> None:
    # The histograms of a real pass equal numpy's binades of the same gradients taken by hand (same autocast
    # forward, same scale), by parameter name, with the low-precision gradients' sum under GRADIENT_KEY.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    batch = torch.randn(5, 8)
    spec = PassSpec(
        root=model, names={id(m): n for n, m in model.named_modules()}, params=list(model.named_parameters()),
        batch=batch, loss_fn=lambda out, _b: out.float().pow(2).mean(), device_type="cpu", dtype=torch.float16,
        backward=True,
    )
    guard = StateGuard(model, spec.params)
    share = SharedForward()
    try:
        run_pass(spec, 1024.0, PassOptions(histograms=2), guard, share=share)
        got = share.histograms
    finally:
        share.release()
    guard.restore()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(batch)
    loss = out.float().pow(2).mean()
    grads = torch.autograd.grad(loss * torch.tensor(1024.0), [p for _, p in spec.params])
    assert isinstance(got, BinadeHistograms)
    assert set(got) == {*(n for n, _ in spec.params), GRADIENT_KEY}
    for (name, _), grad in zip(spec.params, grads):
        assert got[name] == _binades(grad), name
    assert sum(got[GRADIENT_KEY]) > 0  # the float16 activation gradients' values


def _lost(hists: dict[str, list[int]], names: list[str], at: int, flush: int, exponent: int) -> int:
    # Bin i holds binade HIST_LOW + i - 1; it is lost at 2**exponent when HIST_LOW + i + (exponent - at) <= flush.
    return sum(c for n in names for i, c in enumerate(hists[n]) if HIST_LOW + i + (exponent - at) <= flush)


@pytest.mark.parametrize("seed", range(3))
def test_predictions_from_sparse_rows_match_the_scalar_definitions(seed: int) -> None:
    rng = random.Random(seed)
    owners = {f"m{i}.{p}": f"m{i}" for i in range(5) for p in ("weight", "bias")}
    hists: dict[str, list[int]] = {}
    for name in [*owners, "loose", GRADIENT_KEY, GRADIENT_KEY + "2"]:
        hist = [0] * HIST_BINS
        for _ in range(rng.randint(0, 30)):
            hist[rng.randint(60, 129)] += rng.randint(1, 9)
        hists[name] = hist
    names = list(hists)
    table = BinadeHistograms(names, HistogramRows.from_dense([np.asarray([hists[n] for n in names])], HIST_BINS))
    assert dict(table) == hists
    at, flush = 16, -25
    prediction = LossPrediction(table, at, flush, owners)
    params = [n for n in names if not n.startswith(GRADIENT_KEY)]
    gradients = [n for n in names if n.startswith(GRADIENT_KEY)]
    total = sum(sum(hists[n]) for n in gradients)
    for exponent in range(-6, 30):
        lost = _lost(hists, gradients, at, flush, exponent)
        assert prediction.gradient_share(exponent) == (lost / total if total else 0.0)
        assert prediction.lost(exponent) == _lost(hists, params, at, flush, exponent)
        for module in ("m0", "m4", "loose", "absent"):
            mine = [n for n in params if owners.get(n, n) == module]
            assert prediction.lost(exponent, module) == _lost(hists, mine, at, flush, exponent)


@pytest.mark.parametrize("seed", range(4))
def test_kept_columns_equal_the_table_of_losses(seed: int) -> None:
    from ampdoctor.analysis.prediction import _Grouped

    rng = np.random.default_rng(seed)
    dense = rng.integers(0, 50, size=(40, 30)) * (rng.random((40, 30)) < 0.25)
    dense[3] = 0  # a row (and maybe a group) with nothing stored
    groups = rng.integers(0, 12, size=40)
    groups[5] = -1  # left out
    grouped = _Grouped(HistogramRows.from_dense([dense], 30), groups)
    columns = np.sort(rng.integers(0, 32, size=9))
    asked = np.asarray([0, 3, 7, 11, -1, 12, 4])  # 12: no row; -1: unknown
    total = rng.integers(1, 400, size=len(asked)).astype(np.float64)
    table = grouped.below_each(columns, 13)
    for share in (0.0, 0.01, 0.1, 0.5, 2.0):
        expected = [
            int(np.cumprod([(table[g, j] if g >= 0 else 0.0) / t < share for j in range(len(columns))]).sum())
            for g, t in zip(asked, total)
        ]
        assert grouped.kept_columns(columns, asked, total, share).tolist() == expected


def test_rows_waiting_on_a_device_come_back_in_order_through_the_readback(monkeypatch: pytest.MonkeyPatch) -> None:
    # Off the CPU a block of rows waits for the pass's one transfer and is cut from its device's rows afterwards;
    # forced here on the CPU (no GPU needed), mixed with rows made sparse at once, the rows are the same.
    from ampdoctor.capture import binades

    torch.manual_seed(3)
    small = [torch.randn(4, 4) * 2.0**e for e in (-20, 0, 9)] + [torch.randn(6).half()]
    large = torch.randn(70000) * 2.0**-3

    def collect(waiting: bool) -> tuple[list[list[int]], list[int]]:
        calls = 0
        real_add = binades.RowQueue.add

        def add(self: binades.RowQueue, rows: torch.Tensor) -> int:
            nonlocal calls
            calls += 1
            if not waiting or calls % 2:  # every other block waits, as a device's would
                return real_add(self, rows)
            self.blocks.append(rows)
            first, self.count = self.count, self.count + rows.shape[0]
            return first

        monkeypatch.setattr(binades.RowQueue, "add", add)
        collector = StatsCollector(torch.float16, False, zeros=False)
        first = collector.add_histogram(large)
        batched = collector.add_many(small, histograms=True)
        again = collector.add_histogram(large * 2)
        collector.read()
        monkeypatch.undo()
        indices = [first, *(h for _, h in batched), again]
        return [collector.histograms[i] for i in indices], indices

    plain, indices = collect(False)
    waited, same = collect(True)
    assert same == indices and waited == plain
    assert plain == [_binades(t) for t in (large, *small, large * 2)]
