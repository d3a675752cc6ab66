"""Found by a third review (each test failed before the fix): a user's forward set during a pass with
``functools.update_wrapper`` (accelerate's ConvertOutputsToFp32) copies the survey wrapper's mark and must not be
taken for the pass's; a kept watch forward that wraps a plain function pickles; per-sample gradients
(``vmap(grad(...))``) of the watched model run without the watch's op survey raising inside the transform."""

from __future__ import annotations

import functools
import pickle
import types

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import ampdoctor


class _Conv:
    """accelerate's ConvertOutputsToFp32: update_wrapper over the bound forward's __func__, then MethodType."""

    def __init__(self, f):  # type: ignore[no-untyped-def]
        self.f = f
        functools.update_wrapper(self, f)

    def __call__(self, *a, **k):  # type: ignore[no-untyped-def]
        return self.f(*a, **k)


class _SetsForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)
        self.done = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.done:
            self.done = True
            self.b.forward = types.MethodType(_Conv(self.b.forward.__func__), self.b)
        return self.b(torch.relu(self.a(x)))


def test_a_users_forward_set_during_a_pass_stays_after_diagnose() -> None:
    # PassForwards.remove tells its wrappers by the copied mark (update_wrapper copies it), not by identity
    torch.manual_seed(0)
    model = _SetsForward()
    ampdoctor.diagnose(model, torch.randn(4, 8), device_type="cpu", progress=False, dtype=torch.float16)
    assert "forward" in vars(model.b)  # passed before 60744ea


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class _KeepsPlain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.c = nn.Identity()
        self.c.forward = _double  # a module-level function as the instance forward: picklable
        self.b = nn.Linear(8, 3)
        self.impl = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl is None:
            self.impl = self.c.forward
        return self.b(self.impl(self.a(x)))


def test_a_kept_forward_wrapping_a_plain_function_pickles_after_the_watch() -> None:
    # _Forward.__reduce_ex__ returns inner.__reduce_ex__(protocol): a function's raises "cannot pickle 'function'"
    torch.manual_seed(0)
    model = _KeepsPlain()
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with ampdoctor.watch(model, scaler, stats_every=1, save_bundle=False):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    loaded = pickle.loads(pickle.dumps(model))  # works unwatched
    assert loaded.impl is _double


def test_per_sample_grads_of_the_watched_model_do_not_raise() -> None:
    # the op survey (optrack._Survey) measures ops inside vmap(grad(...)): aminmax.out has no batching rule
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return functional_call(model, p, (x,)).float().pow(2).mean()

    with ampdoctor.watch(model, torch.amp.GradScaler("cpu"), stats_every=1, save_bundle=False) as doctor:
        grads = vmap(grad(loss_fn), in_dims=(None, 0))(params, torch.randn(4, 1, 8))
    assert grads["0.weight"].shape == (4, 8, 8)
    assert not [n for n in doctor.report().run.notes if "error" in n]
    for name, m in model.named_modules():
        assert "forward" not in vars(m) and not m._forward_hooks and not m._forward_pre_hooks, name
