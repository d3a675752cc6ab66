"""No hook dict is left on the user's parameters: torch keeps a tensor's ``_backward_hooks`` dict when its last hook
is removed, and with it a pre-hook that calls into Python for that tensor in every later backward. A pass (and a
watched step) that found no dict leaves none; a dict the user had stays, the same object with the same hooks."""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch import nn

import ampdoctor

FP16 = torch.float16


class TakesAndReturnsParameters(nn.Module):
    """A learned query fed to a child (a parameter as a module's input) and a module that hands back its own
    parameter (a learned positional table): gradient hooks on those are hooks on the parameters themselves."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.randn(3, 4))
        self.proj = nn.Linear(4, 4)
        self.table = Table()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.proj(self.query).sum(0) + x + self.table().sum(0)).sum(-1)


class Table(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 4))

    def forward(self) -> torch.Tensor:
        return self.weight


def _loss(out: Any, _batch: Any) -> torch.Tensor:
    return out.float().mean() * 1e-3


def test_diagnose_leaves_no_hook_dict_where_there_was_none() -> None:
    torch.manual_seed(0)
    model = TakesAndReturnsParameters()
    assert all(p._backward_hooks is None for p in model.parameters())
    report = ampdoctor.diagnose(model, torch.randn(5, 4), loss_fn=_loss, dtype=FP16)
    assert report.verdict == "healthy"
    left = {n: p._backward_hooks for n, p in model.named_parameters() if p._backward_hooks is not None}
    assert left == {}


def test_diagnose_keeps_the_users_own_hook_dicts_as_they_were() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    seen: list[str] = []
    user_handle = model[0].weight.register_hook(lambda g: seen.append("weight"))
    emptied = model[2].bias.register_hook(lambda g: None)
    emptied.remove()  # the user's own emptied dict: theirs, kept as it is
    dicts = {n: p._backward_hooks for n, p in model.named_parameters()}
    keys = {n: tuple(d) if d is not None else None for n, d in dicts.items()}

    ampdoctor.diagnose(model, torch.randn(3, 4), loss_fn=_loss, dtype=FP16)

    assert {n: p._backward_hooks for n, p in model.named_parameters()} == dicts  # the same objects (or None)
    assert all(p._backward_hooks is dicts[n] for n, p in model.named_parameters())
    assert {n: tuple(d) if d is not None else None for n, d in dicts.items()} == keys
    assert model[2].bias._backward_hooks is not None and not model[2].bias._backward_hooks
    assert model[0].bias._backward_hooks is None
    seen.clear()
    model(torch.randn(3, 4)).sum().backward()
    assert seen == ["weight"]  # the user's hook still fires, once
    user_handle.remove()


def test_a_watched_step_leaves_no_hook_dict_on_a_parameter_a_module_hands_back() -> None:
    torch.manual_seed(0)
    model = TakesAndReturnsParameters()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with ampdoctor.watch(model, scaler, stats_every=1, save_bundle=False) as doctor:
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=FP16):
                loss = model(torch.randn(5, 4)).float().mean() * 1e-3
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    report = doctor.report()
    assert report.verdict == "healthy"
    # the parameter a module hands back got a gradient hook for the sampled steps, and keeps no dict after them
    assert {n: p._backward_hooks for n, p in model.named_parameters() if p._backward_hooks is not None} == {}


def test_an_emptied_dict_is_taken_away_only_when_the_pass_made_it() -> None:
    from ampdoctor.capture.tensor_hooks import register_grad_hook

    bare = nn.Parameter(torch.ones(2))
    handle, _ = register_grad_hook(bare, lambda g: None)
    handle.remove()
    assert bare._backward_hooks is None

    owned = nn.Parameter(torch.ones(2))
    theirs: collections.OrderedDict[int, Any] = collections.OrderedDict()
    owned._backward_hooks = theirs  # type: ignore[assignment]
    handle, _ = register_grad_hook(owned, lambda g: None)
    handle.remove()
    assert owned._backward_hooks is theirs
