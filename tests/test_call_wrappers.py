"""The pass's instance ``forward`` wrappers (capture/call_wrappers.py, issue 22): the same records as forward hooks,
only on modules where that holds, invisible to copies and signatures, and gone after the pass."""

from __future__ import annotations

import copy
import inspect
import pickle
from typing import Any

import pytest
import torch
from helpers import constant_linear, pass_spec
from torch import nn
from torch.utils.checkpoint import checkpoint

import ampdoctor
import ampdoctor.capture.call_wrappers as call_wrappers
from ampdoctor.capture.call_wrappers import PassForwards, wrappers_fit
from ampdoctor.capture.hooks import Recorder
from ampdoctor.capture.passes import run_pass
from ampdoctor.capture.stats import StatsCollector


class Shared(nn.Module):
    """A residual block that calls one child twice, once with a keyword, and a head that overflows float16."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.act = nn.GELU()
        self.head = constant_linear(8, 4, 6000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.inner(x))
        h = self.norm(input=h + self.inner(h))
        return self.head(h.abs() + 1.0)


class Checkpointed(nn.Module):
    """Two blocks under activation checkpointing (reentrant and not): their forwards run again in the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.b = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = constant_linear(8, 2, 2000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.a, x, use_reentrant=True)
        h = checkpoint(self.b, h, use_reentrant=False)
        return self.head(h * 40.0)


class HookedHead(nn.Module):
    """A user's forward hook that scales a child's output by 1000 (it must still run after ours, on that child)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)
        self.head.register_forward_hook(lambda m, args, out: out * 1000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)) * 100.0


def _report(model: nn.Module, batch: torch.Tensor, wrappers: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(call_wrappers, "_works", wrappers)
    return ampdoctor.diagnose(model, batch, device_type="cpu", progress=False, verify=False)


@pytest.mark.parametrize("make", [Shared, Checkpointed, HookedHead])
def test_a_diagnosis_records_the_same_with_wrappers_as_with_hooks(make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model, batch = make(), torch.randn(4, 8)
    hooked = _report(model, batch, False, monkeypatch)
    wrapped = _report(model, batch, True, monkeypatch)
    assert hooked.trace == wrapped.trace
    assert (wrapped.verdict, wrapped.forward_origin, wrapped.backward_origin) == (
        hooked.verdict, hooked.forward_origin, hooked.backward_origin)
    assert str(wrapped.verdict) != "healthy"  # each model carries a float16 overflow: the comparison is not empty


def test_wrappers_go_only_on_hook_free_modules_and_nothing_is_left() -> None:
    model = HookedHead()
    names = {id(m): n for n, m in model.named_modules()}
    before = {n: dict(vars(m)) for n, m in model.named_modules()}
    recorder = Recorder(names, list(model.modules()), StatsCollector(torch.float16, False), record_grads=True)
    recorder.install(list(model.named_parameters()))
    try:
        assert "forward" in vars(model) and "forward" in vars(model.body)
        assert "forward" not in vars(model.head)  # the user's hook runs after ours: a hook, as before
        assert recorder._post in model.head._forward_hooks.values()
        # inspect reads the class's forward (Hugging Face asks inspect.signature(self.forward) for argument names)
        assert inspect.signature(model.body.forward) == inspect.signature(nn.Linear(1, 1).forward)
        model(torch.randn(2, 8))
        assert [c.module for c in recorder.calls] == ["", "body", "head"]
    finally:
        recorder.remove()
    assert {n: dict(vars(m)) for n, m in model.named_modules()} == before
    recorder.remove()  # idempotent


class CopiesItsChild(nn.Module):
    """A forward that deep-copies and pickles a child while the pass wraps it (an EMA made inside a forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(4, 4)
        self.copies: list[nn.Module] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.copies.append(copy.deepcopy(self.child))
        self.copies.append(pickle.loads(pickle.dumps(self.child)))
        self.copies.append(copy.copy(self.child))
        return self.child(x)


def test_a_copy_made_during_the_pass_carries_no_wrapper() -> None:
    model = CopiesItsChild()
    spec = pass_spec(model, torch.randn(3, 4))
    run_pass(spec, 1024.0)
    assert len(model.copies) == 3
    for made in model.copies:
        assert "forward" not in vars(made) and "__getstate__" not in vars(made)
        assert torch.equal(made(torch.ones(1, 4)), model.child(torch.ones(1, 4)))
    assert "forward" not in vars(model.child) and "__getstate__" not in vars(model.child)


def test_a_forward_set_over_ours_during_the_pass_stays() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    forwards = PassForwards(lambda *a: None, lambda *a: None, lambda *a: None)
    forwards.wrap(model[0])

    def theirs(x: torch.Tensor) -> torch.Tensor:
        return x

    model[0].forward = theirs  # e.g. accelerate attaching its hooks mid-run
    forwards.remove()
    assert vars(model[0])["forward"] is theirs and "__getstate__" not in vars(model[0])


def test_models_where_wrappers_do_not_fit_get_hooks_everywhere() -> None:
    plain = [nn.Linear(2, 2), nn.ReLU()]
    assert wrappers_fit(plain)
    assert not wrappers_fit([nn.DataParallel(nn.Linear(2, 2)), nn.Linear(2, 2)])
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        assert not wrappers_fit(plain)
    finally:
        handle.remove()
    forwards = PassForwards(lambda *a: None, lambda *a: None, lambda *a: None)
    assert not forwards.fits(torch.jit.script(nn.Linear(2, 2)))
    with_forward = nn.Linear(2, 2)
    with_forward.forward = lambda x: x  # type: ignore[method-assign]  # an instance forward of the user's: kept
    assert not forwards.fits(with_forward)


def test_the_wrapper_check_passes_on_this_torch() -> None:
    call_wrappers._works = None
    assert call_wrappers.wrappers_work() is True
