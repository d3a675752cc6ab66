"""Memory between the passes of a failing diagnosis (issue 18: <= 1.25x a plain step's peak): each pass starts with
the host heap's free pages handed back, and no pass's tensors outlive it."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from test_api import constant_linear
from torch import nn

import ampdoctor
from ampdoctor.capture import session as session_module
from ampdoctor.capture.memory import trim_host_heap


def _overflowing() -> nn.Sequential:
    model = nn.Sequential()
    model.add_module("pre", constant_linear(16, 16, 1 / 16))
    model.add_module("boom", constant_linear(16, 16, 5000.0))  # 16 * 5000 = 80000 > 65504 in float16
    return model


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_host_heap_works_with_glibc() -> None:
    assert trim_host_heap() is True


def test_every_pass_starts_with_the_heap_trimmed(monkeypatch: pytest.MonkeyPatch) -> None:
    trims: list[int] = []
    monkeypatch.setattr(session_module, "trim_host_heap", lambda: trims.append(1) or True)
    report = ampdoctor.diagnose(_overflowing(), torch.ones(2, 16), device_type="cpu")
    ran = [p for p in report.run.passes if p.status == "ran"]
    assert len(ran) >= 3  # survey, detail and op zoom, verification
    assert len(trims) == len(ran)


def _purposes_of(monkeypatch: pytest.MonkeyPatch, name: str) -> tuple[list[str], Any]:
    """Each call of ``session.<name>`` noted with the purpose of the pass running it; the progress callback that
    tells the purposes."""
    seen: list[str] = []
    now = [""]
    real = getattr(session_module, name)

    def noted(*args: Any) -> Any:
        seen.append(now[0])
        return real(*args)

    monkeypatch.setattr(session_module, name, noted)
    return seen, lambda purpose, index, total: now.__setitem__(0, purpose)


def test_a_pass_without_backward_keeps_no_tensor_for_one(monkeypatch: pytest.MonkeyPatch) -> None:
    dropped, progress = _purposes_of(monkeypatch, "_dropped")
    report = ampdoctor.diagnose(_overflowing(), torch.ones(2, 16), device_type="cpu", progress=progress)
    assert report.forward_origin is not None and report.forward_origin.module == "boom"
    assert [(p.purpose, p.status) for p in report.run.passes if p.purpose == "CUDA-policy check"] == [
        ("CUDA-policy check", "ran")
    ]
    # Linear saves its input and weight for the backward, twice over two Linears: none kept, in that pass only.
    assert dropped and set(dropped) == {"CUDA-policy check"}


class SelfGradient(nn.Module):
    """A forward that runs a backward of its own (a gradient penalty, a physics-informed term)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x.detach().float().requires_grad_(True)
        (grad,) = torch.autograd.grad(self.lin(z).pow(2).sum(), z)
        return x + 0 * grad.to(x.dtype)


def test_a_forward_with_its_own_backward_runs_again_keeping_them(monkeypatch: pytest.MonkeyPatch) -> None:
    needed, progress = _purposes_of(monkeypatch, "_never_unpacked")
    model = nn.Sequential()
    model.add_module("pre", constant_linear(16, 16, 1 / 16))
    model.add_module("own", SelfGradient())
    model.add_module("boom", constant_linear(16, 16, 5000.0))
    report = ampdoctor.diagnose(model, torch.ones(2, 16), device_type="cpu", progress=progress)
    assert report.forward_origin is not None and report.forward_origin.module == "boom"
    assert needed and set(needed) == {"CUDA-policy check"}  # it needed them there, and got them on the re-run
    assert all(p.status == "ran" for p in report.run.passes)
