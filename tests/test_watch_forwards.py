"""The watch measures eager modules through instance ``forward`` wrappers (training/forwards.py): torch's fast call
path is kept (no hook in any hook dict), the same statistics as forward hooks, the module restored exactly, and a
copy or pickle of a watched model clean."""

from __future__ import annotations

import copy
import functools
import inspect
import io
import pickle
from typing import Any

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.training import hooks as watch_hooks
from ampdoctor.training.forwards import ForwardTap

FP16 = torch.float16


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 3))


def step(model: nn.Module, scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer, i: int) -> None:
    opt.zero_grad()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) * (i + 1)
    with torch.autocast("cpu", dtype=FP16):
        out = model(x)
    scaler.scale(out.float().pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()


def train(model: nn.Module, steps: int, **kwargs: Any) -> ampdoctor.Report:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with ampdoctor.watch(model, scaler, save_bundle=False, **kwargs) as doctor:
        for i in range(steps):
            step(model, scaler, opt, i)
    return doctor.report()


def wrapped(model: nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if "forward" in m.__dict__}


def assert_clean(model: nn.Module) -> None:
    for name, m in model.named_modules():
        assert "forward" not in m.__dict__ and "__getstate__" not in m.__dict__, name
        assert not m._forward_hooks and not m._forward_pre_hooks, name


def test_watched_modules_keep_torchs_fast_path_and_are_measured() -> None:
    model = mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with ampdoctor.watch(model, scaler, stats_every=1, save_bundle=False) as doctor:
        for i in range(2):
            step(model, scaler, opt, i)
            assert wrapped(model) == {"0", "1", "2", "2.0", "2.1", "3"}  # every module but the root
            for name, m in model.named_modules():  # no hook at all: Module._call_impl takes its fast path
                if name:  # (the root has the watch's bookkeeping hooks)
                    assert not m._forward_hooks and not m._forward_pre_hooks, name
                    assert not m._backward_hooks and not m._backward_pre_hooks, name
    assert_clean(model)
    record = doctor.report().steps[-1]
    assert record.sampled
    assert set(record.out_abs_max) == {"", "0", "1", "2", "2.0", "2.1", "3"}
    assert set(record.grad_abs_max) == {"", "0", "1", "2", "2.0", "2.1", "3"}


def test_wrappers_and_hooks_measure_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    by_wrappers = train(mlp(), 4, stats_every=1)
    monkeypatch.setattr(watch_hooks, "wrappers_fit", lambda model, root: False)
    model = mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with ampdoctor.watch(model, scaler, stats_every=1, save_bundle=False) as doctor:
        for i in range(4):
            step(model, scaler, opt, i)
            assert not wrapped(model) and model[0]._forward_hooks  # the hook path, for the comparison
    by_hooks = doctor.report()
    assert len(by_wrappers.steps) == len(by_hooks.steps) == 4
    for a, b in zip(by_wrappers.steps, by_hooks.steps):
        assert a.out_abs_max == b.out_abs_max and a.grad_abs_max == b.grad_abs_max
        assert len(a.out_abs_max) == 7


def test_unsampled_steps_run_no_wrapper_but_the_tracked_ones() -> None:
    model = mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    seen: list[set[str]] = []
    with ampdoctor.watch(model, scaler, stats_every=4, save_bundle=False) as doctor:
        for i in range(4):
            seen.append(wrapped(model))
            step(model, scaler, opt, i)
        tracked = set(doctor.hooks.tracked)
    assert seen[0] == {"0", "1", "2", "2.0", "2.1", "3"}  # step 0 is sampled
    assert seen[1] == seen[2] == seen[3] == tracked and len(tracked) < 6  # the forecast's watchlist only
    assert_clean(model)


class Doubling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def test_a_modules_own_instance_forward_runs_and_comes_back() -> None:
    model = nn.Sequential(Doubling(), nn.ReLU())
    inner = model[0]
    own = functools.partial(lambda m, x: Doubling.forward(m, x) * 2, inner)  # the user's own instance forward
    inner.forward = own  # type: ignore[method-assign]
    x = torch.ones(2, 8)
    expected = model(x)
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, scaler, stats_every=1, save_bundle=False) as doctor:
        assert inner.__dict__["forward"] is not own
        assert torch.equal(model(x), expected)  # the user's forward, wrapped
        with torch.autocast("cpu", dtype=FP16):
            out = model(x)
        scaler.scale(out.float().sum()).backward()
        scaler.step(torch.optim.SGD(model.parameters(), lr=0.0))
        scaler.update()
    assert inner.__dict__["forward"] is own and "__getstate__" not in inner.__dict__
    assert "forward" not in model[1].__dict__ and "forward" not in inner.linear.__dict__
    record = doctor.report().steps[0]
    assert record.out_abs_max["0"] == pytest.approx(2 * record.out_abs_max["0.linear"], rel=1e-3)


