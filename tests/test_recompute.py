"""Verification re-runs that hold less (issue 18's memory goal): under ``fixes.recompute.Recomputed`` a named module's
call keeps no tensor for the backward, which re-runs the call for them; the gradients are exactly those of the plain
run, and a re-run that does not repeat the call raises instead of handing back wrong tensors. The op-level upcast's
verification uses it. Real CPU float16 autocast throughout."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import assert_untouched, snapshot
from test_api import constant_linear
from test_upcast import Clamped, SelfAttention, Sensors, _loss, _readings
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import ampdoctor
from ampdoctor.fixes import recompute as recompute_module
from ampdoctor.fixes import verify, verify_upcast
from ampdoctor.fixes.recompute import Recomputed, RecomputeMismatch
from ampdoctor.fixes.upcast import Fp32Op


class Kept(nn.Module):
    """Keeps a weak reference to the memory of a tensor that only the autograd graph holds (sigmoid saves its
    result)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.inner: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.lin(x))
        self.inner = StorageWeakRef(h.untyped_storage())
        return (h * 3).sum(-1)


def _grads(model: nn.Module, run: Any) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _loss(run()).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_a_recomputed_call_keeps_no_saved_tensor_until_the_backward() -> None:
    torch.manual_seed(0)
    model, x = Kept(8), torch.randn(4, 8)
    out = model(x)
    assert not model.inner.expired()  # the plain graph holds sigmoid's result
    del out
    assert model.inner.expired()
    with Recomputed(model, [""]) as held:
        out = model(x)
        assert model.inner.expired()  # nothing held it: the backward re-runs the call for it
        assert (held.calls, held.reruns) == (1, 0)
        _loss(out).backward()
        assert held.reruns == 1


def test_gradients_are_exactly_those_of_the_plain_run_with_dropout_and_autocast() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.3), nn.GELU(), nn.Linear(32, 4)).train()
    x = torch.randn(8, 16)

    def step() -> torch.Tensor:
        torch.manual_seed(1)  # the same dropout mask for both runs; the re-run draws it again
        with torch.autocast("cpu", dtype=torch.float16):
            return model(x)

    plain = _grads(model, step)
    forward_before = model.forward
    with Recomputed(model, ["1", "2", "3"]) as held:  # three calls; Dropout's draw is re-run with its RNG state
        recomputed = _grads(model, step)
        assert held.calls == 3 and held.reruns == 3
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed))
    assert all("forward" not in m.__dict__ for m in model.modules()) and model.forward == forward_before


def test_the_upcast_op_is_upcast_again_in_the_rerun_and_counted_once() -> None:
    torch.manual_seed(0)
    model, x = Sensors(Clamped), _readings()
    names = ["blocks.0.attn", "blocks.1.attn"]

    def run(recompute: bool) -> tuple[list[torch.Tensor], tuple[int, int, int], int]:
        with Fp32Op(model, names, "matmul", 0) as helper:
            held = Recomputed(model, names, helper.replay) if recompute else Recomputed(model, [])

            def step() -> torch.Tensor:
                with torch.autocast("cpu", dtype=torch.float16):
                    return model(x)

            with held:
                grads = _grads(model, step)
            return grads, (helper.calls, helper.hits, helper.misses), held.reruns

    plain, counts, _ = run(False)
    recomputed, recounts, reruns = run(True)
    assert counts == recounts == (2, 2, 0)  # the re-runs are not counted as calls or hits
    assert reruns == 2
    assert all(torch.isfinite(g).all() for g in recomputed)
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed))


