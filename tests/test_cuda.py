"""CUDA checks: same answers as on the CPU, and one host synchronisation per capture pass."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.capture.passes import PassSpec, run_pass
from ampdoctor.demo import DEMO_ORIGIN, demo_loss, make_demo

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_demo_on_cuda_names_the_same_origin() -> None:
    model, tokens, targets = make_demo()
    model = model.cuda()
    tokens, targets = tokens.cuda(), targets.cuda()
    report = ampdoctor.diagnose(model, tokens, loss_fn=lambda out, _: demo_loss(out, targets))
    assert report.run.device_type == "cuda" and report.run.device.startswith("cuda:")
    assert report.forward_origin is not None and report.forward_origin.module == DEMO_ORIGIN
    assert next(model.parameters()).device.type == "cuda"


def test_one_host_sync_per_survey_pass() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(8)]).cuda()
    spec = PassSpec(
        root=model,
        names={id(m): n for n, m in model.named_modules()},
        params=list(model.named_parameters()),
        batch=torch.randn(16, 64, device="cuda"),
        loss_fn=lambda out, _: out.float().pow(2).mean(),
        device_type="cuda",
        dtype=torch.float16,
        backward=True,
    )
    run_pass(spec, 1024.0)  # warm-up: allocator and kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trace, _ = run_pass(spec, 1024.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert trace.backward_ran and len(trace.calls) == 17


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_state_is_restored_on_cuda(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.Linear(8, 2)).cuda()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.cuda.get_rng_state()
    ampdoctor.diagnose(model, torch.randn(4, 8, device="cuda"), dtype=dtype)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.cuda.get_rng_state())