def test_a_copy_or_pickle_of_a_watched_model_is_clean() -> None:
    model = mlp()
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(3, 8)
    with ampdoctor.watch(model, scaler, stats_every=1, save_bundle=False):
        assert wrapped(model)
        keys = list(model.state_dict())
        twin = copy.deepcopy(model)
        shallow = copy.copy(model[0])
        buffer = io.BytesIO()
        torch.save(model, buffer)  # the whole model pickled while watched
        pickled = pickle.loads(pickle.dumps(model))
        with torch.no_grad():
            twin[0].weight.mul_(-1.0)  # the copy's forward runs the copy's weights, not the watched model's
        assert not torch.equal(twin(x), model(x))
    assert_clean(model)
    for other in (twin, pickled, torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)):
        assert_clean(other)
        assert list(other.state_dict()) == keys
    assert "forward" not in shallow.__dict__ and "__getstate__" not in shallow.__dict__
    with torch.no_grad():
        twin[0].weight.mul_(-1.0)
    assert torch.equal(twin(x), model(x)) and torch.equal(pickled(x), model(x))


def test_the_users_hooks_run_in_order_and_one_that_replaces_the_output_is_measured_after() -> None:
    model = mlp()
    calls: list[str] = []
    model[0].register_forward_pre_hook(lambda m, a: calls.append("pre"))
    model[2][0].register_forward_pre_hook(lambda m, a: calls.append("pre 2.0"))
    model[2][0].register_forward_hook(lambda m, a, out: calls.append("post 2.0") or torch.full_like(out, 3.0))
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, scaler, stats_every=1, save_bundle=False) as doctor:
        assert "forward" in model[0].__dict__  # pre-hooks only: wrapped
        assert "forward" not in model[2][0].__dict__  # a forward hook: ours is a hook registered after it
        with torch.autocast("cpu", dtype=FP16):
            out = model(torch.randn(2, 8))
        scaler.scale(out.float().sum()).backward()
        scaler.step(torch.optim.SGD(model.parameters(), lr=0.0))
        scaler.update()
    assert calls == ["pre", "pre 2.0", "post 2.0"]
    assert doctor.report().steps[0].out_abs_max["2.0"] == 3.0  # what the user's hook handed on
    assert len(model[0]._forward_pre_hooks) == 1 and len(model[2][0]._forward_hooks) == 1  # theirs stay
    assert not wrapped(model)


def test_two_watches_leave_in_any_order() -> None:
    for first_out in (True, False):
        model = mlp()
        scaler = torch.amp.GradScaler("cpu")
        a = ampdoctor.watch(model, scaler, stats_every=1, save_bundle=False).start()
        b = ampdoctor.watch(model, None, stats_every=1, save_bundle=False).start()
        assert copy.deepcopy(model)[0].__dict__.keys() == nn.Linear(8, 8).__dict__.keys()
        (a if first_out else b).close()
        assert wrapped(model) == {"0", "1", "2", "2.0", "2.1", "3"}
        (b if first_out else a).close()
        assert_clean(model)


def test_the_wrapper_keeps_the_signature_and_tap_removal_is_idempotent() -> None:
    linear = nn.Linear(4, 4)
    seen: list[Any] = []
    tap = ForwardTap(linear, seen.append)
    assert inspect.signature(linear.forward) == inspect.signature(nn.Linear(4, 4).forward)
    y = linear(torch.ones(1, 4))
    assert len(seen) == 1 and seen[0] is y
    linear.forward = lambda x: x  # type: ignore[method-assign]  # someone sets their own over ours
    tap.remove()
    tap.remove()
    assert "__getstate__" not in linear.__dict__ and linear.__dict__["forward"](3) == 3  # theirs stays


