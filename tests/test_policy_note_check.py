"""The CPU-policy note of an origin is decided by a re-run under CUDA's policy (emulated), not by the op's name."""

from __future__ import annotations

import torch
from test_policy_models import control, exp_overflow

import ampdoctor


def _loss(out: torch.Tensor, _: object) -> torch.Tensor:
    return out.float().mean() * 1e-3


def _check_passes(report: ampdoctor.Report) -> list[tuple[str, str]]:
    return [(p.purpose, p.status) for p in report.run.passes if p.purpose == "CUDA-policy check"]


def test_an_origin_cuda_does_not_have_gets_the_note_with_what_the_re_run_showed() -> None:
    model, x = exp_overflow()
    report = ampdoctor.diagnose(model, x, loss_fn=_loss, device_type="cpu", verify=False)
    origin = report.forward_origin
    assert origin is not None and origin.module == "gate"
    assert origin.policy_note == (
        "on CUDA `exp` runs in float32: this overflow is specific to the CPU policy; under the CUDA policy "
        "(emulated) the step makes no forward inf or NaN"
    )
    assert _check_passes(report) == [("CUDA-policy check", "ran")]


def test_an_origin_both_policies_share_gets_no_note_and_the_same_answer_under_cuda() -> None:
    model, x = control()
    report = ampdoctor.diagnose(model, x, loss_fn=_loss, device_type="cpu", verify=False)
    assert report.forward_origin is not None and report.forward_origin.policy_note == ""
    assert _check_passes(report) == [("CUDA-policy check", "ran")]


def test_the_cuda_policy_itself_runs_no_check() -> None:
    model, x = exp_overflow()
    report = ampdoctor.diagnose(model, x, loss_fn=_loss, policy="cuda", verify=False)
    assert _check_passes(report) == []


def test_a_healthy_step_runs_no_check() -> None:
    model = torch.nn.Linear(4, 2)
    report = ampdoctor.diagnose(model, torch.ones(3, 4), loss_fn=_loss, device_type="cpu", verify=False)
    assert report.verdict == "healthy" and _check_passes(report) == []
