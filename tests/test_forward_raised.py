"""A module whose forward raises, caught by the model's own code (``try: fast(x) except: slow(x)``, a kernel
that is not there, an optional path): the call ends where it raised, without outputs.

Left open, the call that raised was the parent of every call after it and the module of every op after it, and
its parent's exit took the raised call's place (the parent's outputs recorded as the raised call's). Each test
failed so before, on the survey's wrappers and on its hooks alike.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.records import ModuleCall

W = 4


class NoKernel(nn.Module):
    """A fast path that is not available here: runs a layer, then raises."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lin(x)
        raise RuntimeError("no fused kernel on this device")


class HookedNoKernel(NoKernel):
    """The same, with its own hook registration: it keeps torch's public hooks (no instance wrapper)."""

    def register_forward_hook(self, *args: Any, **kwargs: Any) -> Any:
        return super().register_forward_hook(*args, **kwargs)


class Fallback(nn.Module):
    """Tries the fast path, falls back to ``slow``, then scales: the scale overflows float16 (its own op)."""

    def __init__(self, fast: nn.Module) -> None:
        super().__init__()
        self.fast = fast
        self.slow = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            y = self.fast(x)
        except RuntimeError:
            y = self.slow(x)
        return y * 1e6


class Model(nn.Module):
    def __init__(self, fast: nn.Module) -> None:
        super().__init__()
        self.block = Fallback(fast)
        self.head = nn.Linear(W, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def _calls(report: ampdoctor.Report) -> dict[str, ModuleCall]:
    return {c.module: c for c in report.trace.calls}


def _check(report: ampdoctor.Report) -> None:
    origin = report.forward_origin
    assert origin is not None and origin.module == "block"  # the multiply in Fallback's own code
    assert origin.op is not None and origin.op.op == "aten::mul.Tensor"
    calls = _calls(report)
    assert calls["block.fast"].outputs == ()  # it raised: nothing returned
    assert calls["block.fast.lin"].parent == calls["block.fast"].index
    assert calls["block.slow"].parent == calls["block"].index  # not the call that raised
    assert calls["head"].parent == calls[""].index
    (out,) = calls["block"].outputs
    assert (out.stats.posinf_count or 0) + (out.stats.neginf_count or 0) == 8 * W  # every value of 1e6 * y
    assert calls["block.fast"].end_order < calls["block.slow"].end_order < calls["block"].end_order


@pytest.mark.parametrize("fast", [NoKernel, HookedNoKernel], ids=["wrappers", "public-hooks"])
def test_a_caught_raise_ends_its_call_there(fast: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = Model(fast())
    batch = torch.randn(8, W) * 10
    _check(ampdoctor.diagnose(model, batch, device_type="cpu", progress=False, dtype=torch.float16))
    assert not any("forward" in vars(m) for m in model.modules())


def test_a_caught_raise_ends_its_call_there_under_hook_dicts() -> None:
    """A global module hook of the user's: every module keeps hooks (set in torch's dicts, always called)."""
    torch.manual_seed(0)
    model = Model(NoKernel())
    batch = torch.randn(8, W) * 10
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        _check(ampdoctor.diagnose(model, batch, device_type="cpu", progress=False, dtype=torch.float16))
    finally:
        handle.remove()
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_hooks_always_called and not m._forward_pre_hooks


class Raises(nn.Module):
    """Runs a child, then raises from its own code."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(W, W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inner(x)
        raise ValueError("shapes do not match")


def test_the_message_names_the_module_a_raise_came_from_after_a_caught_one() -> None:
    model = nn.Sequential(Fallback(NoKernel()), Raises())
    with pytest.raises(ampdoctor.ModelRaised) as caught:
        ampdoctor.diagnose(model, torch.randn(8, W), device_type="cpu", progress=False, dtype=torch.float16)
    assert "(last module that ran: '1.inner', inside '1')" in str(caught.value)
    assert not any("forward" in vars(m) for m in model.modules())


class ReturnsNothing(nn.Module):
    """A side-effect module (it logs, it collects): its forward returns None, and raises nothing."""

    def forward(self, x: torch.Tensor) -> None:
        return None


class RaisesAfterANoneChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quiet = ReturnsNothing()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.quiet(x)
        raise ValueError("shapes do not match")


@pytest.mark.parametrize("hooked", [False, True])
def test_a_child_that_returned_none_is_not_where_the_raise_came_from(hooked: bool) -> None:
    model = RaisesAfterANoneChild()
    if hooked:  # a hook of its own: the survey hooks it (always_call) instead of wrapping its forward
        model.quiet.register_forward_hook(lambda m, a, out: None)
    with pytest.raises(ampdoctor.ModelRaised) as caught:
        ampdoctor.diagnose(model, torch.randn(8, W), device_type="cpu", progress=False, dtype=torch.float16)
    assert "(last module that ran: 'quiet', inside '<root>')" in str(caught.value)


class OldStyleRegistration(NoKernel):
    """Its own ``register_forward_hook`` with torch 2.0's keywords (no ``always_call``): still diagnosed, without
    seeing where its forward raised (its post-hook is not called then)."""

    def register_forward_hook(self, hook: Any, *, prepend: bool = False, with_kwargs: bool = False) -> Any:
        return super().register_forward_hook(hook, prepend=prepend, with_kwargs=with_kwargs)


def test_a_class_registration_without_always_call_still_gets_its_hooks() -> None:
    torch.manual_seed(0)
    model = Model(OldStyleRegistration())
    report = ampdoctor.diagnose(model, torch.randn(8, W) * 10, device_type="cpu", progress=False,
                                dtype=torch.float16)
    assert report.forward_origin is not None and report.forward_origin.module in ("block", "block.fast")
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class LeafNoKernel(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no fused kernel")


def test_float32_references_survive_a_caught_raise() -> None:
    """``reference=True`` re-runs each call in float32 at its end: not a call that raised (its re-run raises again,
    which lost every comparison of the pass)."""
    torch.manual_seed(0)
    model = nn.Sequential(Healthy(LeafNoKernel()), nn.Linear(W, 2))
    report = ampdoctor.diagnose(model, torch.randn(8, W), device_type="cpu", progress=False, dtype=torch.float16,
                                reference=True)
    assert str(report.verdict) == "healthy"
    assert {c.module for c in report.trace.comparisons} == {"0.slow", "1"}


class Healthy(Fallback):
    """The fallback without its overflowing scale."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return self.fast(x)  # type: ignore[no-any-return]
        except RuntimeError:
            return self.slow(x)  # type: ignore[no-any-return]
