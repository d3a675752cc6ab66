"""``diagnose`` under the two autocast policies: native CPU autocast, and CUDA's policy emulated on the CPU.

The models are those of ``test_policy_models`` (hand-checked against CUDA-policy variants op by op). On a model
whose CPU-policy origin is an op CUDA runs in float32, the default report says so on the origin, and the
CUDA-policy report names what CUDA would hit instead (or nothing).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_untouched, snapshot
from test_policy import _state
from test_policy_models import control, exp_overflow, long_sum, spectrogram

import ampdoctor


def _loss(out: torch.Tensor, _: object) -> torch.Tensor:
    return out.float().mean() * 1e-3


@pytest.mark.skipif(torch.cuda.is_available(), reason="the emulation is what a machine without CUDA gets")
def test_device_type_cuda_without_a_gpu_diagnoses_under_the_emulated_cuda_policy() -> None:
    model, x = spectrogram()
    before, state = snapshot(model), _state()
    native = ampdoctor.diagnose(model, x, loss_fn=_loss)
    cuda = ampdoctor.diagnose(model, x, loss_fn=_loss, device_type="cuda")
    assert _state() == state  # no emulation kernel, autocast flag or cache left behind
    assert_untouched(model, before)
    # CPU autocast: the float16 pow overflows (re = 320, re**2 = 102400), and the origin says CUDA would not.
    assert native.verdict == "overflow" and native.forward_origin is not None
    assert native.forward_origin.module == "power" and native.forward_origin.op is not None
    assert native.forward_origin.op.op.startswith("aten::pow")
    assert native.forward_origin.policy_note.startswith("on CUDA `pow` runs in float32: this overflow is specific")
    assert "note: on CUDA `pow` runs in float32" in str(native)
    assert native.to_dict()["findings"]["forward_origin"]["policy_note"] == native.forward_origin.policy_note
    # CUDA's policy runs pow in float32: nothing overflows.
    assert cuda.verdict == "healthy", str(cuda)
    assert cuda.run.policy == "cuda_emulated" and cuda.run.device_type == "cuda"
    assert "CUDA autocast policy, emulated" in str(cuda).splitlines()[1]


@pytest.mark.parametrize(
    ("build", "module", "op"), [(exp_overflow, "gate", "aten::exp"), (long_sum, "total", "aten::sum")]
)
def test_policy_cuda_removes_an_origin_that_only_cpu_autocast_has(  # type: ignore[no-untyped-def]
    build, module: str, op: str
) -> None:
    model, x = build()
    native = ampdoctor.diagnose(model, x, loss_fn=_loss, device_type="cpu", verify=False)
    cuda = ampdoctor.diagnose(model, x, loss_fn=_loss, device_type="cpu", policy="cuda", verify=False)
    origin = native.forward_origin
    assert native.verdict == "overflow" and origin is not None and (origin.module, origin.op.op) == (module, op)
    name = op.removeprefix("aten::")
    assert origin.policy_note.startswith(f"on CUDA `{name}` runs in float32")
    assert cuda.verdict == "healthy" and cuda.forward_origin is None and cuda.backward_origin is None


def test_a_control_where_both_policies_agree() -> None:
    model, x = control()
    native = ampdoctor.diagnose(model, x, loss_fn=_loss, device_type="cpu", verify=False)
    cuda = ampdoctor.diagnose(model, x, loss_fn=_loss, policy="cuda", verify=False)
    for report in (native, cuda):
        origin = report.forward_origin
        assert report.verdict == "overflow" and origin is not None
        assert (origin.module, origin.op.op, origin.policy_note) == ("clf.fc2", "aten::addmm", "")


def test_a_bias_gradient_overflow_is_not_called_specific_to_the_cpu_policy() -> None:
    # The bias gradient of Linear is a sum inside AddmmBackward0: addmm runs in float16 on CUDA too.
    model = torch.nn.Linear(4, 1)
    x = torch.full((4, 4), 0.1)
    report = ampdoctor.diagnose(model, x, loss_fn=lambda o, _: o.float().sum() * 0.25, device_type="cpu")
    origin = report.backward_origin
    assert origin is not None and origin.op is not None and origin.op.node == "AddmmBackward0"
    assert origin.policy_note == ""