class Alternating(nn.Module):
    """Takes another path on every call (a Python-side counter): its re-run does not repeat it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.n = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        h = self.lin(x)
        return torch.sigmoid(h) if self.n % 2 else h * 2


def test_a_rerun_that_does_not_repeat_the_call_raises() -> None:
    model, x = Alternating(), torch.randn(2, 8)
    with Recomputed(model, [""]), pytest.raises(RecomputeMismatch, match="saved"):
        model(x).sum().backward()


def test_an_input_written_in_place_after_the_call_raises() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Sigmoid())
    x = torch.randn(2, 8) + 0  # not a leaf: may be written in place
    x.requires_grad_(False)
    with Recomputed(model, ["1"]):
        h = model[0](x)
        out = model[1](h)
        h.detach().add_(1.0)  # the call's input changes behind autograd's back
        with pytest.raises(RecomputeMismatch, match="written in place"):
            out.sum().backward()


def test_diagnose_verifies_the_op_upcast_with_recomputed_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Recomputed] = []

    class Recording(Recomputed):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(verify_upcast, "Recomputed", Recording)
    torch.manual_seed(0)
    model, x = Sensors(SelfAttention), _readings()
    report = ampdoctor.diagnose(model, x, loss_fn=_loss, device_type="cpu")
    rec = next(r for r in report.recommendations if r.rule == "fp32_op")
    assert rec.verified, rec.evidence
    runs = 2 if "but is finite at 1" in rec.evidence else 1  # the re-run at the scale, and at 1 when it overflows
    assert made and (made[-1].calls, made[-1].reruns) == (runs * len(rec.modules),) * 2
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_a_rerun_mismatch_falls_back_to_the_plain_rerun(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: Any) -> None:
        raise RecomputeMismatch("injected")

    monkeypatch.setattr(recompute_module._Call, "_remake", broken)
    torch.manual_seed(0)
    model, x = Sensors(SelfAttention), _readings()
    report = ampdoctor.diagnose(model, x, loss_fn=_loss, device_type="cpu")
    rec = next(r for r in report.recommendations if r.rule == "fp32_op")
    assert rec.verified and "2 module call(s), 2 op(s) upcast" in rec.evidence
    failed = [p for p in report.run.passes if p.status == "failed"]
    assert failed and all("injected" in p.reason for p in failed)


def _boom() -> nn.Sequential:
    model = nn.Sequential()
    model.add_module("pre", constant_linear(16, 16, 1 / 16))
    model.add_module("boom", constant_linear(16, 16, 5000.0))  # 16 * 5000 = 80000 > 65504 in float16
    return model


@pytest.mark.parametrize("broken", [False, True])
def test_the_float32_fallback_is_verified_with_recomputed_calls(monkeypatch: pytest.MonkeyPatch, broken: bool) -> None:
    made: list[Recomputed] = []

    class Recording(Recomputed):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    def injected(self: Any) -> None:
        raise RecomputeMismatch("injected")

    monkeypatch.setattr(verify, "Recomputed", Recording)
    if broken:
        monkeypatch.setattr(recompute_module._Call, "_remake", injected)
    model = _boom()
    before = snapshot(model)
    report = ampdoctor.diagnose(model, torch.ones(2, 16), device_type="cpu")
    assert_untouched(model, before)
    rec = next(r for r in report.recommendations if r.action == "fp32_fallback")
    assert rec.verified and rec.modules == ("boom",), rec.evidence
    first = made[0]
    assert first.calls >= 1 and first.reruns == (0 if broken else first.calls)
    if broken:  # the re-run that raised is in the log; the plain re-run after it proved the fallback
        assert made[1].calls == 0 and any("injected" in p.reason for p in report.run.passes if p.status == "failed")
    else:
        assert all(p.status == "ran" for p in report.run.passes)


def test_where_saved_tensor_hooks_are_disabled_the_call_runs_as_it_is() -> None:
    torch.manual_seed(0)
    model, x = Kept(8), torch.randn(4, 8)
    with Recomputed(model, [""]) as held, torch.autograd.graph.disable_saved_tensors_hooks("a wrapper's own"):
        out = model(x)
        assert not model.inner.expired()  # kept by the graph, as without Recomputed
        _loss(out).backward()
    assert (held.calls, held.reruns) == (0, 0)


def test_a_named_module_inside_another_is_recomputed_with_it() -> None:
    torch.manual_seed(0)
    model, x = Sensors(Clamped), _readings()
    names = ["blocks.0", "blocks.0.attn", "blocks.1.attn"]
    with Fp32Op(model, names, "matmul", 0) as helper, Recomputed(model, names, helper.replay) as held:
        patched = {n for n, m in model.named_modules() if "forward" in m.__dict__}
        assert patched == {"blocks.0", "blocks.1.attn"}
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        _loss(out).backward()
        assert (held.calls, held.reruns) == (2, 2)
        assert (helper.calls, helper.hits, helper.misses) == (3, 2, 1)  # blocks.0's own code has no matmul
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_a_reentrant_checkpoint_of_a_function_without_modules_is_diagnosed() -> None:
    """``checkpoint(lambda t: ..., h, use_reentrant=True)``: no module call runs under no_grad, but the forward
    switched grad off, and torch.autograd.grad would refuse the graph; the backward goes through .backward()."""
    from torch.utils.checkpoint import checkpoint

    class Lambda(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(checkpoint(lambda t: torch.relu(t) * 2, self.a(x), use_reentrant=True))

    torch.manual_seed(0)
    model = Lambda()
    report = ampdoctor.diagnose(model, torch.randn(4, 8), loss_fn=lambda o, _: o.float().mean() * 1e-3,
                                dtype=torch.float16, progress=False)
    assert report.verdict == "healthy" and report.trace.backward_ran
    assert all(p.grad is None for p in model.parameters())