def test_data_parallel_keeps_forward_hooks() -> None:
    model = nn.DataParallel(mlp())  # its replicas copy each module's __dict__: a wrapper would call the original
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, scaler, stats_every=1, save_bundle=False) as doctor:
        assert not wrapped(model) and model.module[0]._forward_hooks
        with torch.autocast("cpu", dtype=FP16):
            out = model(torch.randn(2, 8))
        scaler.scale(out.float().sum()).backward()
        scaler.step(torch.optim.SGD(model.parameters(), lr=0.0))
        scaler.update()
    assert_clean(model)
    assert set(doctor.report().steps[0].out_abs_max) == {"", "0", "1", "2", "2.0", "2.1", "3"}


class HooksItsOutput(nn.Module):
    """A module whose own forward hangs a hook on its output before handing it on."""

    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.linear, self.seen = nn.Linear(8, 8), seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        out.register_hook(lambda g: self.seen.append("own"))
        return out


def test_the_users_tensor_hooks_on_module_outputs_run_and_stay() -> None:
    seen: list[str] = []
    model = nn.Sequential(HooksItsOutput(seen), nn.Linear(8, 8))
    with ampdoctor.watch(model, stats_every=1, dtype=FP16, save_bundle=False) as doctor:
        with torch.autocast("cpu", dtype=FP16):
            hidden = model[0](torch.randn(2, 8))  # a training step that calls a submodule directly
            out = model[1](hidden)
        hidden.register_hook(lambda g: seen.append("user"))  # into the hook dict the watch's hook is in
        loss = out.float().pow(2).sum()
        doctor.see_loss(loss)
        loss.backward(retain_graph=True)
        doctor.step()
        assert sorted(seen) == ["own", "user"]
        loss.backward()  # the closed step's graph again: the user's hooks fire, the watch's are gone
        doctor.step()
    assert sorted(seen) == ["own", "own", "user", "user"]
    first, second = doctor.steps
    assert set(first.grad_abs_max) == {"0", "0.linear", "1"} and dict(second.grad_abs_max) == {}
    assert doctor._errors == []


def test_a_copy_made_inside_a_step_records_nothing_into_the_watch() -> None:
    model = mlp()
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with ampdoctor.watch(model, scaler, stats_every=1, save_bundle=False) as doctor:
        twin = copy.deepcopy(model)  # an EMA copy, say, made while watched
        with torch.autocast("cpu", dtype=FP16):
            out = model(torch.randn(2, 8))
            twin(torch.randn(2, 8) * 1e3).float().sum().backward()  # a training forward of the copy
        scaler.scale(out.float().sum()).backward()
        scaler.step(opt)
        scaler.update()
    record = doctor.report().steps[0]
    assert record.micro_batches == 1  # the watched model's forward only
    assert max(record.out_abs_max.values()) < 100  # nothing of the copy's (1e3-scaled) outputs


class _PropertyForward(nn.Module):
    """``forward`` chosen by a property: a data descriptor, which wins over an instance ``forward`` wrapper."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2

    @property
    def forward(self):  # type: ignore[override]
        return self._run


def test_a_property_forward_module_is_measured_by_a_hook() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _PropertyForward(), nn.Linear(8, 3))
    report = train(model, 2, stats_every=1)
    # A wrapper would have been bypassed (torch calls the property's method): the module went unmeasured.
    assert {"1", "1.lin"} <= set(report.steps[-1].out_abs_max)
    assert_clean(model)


def test_a_copy_of_a_parametrized_module_made_while_watched_computes_with_its_own_weights() -> None:
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    model = nn.Sequential(parametrizations.weight_norm(nn.Linear(8, 8)), nn.ReLU(), nn.Linear(8, 3))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(4, 8)
    with ampdoctor.watch(model, scaler, stats_every=1, save_bundle=False):
        step(model, scaler, opt, 0)
        # parametrize's own __deepcopy__ copies the module's __dict__ as it is (an EMA copy, swa_utils.AveragedModel)
        ema = copy.deepcopy(model)
        for i in range(1, 3):
            step(model, scaler, opt, i)  # the original's weights move
        assert not {"forward", "__getstate__", "__deepcopy__"} & set(vars(ema[0]))
        with torch.no_grad():
            # the first version of the wrappers: the copy's forward was the original module's
            assert torch.equal(ema[0](x), torch.nn.functional.linear(x, ema[0].weight, ema[0].bias))
            assert not torch.equal(ema[0].weight, model[0].weight)
    assert_clean(model)
    for name, m in model.named_modules():
        assert "__deepcopy__" not in m.__dict__, name
