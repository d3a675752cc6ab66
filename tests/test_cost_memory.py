"""Memory (issue 13): an optional pass that would not fit is skipped before it runs, out of memory in the first pass
is one clear error, parameter gradients are not kept, and progress is shown one line per pass."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from helpers import assert_untouched, snapshot
from test_api import constant_linear
from torch import nn

import ampdoctor
from ampdoctor.capture.memory import is_out_of_memory, pass_estimate
from ampdoctor.capture.passes import PassSpec, run_pass
from ampdoctor.errors import ModelRaised, OutOfMemory


def _overflowing() -> nn.Sequential:
    # 16 * 5000 = 80000 > 65504: boom's own matmul overflows in float16.
    model = nn.Sequential()
    model.add_module("pre", constant_linear(16, 16, 1 / 16))
    model.add_module("boom", constant_linear(16, 16, 5000.0))
    return model


def test_optional_passes_over_the_memory_limit_are_skipped_and_said() -> None:
    model = _overflowing()
    before = snapshot(model)
    report = ampdoctor.diagnose(model, torch.ones(2, 16), device_type="cpu", memory_limit=1)
    assert_untouched(model, before)
    statuses = [(p.purpose, p.status) for p in report.run.passes]
    assert statuses[0] == ("survey", "ran")  # the survey always runs: nothing is estimated before it
    assert statuses[1:] and all(status == "skipped" for _, status in statuses[1:])
    assert all(p.reason.endswith("exceeds the memory limit 1 B") for p in report.run.passes[1:])  # (read "0 KiB")
    # The report stands on the survey: origin found, no op zoom, no verified recommendation.
    assert report.verdict == "overflow" and report.forward_origin is not None
    assert report.forward_origin.module == "boom" and not report.trace.detailed
    assert not any(r.verified for r in report.recommendations)
    assert any("skipped to stay within the memory limit" in n for n in report.run.notes)


def test_a_limit_that_fits_the_estimate_runs_everything() -> None:
    model = _overflowing()
    report = ampdoctor.diagnose(model, torch.ones(2, 16), device_type="cpu", memory_limit=2**30)
    assert all(p.status == "ran" for p in report.run.passes) and report.trace.detailed


def test_pass_estimate_counts_each_recorded_tensor_once() -> None:
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    spec = PassSpec(
        root=model, names={id(m): n for n, m in model.named_modules()}, params=list(model.named_parameters()),
        batch=torch.ones(2, 8), loss_fn=None, device_type="cpu", dtype=torch.float16, backward=True,
    )
    survey, _ = run_pass(spec, 1.0)
    # Recorded tensors: batch 2x8 float32 (64 B), Linear out 2x32 float16 (128 B), ReLU out 2x32 (128 B: a new
    # tensor), last out 2x4 float16 (16 B): 336 B; the two largest (128 + 128) twice more in flight: 512 B.
    assert pass_estimate(survey, "survey") == 336 + 512
    assert pass_estimate(survey, "backward") == 512
    # float32: the float16 tensors at 4 bytes: 64 + 256 + 256 + 32 = 608, in flight 2 * (256 + 256)
    assert pass_estimate(survey, "float32") == 608 + 1024


class _AllocatorFails(nn.Module):
    """Raises what the CPU allocator raises when it cannot allocate."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 1099511627776 bytes")


def test_out_of_memory_in_the_first_pass_is_one_clear_error() -> None:
    model = _AllocatorFails()
    before = snapshot(model)
    with pytest.raises(OutOfMemory, match="smaller batch.*backward=False.*fewer passes") as caught:
        ampdoctor.diagnose(model, torch.ones(2, 4), device_type="cpu")
    assert isinstance(caught.value, ampdoctor.AmpDoctorError)
    assert isinstance(caught.value.__cause__, ModelRaised)  # the model's own error stays chained
    assert_untouched(model, before)


def test_injected_cuda_style_out_of_memory_in_the_survey(monkeypatch: pytest.MonkeyPatch) -> None:
    import ampdoctor.capture.session as api

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(api, "run_pass", failing)
    model = _overflowing()
    before = snapshot(model)
    with pytest.raises(OutOfMemory, match="ran out of memory .*OutOfMemoryError: CUDA out of memory"):
        ampdoctor.diagnose(model, torch.ones(2, 16), device_type="cpu")
    assert_untouched(model, before)


def test_is_out_of_memory() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("x"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory"))
    chained = ModelRaised("the model's forward raised", "forward")
    chained.__cause__ = MemoryError("not enough memory")
    assert is_out_of_memory(chained)
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def test_parameter_gradients_are_not_kept_by_a_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    # What autograd.grad hands back for the parameters: zero-stride stand-ins, not the gradients (measured in
    # the hooks, then freed), so a pass never holds the whole model's gradients the way a training step does.
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    spec = PassSpec(
        root=model, names={id(m): n for n, m in model.named_modules()}, params=list(model.named_parameters()),
        batch=torch.ones(4, 64), loss_fn=None, device_type="cpu", dtype=torch.float16, backward=True,
    )
    returned: list[tuple[torch.Tensor, ...]] = []
    real_grad = torch.autograd.grad

    def grad(*args: Any, **kwargs: Any) -> Any:
        out = real_grad(*args, **kwargs)
        returned.append(out)
        return out

    monkeypatch.setattr(torch.autograd, "grad", grad)
    trace, _ = run_pass(spec, 1024.0)
    assert returned and all(g.stride() == (0,) * g.dim() and not g.any() for g in returned[0])
    monkeypatch.undo()
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(torch.ones(4, 64))
    (expected,) = torch.autograd.grad(out.float().mean() * 1024.0, [model[0].weight])
    weight = trace.param_grads()["0.weight"]  # measured for real
    assert weight.nonzero_count == int((expected != 0).sum()) > 0
    assert weight.max == float(expected.max()) / 1024.0


def _progress_model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(4, 8)


def test_progress_callback_once_per_pass_with_its_purpose() -> None:
    model, x = _progress_model()
    seen: list[tuple[str, int, Optional[int]]] = []
    report = ampdoctor.diagnose(model, x, device_type="cpu", progress=lambda *a: seen.append(a))
    assert [(purpose, index) for purpose, index, _ in seen] == [
        (p.purpose, i) for i, p in enumerate(report.run.passes)
    ]


def test_progress_is_silent_in_captured_output_and_shown_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    model, x = _progress_model()
    ampdoctor.diagnose(model, x, device_type="cpu")
    assert capsys.readouterr().err == ""  # stderr is not a terminal here
    report = ampdoctor.diagnose(model, x, device_type="cpu", progress=True)
    err = capsys.readouterr().err
    assert "pass 1: survey" in err and f"pass {len(report.run.passes)}: {report.run.passes[-1].purpose}" in err
