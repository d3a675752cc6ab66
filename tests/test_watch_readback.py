"""The watch's step end (training/readback.py): the one-slab read-back put in place by list slices, pairs folded per
module straight from the collector's keys, and the forecaster's single pass; and the hot path's fallback when
hooks cannot go into a tensor's own hook dict."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.training import readback
from ampdoctor.training.fastpath import Slabs
from ampdoctor.training.forecast import DENSE_MARGIN_BITS, Forecaster
from ampdoctor.training.readback import Collector, Folded, fold_pairs, found_inf_flags, scale_value


def _interleaved() -> tuple[Collector, list[float]]:
    """Pairs of one dtype (one slab) with values of other dtypes and shapes between them, and the numbers expected
    at indices 0.. (exact: every part widens without rounding)."""
    c = Collector(Slabs())
    expected: list[float] = []
    c.put(("out", "a", True), torch.tensor([-2.0, 5.0], dtype=torch.float16))
    expected += [-2.0, 5.0]
    assert c.add(torch.tensor(0.1, dtype=torch.float32)) == 2  # a loss in float32: read as float32, exactly
    expected.append(torch.tensor(0.1, dtype=torch.float32).item())
    c.put(("out", "b", True), torch.tensor([[0.5, -0.25], [65504.0, 1.0]], dtype=torch.float16))
    expected += [-0.25, 65504.0]
    c.put(("grad", "a", True), torch.tensor([-math.inf, 3.0], dtype=torch.float16))
    expected += [-math.inf, 3.0]
    assert c.add(torch.tensor([2**40 + 1, 7])) == 7  # integer counts: made float64 (float16 would round them)
    expected += [float(2**40 + 1), 7.0]
    assert c.add(torch.tensor(1 / 3, dtype=torch.float64)) == 9
    expected.append(1 / 3)
    c.put(("grad", "b", True), torch.tensor([math.nan, 1.0], dtype=torch.float16))
    expected += [math.nan, math.nan]  # aminmax propagates NaN to both ends
    assert c.add(torch.tensor([1.5, -2.5])) == 12  # a 1-D block at the end
    expected += [1.5, -2.5]
    assert c.size == len(expected) == 14
    return c, expected


def _same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


def test_one_slab_read_puts_values_between_the_pairs_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    c, expected = _interleaved()
    quick = c.read()
    assert _same(quick, expected)
    monkeypatch.setattr(Collector, "_read_one_slab", lambda self, flat: None)  # the general path
    assert _same(c.read(), quick)


def test_one_slab_read_without_values_and_without_pairs() -> None:
    c = Collector(Slabs())
    at = [c.put(("out", f"m{i}", True), torch.tensor([float(-i), float(i)], dtype=torch.bfloat16)) for i in range(3)]
    assert at == [0, 2, 4] and c.read() == [0.0, 0.0, -1.0, 1.0, -2.0, 2.0]
    values = Collector(Slabs())
    values.add(torch.tensor(4.0))
    values.add(torch.tensor([5, 6]))
    assert values.read() == [4.0, 5.0, 6.0]


def test_fold_pairs_keeps_the_records_rules() -> None:
    keys = [
        ("out", "a", True), ("out", "a", True),  # two calls of one module: the larger |x|
        ("out", "mask", True),  # -inf alone is a mask: its finite side counts
        ("out", "nan", True), ("out", "inf", True),  # non-finite outputs, in completion order
        ("grad", "a", True),  # stored unscaled: divided by the scale
        ("grad", "bad", True),
        ("out", "f32", False),  # not in the low-precision format: cannot overflow it
        ("op", "a:matmul#0", True),  # an op's: the forecast's, not the record's
        ("root", "", True),
    ]
    values = [
        (-3.0, 2.0), (-1.0, 4.0), (-math.inf, 7.0), (math.nan, 1.0), (0.0, math.inf), (-512.0, 256.0),
        (1.0, math.nan), (-1e6, 1e6), (-9e4, 9e4), (-0.5, 0.25),
    ]
    numbers = [v for pair in values for v in pair]
    folded = Folded()
    fold_pairs(keys, range(0, len(numbers), 2), numbers, 256.0, folded)
    assert folded.out_max == {"a": 4.0, "mask": 7.0, "": 0.5}
    assert folded.grad_max == {"a": 2.0}
    assert folded.bad_out == ["nan", "inf"] and folded.bad_grad == ["bad"]


def test_a_step_record_folds_what_the_collector_measured() -> None:
    c = Collector(Slabs())
    c.put(("out", "l1", True), torch.tensor([-6.0, 3.0], dtype=torch.float16))
    c.put(("grad", "l1", True), torch.tensor([-8.0, 16.0], dtype=torch.float16))
    scale = c.add(torch.tensor(8.0))
    numbers = c.read()
    folded = Folded()
    c.fold(numbers, numbers[scale], folded)
    record, bad = readback.step_record(
        3, 0, numbers, [], [], True, 1, readback.StepScales(8.0, 8.0, 0.0), folded,
    )
    assert dict(record.out_abs_max) == {"l1": 6.0} and dict(record.grad_abs_max) == {"l1": 2.0}
    assert record.sampled and not record.skipped and bad == [] and not record.local_nonfinite
    unsampled, _ = readback.step_record(3, 0, numbers, [], [], False, 1, readback.StepScales(8.0, 8.0, 0.0), folded)
    assert dict(unsampled.out_abs_max) == {} and dict(unsampled.grad_abs_max) == {}


def test_a_module_far_from_the_limit_again_drops_its_fit() -> None:
    f = Forecaster(warn_bits=6.0, format_max=2.0**16)
    for step in range(10):  # about 4 bits of headroom, losing 0.1 bits a step: fitted
        f.observe(step, {"m": 2.0 ** (12 + 0.1 * step)})
    assert "m" in f.fits and f.fits["m"].points == 10 and f.fits["m"].rate == pytest.approx(0.1)
    far = 2.0 ** (16 - 6.0 - DENSE_MARGIN_BITS - 1)  # a headroom of warn_bits + the dense margin + 1 bit
    f.observe(10, {"m": far})
    assert "m" not in f.fits and f.at_risk["m"] == 0 and f.latest()["m"] == pytest.approx(13.0)
    assert f.checked == ["m"] and len(f.series["m"]) == 11


def test_scale_and_found_inf_are_one_number_each() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    w = torch.ones(3, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.scale((w * torch.tensor([1.0, math.inf, 1.0])).sum()).backward()
    scaler.step(opt)
    before = scale_value(scaler)
    flags = found_inf_flags(scaler)
    assert isinstance(before, torch.Tensor) and before.numel() == 1 and before.data_ptr() != scaler._scale.data_ptr()
    scaler.update()
    c = Collector(Slabs())
    at = [c.add(v) for v in (before, scale_value(scaler), *flags)]
    numbers = c.read()
    assert [numbers[i] for i in at] == [1024.0, 512.0, 1.0]


def _model() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


@pytest.mark.parametrize("dicts", [True, False])
def test_gradients_are_recorded_with_or_without_the_tensors_own_hook_dict(dicts: bool) -> None:
    model = _model()
    x = torch.randn(6, 4)
    with ampdoctor.watch(model, stats_every=1, dtype=torch.bfloat16, save_bundle=False) as doctor:
        doctor.hooks.dicts_ok = dicts  # False: every gradient hook through torch's registration
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss = out.float().pow(2).sum()
        doctor.see_loss(loss)
        loss.backward()
        doctor.step()
    step = doctor.steps[0]
    expected = (2 * out.detach().float()).bfloat16().double().abs().max().item()  # d loss / d out
    assert set(step.grad_abs_max) == {"", "0", "1", "2"} and step.grad_abs_max["2"] == expected
    assert set(step.out_abs_max) == {"", "0", "1", "2"} and doctor._errors == []
    assert not out._backward_hooks  # the step's hooks went with it


def test_one_slab_across_chunks_reads_every_row_in_order() -> None:
    from ampdoctor.training.fastpath import CHUNK_ROWS

    c = Collector(Slabs())
    n = 2 * CHUNK_ROWS + 7  # two full chunks and part of a third
    expected: list[float] = []
    for i in range(n):
        c.put(("out", f"m{i}", True), torch.tensor([float(-i), float(i % 2048)], dtype=torch.float16))
        expected += [float(-i), float(i % 2048)]
        if i == CHUNK_ROWS:  # a value between the chunks
            c.add(torch.tensor(0.5))
            expected.append(0.5)
    assert c.read() == expected and len(c.slabs._by_key[(torch.device("cpu"), torch.float16)].chunks) == 3


def test_the_lookout_leaves_the_record_maxima_alone_and_tracks_only_when_asked() -> None:
    from ampdoctor.training.lookout import Lookout

    look = Lookout(6.0, 100, None, 0, 1)
    out_max = {"": 8.0, "a": 2.0, "b": 4.0}
    assert look.after_step(0, True, [], torch.float16, 1.0, False, None, out_max, track=False) is None
    assert look.seen is out_max and out_max == {"": 8.0, "a": 2.0, "b": 4.0}
    op = ("op", "a:mul#0", -32.0, 16.0, True)
    assert look.after_step(1, True, [op], torch.float16, 1.0, False, None, out_max) == ["b", "a"]
    assert look.seen == {"": 8.0, "a": 2.0, "b": 4.0, "a:mul#0": 32.0} and "a:mul#0" not in out_max


@pytest.mark.parametrize("every", [1, 2])
def test_tracked_modules_are_chosen_only_when_some_step_is_unsampled(every: int) -> None:
    model = _model()
    x = torch.randn(6, 4)
    with ampdoctor.watch(model, stats_every=every, dtype=torch.bfloat16, save_bundle=False) as doctor:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).sum()
            doctor.see_loss(loss)
            loss.backward()
            doctor.step()
    # every=2: step 0 sampled, so step 1 hooks the tightest modules; every=1: no step would ever use them
    assert (doctor.hooks.tracked != []) == (every == 2) and doctor._errors == []
