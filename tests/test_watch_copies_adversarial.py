"""Copies of a watched model that carried the watch, and the watch changing what the user set (found by review;
each test failed before the fix): a whole ``torch.fx`` GraphModule pickled while watched (its ``__reduce__`` copies
``__dict__`` past ``__getstate__``), a module whose class changes while tapped (parametrized, or its parametrization
removed), a forward the model keeps, and a user's ``functools.update_wrapper`` forward set over the watch's (it
copies the wrapper's attributes, the watch's mark included). Not covered, and documented: a class whose own
``__copy__`` copies ``__dict__`` as it is (an instance attribute cannot tell which module it was read from)."""

from __future__ import annotations

import copy
import functools
import io

import torch
from test_watch_forwards import step
from torch import nn

import ampdoctor


def setup(model: nn.Module) -> tuple[torch.amp.GradScaler, torch.optim.Optimizer]:
    return torch.amp.GradScaler("cpu", init_scale=2.0**8), torch.optim.SGD(model.parameters(), lr=0.5)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):  # type: ignore[no-untyped-def]  # no string annotations: fx pickles its code's globals
        return self.b(torch.relu(self.a(x)))


def test_torch_save_of_an_fx_traced_model_while_watched() -> None:
    # GraphModule.__reduce__ pickles a copy of __dict__, past the instance __getstate__: the watch's guard and the
    # root's hooks go with it. Unwatched, torch.save works.
    import torch.fx

    torch.manual_seed(0)
    model = torch.fx.symbolic_trace(_Net())
    scaler, opt = setup(model)
    with ampdoctor.watch(model, scaler, stats_every=1, save_bundle=False):
        step(model, scaler, opt, 0)
        torch.save(model, io.BytesIO())  # AttributeError: Can't pickle local object 'RootTap.__init__.<locals>...'


def test_a_deep_copy_after_remove_parametrizations_while_watched() -> None:
    from torch.nn.utils import parametrizations, parametrize

    torch.manual_seed(0)
    model = nn.Sequential(parametrizations.weight_norm(nn.Linear(8, 8)), nn.ReLU(), nn.Linear(8, 3))
    scaler, opt = setup(model)
    with ampdoctor.watch(model, scaler, stats_every=1, save_bundle=False):
        step(model, scaler, opt, 0)
        parametrize.remove_parametrizations(model[0], "weight")  # the class is nn.Linear again
        copy.deepcopy(model)  # AttributeError: type object 'Linear' has no attribute '__deepcopy__' (the watch's)


def test_a_module_parametrized_while_watched_is_copied_with_its_own_weights() -> None:
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    scaler, opt = setup(model)
    x = torch.randn(4, 8)
    with ampdoctor.watch(model, scaler, stats_every=1, save_bundle=False):
        step(model, scaler, opt, 0)
        parametrizations.weight_norm(model[0])  # its class gets parametrize's __deepcopy__ (copies __dict__ as is)
        ema = copy.deepcopy(model)
        assert "forward" not in vars(ema[0])
    with torch.no_grad():
        model[0].parametrizations.weight.original1.mul_(2.0)  # the original's weights move
        assert torch.allclose(ema[0](x), nn.functional.linear(x, ema[0].weight, ema[0].bias))


class _Keeps(nn.Module):
    """Keeps a child's forward on its first call (as the survey pass's wrappers were tested against)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 3)
        self.impl = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl is None:
            self.impl = self.a.forward  # a bound method unwatched: a deep copy rebinds it to the copy's child
        return self.b(torch.relu(self.impl(x)))


def test_a_forward_the_model_keeps_does_not_tie_its_copies_to_the_original() -> None:
    torch.manual_seed(0)
    model = _Keeps()
    scaler, opt = setup(model)
    x = torch.randn(4, 8)
    with ampdoctor.watch(model, scaler, stats_every=1, save_bundle=False):
        step(model, scaler, opt, 0)
    ema = copy.deepcopy(model)  # even after the watch closed
    with torch.no_grad():
        model.a.weight.mul_(2.0)
        expected = ema.b(torch.relu(nn.functional.linear(x, ema.a.weight, ema.a.bias)))
        assert torch.allclose(ema(x), expected)  # the kept wrapper calls the original's a.forward


def _users_wrapper(module: nn.Module) -> None:
    """accelerate's add_hook_to_module: functools.update_wrapper copies the wrapped forward's __dict__."""
    old = module.forward
    module._old_forward = old

    def new_forward(m: nn.Module, *args: object) -> torch.Tensor:
        return m._old_forward(*args) + 1.0

    module.forward = functools.update_wrapper(functools.partial(new_forward, module), old)


def test_a_users_forward_set_while_watched_stays_after_the_watch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    scaler, opt = setup(model)
    with ampdoctor.watch(model, scaler, stats_every=2, save_bundle=False):
        step(model, scaler, opt, 0)
        _users_wrapper(model[2])  # over the watch's wrapper: it copies the wrapper's mark
        users = model[2].forward
        for i in range(1, 4):
            step(model, scaler, opt, i)
    assert model[2].__dict__.get("forward") is users  # deleted as if it were the watch's


def test_a_users_forward_set_while_watched_goes_into_a_copy() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    scaler, opt = setup(model)
    with ampdoctor.watch(model, scaler, stats_every=1, save_bundle=False):
        step(model, scaler, opt, 0)
        _users_wrapper(model[2])
        ema = copy.deepcopy(model)
    assert "forward" in vars(ema[2])  # the copy lost the user's forward (taken for the watch's)
