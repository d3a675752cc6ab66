"""Adversarial models for the instance ``forward`` wrappers of the survey (``capture/call_wrappers.py``) and of the
watch (``training/forwards.py``).

torch calls ``self.forward`` (ordinary attribute lookup: data descriptors on the class first, then the instance
dict, then the class attribute bound through its ``__get__``). Where the class's ``forward`` is not a plain function
(a staticmethod, a classmethod, a singledispatchmethod, a property) a wrapper that calls ``cls.forward(module, ...)``
would run something else, or be bypassed: such modules keep hooks. A bound wrapper that the model's code keeps
outlives its pass, spent; a class ``__deepcopy__`` that copies ``__dict__`` as it is (``parametrize``'s) gets a copy
without the wrapper. Each test failed on the first version of the survey's wrappers.
"""

from __future__ import annotations

import copy
import functools
import pickle

import torch
from torch import nn
from torch.nn.utils import parametrizations

import ampdoctor

W = 8


def _diagnose(model: nn.Module, batch: torch.Tensor) -> ampdoctor.Report:
    return ampdoctor.diagnose(model, batch, device_type="cpu", progress=False, dtype=torch.float16)


def _hot(n_in: int = W, n_out: int = W) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    with torch.no_grad():
        layer.weight.mul_(1e4)  # float16 overflows on inputs of |x| ~ 100
    return layer


