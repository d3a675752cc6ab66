"""Small tensors staged side by side (capture.staging): the same statistics as measured one by one, values as they
were when added, segments across several flushes, and gradient histograms summed exactly."""

from __future__ import annotations

import math

import torch

from ampdoctor.capture import staging
from ampdoctor.capture.stats import StatsCollector

INF, NAN = math.inf, math.nan


def _reference(t: torch.Tensor) -> tuple[float, float, int]:
    """min, max (NaN when any NaN) and zero count, in float64."""
    w = t.detach().double().reshape(-1)
    if torch.isnan(w).any():
        return NAN, NAN, int((w == 0).sum())
    return float(w.min()), float(w.max()), int((w == 0).sum())


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_staged_statistics_match_one_by_one_and_ignore_later_writes(monkeypatch) -> None:
    monkeypatch.setattr(staging, "STAGE_ELEMENTS", 40)  # several flushes for these tensors
    torch.manual_seed(0)
    tensors = [
        torch.tensor([1.0, -3.5, 0.0], dtype=torch.float16),
        torch.tensor([[2.0**-24, 0.0], [65504.0, -65504.0]], dtype=torch.float16).t(),  # non-contiguous
        torch.tensor([INF, 1.0, 0.0, 0.0], dtype=torch.float16),
        torch.tensor([NAN, -INF, 2.0], dtype=torch.bfloat16),
        torch.tensor(7.0),  # 0-d float32
        torch.randn(30, dtype=torch.float16),
        torch.randn(5, 7),
    ]
    expected = [_reference(t) for t in tensors]
    collector = StatsCollector(torch.float16, detailed=False, zeros=True)
    slots = [collector.add(t) for t in tensors]
    for t in tensors:
        t.zero_()  # written in place after being seen (ReLU(inplace=True)): the statistics are of the values seen
    assert all(isinstance(collector._slots.wheres[s], staging.Stage) for s in slots)
    records = collector.read()
    assert collector.readbacks == 1
    for slot, (low, high, zeros), t in zip(slots, expected, tensors):
        r = records[slot]
        assert r.shape == tuple(t.shape)
        assert r.zero_count == zeros
        if not math.isnan(low):
            assert _same(r.min, low) and _same(r.max, high), (r, low, high)
    nan_record = records[slots[3]]  # an inf behind a NaN still shows, as in the one-by-one survey
    assert nan_record.min == -INF and math.isnan(nan_record.max)


def test_large_tensors_are_not_staged() -> None:
    collector = StatsCollector(torch.float16, detailed=False)
    big = torch.ones(staging.STAGE_EACH + 1, dtype=torch.float16)
    slot = collector.add(big)
    assert collector._slots.wheres[slot] == big.device
    assert collector.read()[slot].max == 1.0


def _histogram(values: list[torch.Tensor]) -> list[int]:
    """Binade histogram of nonzero finite values, in float64: bin 1 + k - HIST_LOW for 2**k."""
    from ampdoctor.thresholds import HIST_HIGH, HIST_LOW

    counts = [0] * staging.HIST_BINS
    for t in values:
        for v in t.double().reshape(-1).tolist():
            if v == 0 or not math.isfinite(v):
                continue
            k = math.floor(math.log2(abs(v)))
            counts[0 if k < HIST_LOW else (staging.HIST_BINS - 1 if k >= HIST_HIGH else 1 + k - HIST_LOW)] += 1
    return counts


def test_gradient_histogram_is_the_exact_sum(monkeypatch) -> None:
    monkeypatch.setattr(staging, "STAGE_ELEMENTS", 64)
    torch.manual_seed(1)
    small = [torch.randn(20, dtype=torch.float16) * 2.0**e for e in (-20, -3, 0, 9)]
    small.append(torch.tensor([0.0, INF, NAN, 2.0**-24, 60000.0], dtype=torch.float16))
    large = torch.randn(staging.STAGE_EACH + 5, dtype=torch.float16) * 2.0**-12  # measured on its own
    ignored = torch.full((6,), 3.0, dtype=torch.float16)  # staged without a histogram
    collector = StatsCollector(torch.float16, detailed=False)
    for t in small[:2]:
        collector.add_fresh(t, True)
    collector.add_fresh(ignored, False)
    for t in (*small[2:], large):
        collector.add_fresh(t, True)
    collector.read()
    assert collector.gradient_histogram == _histogram([*small, large])


def test_no_histogram_asked_reads_none() -> None:
    collector = StatsCollector(torch.float16, detailed=False)
    collector.add_fresh(torch.ones(4, dtype=torch.float16))
    collector.read()
    assert collector.gradient_histogram is None


def test_interleaved_shapes_come_back_in_the_order_added(monkeypatch) -> None:
    # Copies are reduced shape by shape (stacked): slot k must still read tensor k, across flushes.
    monkeypatch.setattr(staging, "STAGE_ELEMENTS", 50)
    shapes = [(2, 3), (4,), (2, 3), (3, 2), (4,), (2, 3), (1,), (3, 2), (4,)]
    tensors = [torch.full(s, float(k) - 4.0, dtype=torch.float16) for k, s in enumerate(shapes)]
    tensors[3][0, 0] = 100.0  # max 100 in slot 3 only
    tensors[6][0] = NAN  # NaN in slot 6 only
    collector = StatsCollector(torch.float16, detailed=False, zeros=True)
    slots = [collector.add_fresh(t) for t in tensors]
    records = collector.read()
    mins = [records[s].min for s in slots]
    maxs = [records[s].max for s in slots]
    zeros = [records[s].zero_count for s in slots]
    assert mins[:6] + mins[7:] == [-4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 3.0, 4.0]
    assert maxs[:6] + maxs[7:] == [-4.0, -3.0, -2.0, 100.0, 0.0, 1.0, 3.0, 4.0]
    assert math.isnan(mins[6]) and math.isnan(maxs[6])
    assert zeros == [0, 0, 0, 0, 4, 0, 0, 0, 0]
    assert [records[s].shape for s in slots] == shapes


def test_the_hidden_watch_shares_the_staged_copy_of_a_leaf_modules_output() -> None:
    # Linear's one op (F.linear) makes the module's output: the watch stages it, and the module's hook finds that
    # slot (same tensor, same version) instead of measuring it a second time. The op's values come from the records.
    from torch import nn

    from ampdoctor.capture.options import PassOptions
    from ampdoctor.capture.passes import PassSpec, _Step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    with torch.no_grad():
        model[0].weight.fill_(2.0)
        model[0].bias.fill_(-1.0)
    spec = PassSpec(root=model, names={id(m): n for n, m in model.named_modules()},
                    params=list(model.named_parameters()), batch=torch.ones(2, 4), loss_fn=None, device_type="cpu",
                    dtype=torch.float16, backward=True)
    step = _Step(spec, list(model.modules()), ("test",), PassOptions(), None)
    try:
        step.forward()
        calls = {c.module: c for c in step.recorder.calls}
        shared = {slot for _, slot in step.hidden._from_slots}
        assert calls["0"].outputs[0][1] in shared and calls["1"].outputs[0][1] in shared
        assert calls["1"].inputs[0][1] == calls["0"].outputs[0][1]  # ReLU's input: Linear's output, measured once
        assert calls[""].outputs[0][1] == calls["1"].outputs[0][1]  # the root returns ReLU's output
        trace = step.backward(1.0, keep=False)
    finally:
        step.close()
    out = {c.module: c.outputs[0].stats for c in trace.calls}
    assert (out["0"].min, out["0"].max) == (7.0, 7.0)  # 4 * 2 - 1 in every element
    assert trace.op_overflows == () and trace.op_peaks == ()
