"""The watch's per-module hot path with statistics every step: pairs keyed once per module, the read-back's one
scatter, gradient hooks that are gone once their step closes, and double backwards measured off the graph."""

from __future__ import annotations

import contextlib
import math
from collections import Counter, OrderedDict

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

import ampdoctor
from ampdoctor.training import collector, fastpath
from ampdoctor.training.fastpath import Slabs, remove_handles
from ampdoctor.training.forecast import Forecaster
from ampdoctor.training.readback import Collector


def test_pairs_and_values_interleaved_read_back_in_place() -> None:
    c = Collector(Slabs())
    a = c.put(("out", "a", True), torch.tensor([-2.0, 5.0], dtype=torch.float16))
    block = c.add(torch.tensor([7.0, 8.0, 9.0]))
    b = c.put(("grad", "b", False), torch.tensor([[0.5, -0.25]]))  # another slab (float32)
    scale = c.add(torch.tensor(1024.0, dtype=torch.float64))
    mask = c.put(("out", "c", True), torch.tensor([-math.inf, 3.0], dtype=torch.bfloat16))
    assert (a, block, b, scale, mask) == (0, 2, 5, 7, 8) and c.size == 10
    numbers = c.read()
    assert numbers == [-2.0, 5.0, 7.0, 8.0, 9.0, -0.25, 0.5, 1024.0, -math.inf, 3.0]
    assert c.pairs(numbers) == [
        ("out", "a", -2.0, 5.0, True), ("grad", "b", -0.25, 0.5, False), ("out", "c", -math.inf, 3.0, True),
    ]


def test_the_scatter_and_the_loop_place_numbers_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(4)
    c = Collector(Slabs())
    expected: dict[int, float] = {}
    for i in range(300):  # over SCATTER_PAIRS, in two dtypes, a value every 40 pairs
        t = torch.randn(3, 2, dtype=torch.float16 if i % 3 else torch.float32) * 100
        at = c.put(("out", f"m{i}", i % 3 > 0), t)
        expected[at], expected[at + 1] = t.double().min().item(), t.double().max().item()
        if i % 40 == 0:
            v = torch.tensor([float(i), -1.5])
            start = c.add(v)
            expected[start], expected[start + 1] = float(i), -1.5
    assert sorted(expected) == list(range(c.size)) and collector.SCATTER_PAIRS <= 300
    scattered = c.read()
    monkeypatch.setattr(collector, "SCATTER_PAIRS", 10**9)
    assert c.read() == scattered == [expected[i] for i in range(c.size)]


def test_the_next_step_reuses_the_rows_and_a_stale_collector_reads_none() -> None:
    slabs = Slabs()
    first = Collector(slabs)
    first.put(("out", "a", True), torch.tensor([1.0, 2.0], dtype=torch.float16))
    second = Collector(slabs)
    second.put(("out", "a", True), torch.tensor([3.0, 4.0], dtype=torch.float16))
    assert second.read() == [3.0, 4.0]
    assert slabs.blocks(first) == []  # its rows now hold the next step's pairs


def test_remove_handles_removes_plain_and_extra_dict_handles() -> None:
    hooks: OrderedDict[int, object] = OrderedDict()
    extra: OrderedDict[int, object] = OrderedDict()
    plain = RemovableHandle(hooks)
    with_extra = RemovableHandle(hooks, extra_dict=extra)
    hooks[plain.id] = hooks[with_extra.id] = extra[with_extra.id] = print
    x = torch.randn(3, requires_grad=True)
    node_handle = (x * 2).grad_fn.register_prehook(lambda grads: None)  # type: ignore[union-attr]
    assert fastpath._PLAIN_HANDLES  # torch's handles as read inline (else every handle takes handle.remove())
    remove_handles([plain, with_extra, node_handle])
    assert not hooks and not extra
    remove_handles([plain, node_handle])  # twice: nothing left to remove, no error


def test_tightest_breaks_ties_by_first_seen() -> None:
    f = Forecaster(format_max=64.0)
    f.observe(0, {"a": 4.0, "b": 8.0, "c": 8.0, "d": 2.0})  # headroom bits: a 4, b 3, c 3, d 5
    assert f.tightest(3) == ["b", "c", "a"]
    assert f.tightest(2, ["c", "d", "b", "zzz"]) == ["b", "c"]
    f.observe(1, {"c": 16.0})  # c: 2 bits now; the others keep their latest
    assert f.latest() == {"a": 4.0, "b": 3.0, "c": 2.0, "d": 5.0}
    assert f.tightest(4) == ["c", "b", "a", "d"]


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def test_a_graph_kept_past_its_step_sends_nothing_into_the_next_step() -> None:
    model = _model()
    x = torch.randn(5, 4)
    with ampdoctor.watch(model, stats_every=1, dtype=torch.bfloat16, save_bundle=False) as doctor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss = out.float().pow(2).mean()
        doctor.see_loss(loss)
        loss.backward(retain_graph=True)
        doctor.step()
        loss.backward()  # the first step's graph again, in the second step: its hooks are gone
        doctor.step()
    first, second = doctor.steps
    assert set(first.grad_abs_max) == {"", "0", "1", "2"}
    assert second.sampled and dict(second.grad_abs_max) == {} and dict(second.out_abs_max) == {}
    assert doctor._errors == []


def test_a_backward_that_builds_a_graph_is_measured_exactly() -> None:
    model = _model()
    x = torch.randn(5, 4)
    with ampdoctor.watch(model, stats_every=1, dtype=torch.bfloat16, save_bundle=False) as doctor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss = out.float().pow(2).sum()
        doctor.see_loss(loss)
        # the hooks see gradients that require grad, with grad mode on
        grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        doctor.step()
    step = doctor.steps[0]
    expected = (2 * out.detach().float()).bfloat16()  # d loss / d out, cast back to the output's dtype
    assert step.grad_abs_max["2"] == expected.double().abs().max().item()
    assert set(step.grad_abs_max) == {"", "0", "1", "2"}
    assert doctor._errors == [] and all(g.requires_grad for g in grads)


class _Counting(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


def test_a_users_function_mode_sees_only_the_models_ops() -> None:
    model = _model()
    x = torch.randn(5, 4)
    seen = []
    for every in (None, 0, 1):  # no watch; a watch without module statistics; statistics on every module
        with ampdoctor.watch(model, stats_every=every or 0, dtype=torch.bfloat16, save_bundle=False) if (
            every is not None
        ) else contextlib.nullcontext() as doctor:
            mode = _Counting()
            with mode, torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            loss = out.float().pow(2).mean()
            if doctor is not None:
                doctor.see_loss(loss)
            loss.backward()
            if doctor is not None:
                doctor.step()
        seen.append(mode.calls)
    assert seen[2] == seen[1] == seen[0] and seen[0]["linear"] == 2
    assert doctor._errors == [] and set(doctor.steps[0].out_abs_max) == {"", "0", "1", "2"}
