"""The fast hook registrations (hooks set straight into torch's own dicts) are used only where a one-time check
shows such hooks fire; elsewhere every hook goes through torch's public registration, with the same records."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampdoctor
import ampdoctor.capture.tensor_hooks as tensor_hooks


def test_the_check_passes_on_this_torch_and_leaves_no_trace() -> None:
    tensor_hooks._works = None
    grad_enabled = torch.is_grad_enabled()
    assert tensor_hooks.hook_dicts_work() is True
    assert torch.is_grad_enabled() == grad_enabled
    t = torch.ones(3, requires_grad=True)
    entry = tensor_hooks.hang_tensor_hook(t, lambda g: None)
    assert entry is not None and entry[1] in t._backward_hooks  # type: ignore[operator]


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        model[2].weight.mul_(4000.0)  # its output overflows float16
    return model


@pytest.mark.parametrize("works", [True, False])
@pytest.mark.parametrize("wrappers", [True, False], ids=["wrappers", "no-wrappers"])
def test_a_failed_check_falls_back_to_the_public_registration(
    works: bool, wrappers: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hook-dict check decides between torch's dicts and the public registration; the forward-wrapper check
    (call_wrappers) decides whether hook-free modules get wrappers instead of forward hooks at all."""
    import ampdoctor.capture.call_wrappers as call_wrappers
    import ampdoctor.capture.hooks as capture_hooks

    registered: list[str] = []
    real_tensor, real_post = torch.Tensor.register_hook, nn.Module.register_forward_hook

    def count_tensor(self: torch.Tensor, hook: object) -> object:
        registered.append("tensor")
        return real_tensor(self, hook)

    def count_post(self: nn.Module, *a: object, **k: object) -> object:
        # the pass's own, on a module as the user made it (a verified fix's hooks or forward patch keep hooks there)
        plain = not self._forward_hooks and "forward" not in vars(self)
        if isinstance(getattr(a[0], "__self__", None), capture_hooks.Recorder) and plain:
            registered.append(type(self).__name__)
        return real_post(self, *a, **k)

    monkeypatch.setattr(tensor_hooks, "_works", works)
    monkeypatch.setattr(call_wrappers, "_works", wrappers)
    # the public registrations, counted; the identity checks (a wrapped registration is asked) see them as torch's
    monkeypatch.setattr(torch.Tensor, "register_hook", count_tensor)
    monkeypatch.setattr(tensor_hooks, "_REGISTER_HOOK", count_tensor)
    monkeypatch.setattr(nn.Module, "register_forward_hook", count_post)
    monkeypatch.setattr(capture_hooks, "_REGISTER_POST", count_post)
    report = ampdoctor.diagnose(_model(), torch.randn(3, 4) * 100, loss_fn=lambda out, b: out.float().sum(),
                                dtype=torch.float16)
    assert str(report.verdict) == "overflow"
    assert report.forward_origin is not None and report.forward_origin.module == "2"
    if works or wrappers:
        assert "Linear" not in registered  # in torch's dicts, or a forward wrapper instead
    else:
        assert {"Sequential", "Linear", "ReLU"} <= set(registered)
    if works:
        assert registered.count("tensor") < 4  # parameters and outputs: in the dicts
    else:
        assert registered.count("tensor") >= 4