class Flatten(nn.Module):
    """A staticmethod forward (as in many detection code bases): ``self.forward(x)`` is ``Flatten.forward(x)``."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.view(x.size(0), -1)


def test_a_staticmethod_forward_runs_under_diagnose() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(W, W), Flatten(), nn.Linear(W, 2))
    batch = torch.randn(4, W)
    model(batch)  # runs eagerly
    # with wrappers: ModelRaised "Flatten.forward() takes 1 positional argument but 2 were given"
    report = _diagnose(model, batch)
    assert str(report.verdict) == "healthy"


class Scale(nn.Module):
    """Scales a tensor by 1e5; anything else passes through. ``self.forward(x)`` dispatches on ``x``."""

    @functools.singledispatchmethod
    def forward(self, x: object) -> object:
        return x

    @forward.register
    def _(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e5


def test_a_singledispatchmethod_forward_is_not_reported_healthy() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(W, W), Scale(), nn.Linear(W, 2))
    batch = torch.ones(4, W)
    with torch.autocast("cpu", dtype=torch.float16):
        assert not torch.isfinite(model(batch)).all()  # the model overflows float16 as it runs
    # with wrappers: the wrapper calls Scale.forward(module, x), which dispatches on the module, not on x: the
    # pass runs the pass-through branch and the report says HEALTHY
    report = _diagnose(model, batch)
    assert str(report.verdict) != "healthy"
    assert report.forward_origin is not None and report.forward_origin.module == "1"


class PropertyForward(nn.Module):
    """``forward`` chosen by a property (a data descriptor: it wins over the instance dict's wrapper)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(W, W) * 1e4)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w

    @property
    def forward(self):  # type: ignore[override]
        return self._matmul


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(W, W)
        self.inner = PropertyForward()
        self.post = nn.Linear(W, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.inner(self.pre(x)))


def test_a_property_forward_module_is_still_seen() -> None:
    torch.manual_seed(0)
    report = _diagnose(Holder(), torch.randn(4, W) * 100)
    assert "inner" in [c.module for c in report.trace.calls]  # with wrappers: ['', 'pre', 'post']
    assert report.forward_origin is not None and report.forward_origin.module == "inner"  # wrappers: '' (root)


class LazyImpl(nn.Module):
    """Picks its implementation on the first call (``self._impl = self.a.forward``): a diagnosis before training
    is that first call."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(W, W)
        self.a = _hot()
        self.head = nn.Linear(W, 2)
        self._impl = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._impl is None:
            self._impl = self.a.forward
        return self.head(self._impl(self.pre(x)))


def test_a_forward_read_during_the_pass_is_not_a_pass_wrapper() -> None:
    torch.manual_seed(0)
    model = LazyImpl()
    report = _diagnose(model, torch.randn(4, W) * 100)
    # The survey's bound wrapper stays in the model (its own code kept it), spent: it holds nothing of the pass and
    # computes what the class's forward does. Every later pass's wrapper saw the calls made through it: the op
    # zoom named the op (the first version: 'nan', no op, no verified remedy; with hooks: 'overflow', aten::addmm).
    spent = model._impl
    assert spent.__self__ is model.a and spent.__func__._ampdoctor_pass_forwards == []
    x = torch.randn(3, W)
    assert torch.equal(spent(x), nn.Linear.forward(model.a, x))
    assert str(report.verdict) == "overflow"
    assert report.forward_origin is not None and report.forward_origin.module == "a"
    assert report.forward_origin.op is not None and report.forward_origin.op.op == "aten::addmm"
    # A copy or pickle of the model takes the copy's own forward for the kept one, as without the diagnosis.
    for made in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        with torch.no_grad():
            made.a.weight.mul_(2.0)
            assert torch.equal(made._impl(x), nn.Linear.forward(made.a, x))


class EmaInForward(nn.Module):
    """Deep-copies a weight-normed child in its forward (an EMA made on the first step); ``parametrize`` gives the
    child's class a ``__deepcopy__`` that deep-copies ``__dict__`` (no ``__getstate__``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = parametrizations.weight_norm(nn.Linear(W, W))
        self.head = nn.Linear(W, 2)
        self.ema: list[nn.Module] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.ema:
            self.ema.append(copy.deepcopy(self.body))
        return self.head(self.body(x))


def test_a_copy_through_a_class_deepcopy_carries_no_wrapper() -> None:
    torch.manual_seed(0)
    model = EmaInForward()
    _diagnose(model, torch.randn(4, W))
    (made,) = model.ema
    # The first version: the copy kept the pass's bound wrapper and __getstate__ for good (bound to the copy,
    # calling the pass's recorder). With forward hooks on the module this diagnosis raises instead (the hook
    # entries deep-copied: "cannot pickle 'mappingproxy' object"), as before the wrappers.
    assert "forward" not in vars(made) and "__getstate__" not in vars(made) and "__deepcopy__" not in vars(made)
    assert not {"forward", "__getstate__", "__deepcopy__"} & set(vars(model.body))
    x = torch.randn(3, W)
    assert torch.equal(made(x), model.body(x))


class ParametrizesInForward(nn.Module):
    """Parametrizes its child on the first call, then deep-copies it: the child's class changes during the pass."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(W, W)
        self.head = nn.Linear(W, 2)
        self.copies: list[nn.Module] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.copies:
            parametrizations.weight_norm(self.a)
            self.copies.append(copy.deepcopy(self.a))
        return self.head(self.a(x))


def test_a_module_whose_class_changes_during_the_pass_is_copied_clean_and_put_back() -> None:
    torch.manual_seed(0)
    model = ParametrizesInForward()
    weight = model.a.weight
    report = _diagnose(model, torch.randn(4, W))
    assert str(report.verdict) == "healthy"
    (made,) = model.copies
    ours = {"forward", "__getstate__", "__deepcopy__"}
    assert not ours & set(vars(made)) and not ours & set(vars(model.a))
    x = torch.randn(3, W)
    with torch.no_grad():
        made.parametrizations.weight.original0.mul_(2.0)  # the copy's own magnitude
        assert torch.allclose(made(x), nn.functional.linear(x, made.weight, made.bias))
        assert not torch.allclose(made(x), nn.functional.linear(x, weight, model.a.bias))
    # The model is put back as it was: a plain Linear with its own weight (the state guard, with a note).
    assert type(model.a) is nn.Linear and model.a.weight is weight and not model.a._modules
    assert any("module classes or submodules" in n for n in report.run.notes)
