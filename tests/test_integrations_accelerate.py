"""``ampdoctor.watch`` in an Accelerate loop (``Accelerator(mixed_precision=...)``) on CPU (issue 14, item 6).

Accelerate needs no adapter: the watch takes ``accelerator.scaler``. On CPU, ``mixed_precision="fp16"`` leaves
AMP off (float16 AMP needs a GPU there; ``accelerator.scaler`` is None), so this runs ``"bf16"``: accelerate then
wraps the model's forward in bfloat16 autocast, and with no scaler the loop closes each step with
``doctor.step()`` before ``optimizer.step()``. The model goes non-finite by construction: a log of zero.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import ampdoctor

accelerate = pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow

BAD_STEP = 2


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def log_net() -> nn.Sequential:
    """log -> mix -> head: log(0) = -inf, and mix (weights of both signs) makes NaN of it."""
    mix = nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        mix.weight.copy_(torch.tensor([[1.0, -1.0, 0.5, 0.5]] * 4))
    model = nn.Sequential()
    model.add_module("log", Log())
    model.add_module("mix", mix)
    model.add_module("head", nn.Linear(4, 1))
    return model


@pytest.fixture
def fresh_accelerate() -> Iterator[None]:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_accelerate_bf16_loop_names_the_log_of_zero(fresh_accelerate: Any) -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    net = log_net()
    model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.0))
    batches = [torch.rand(4, 4, generator=torch.Generator().manual_seed(i)) + 0.5 for i in range(5)]
    batches[BAD_STEP][1] = 0.0

    # the README's Accelerate example, in bfloat16 (no scaler: doctor.step() before opt.step())
    with ampdoctor.watch(model, accelerator.scaler, save_bundle=False) as doctor:  # scaler: None in bfloat16
        for x in batches:
            opt.zero_grad()
            with accelerator.autocast():
                loss = model(x).float().pow(2).mean()
            accelerator.backward(loss)
            doctor.step()  # no GradScaler: close the step before the optimizer changes the weights
            opt.step()
    report = doctor.report()

    assert accelerator.scaler is None and report.run.limits.dtype == "bfloat16"
    steps = report.steps
    # nothing skips the NaN gradients in bfloat16: the weights are NaN after the bad step (even at lr 0: 0 * NaN)
    assert [s.forward_finite for s in steps] == [True, True, False, False, False]
    assert steps[BAD_STEP].captured and steps[BAD_STEP].run == "persistent"
    assert report.verdict == "nan"
    assert report.forward_origin is not None and report.forward_origin.module == "log"
    assert report.forward_origin.op is not None and report.forward_origin.op.op == "aten::log"


def test_verify_steps_unwraps_an_accelerated_optimizer() -> None:
    """accelerate's AcceleratedOptimizer around the user's optimizer: verify_steps rebuilds the torch optimizer
    inside it (SGD trains the copy), and refuses one whose step needs a closure (LBFGS) up front."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight.fill_(3e4)  # an overflow: remedies to train
    lbfgs = accelerator.prepare(torch.optim.LBFGS(model.parameters()))
    with pytest.raises(ampdoctor.InvalidInput, match="LBFGS"):
        ampdoctor.diagnose(model, torch.ones(3, 4), optimizer=lbfgs, verify_steps=2, progress=False)
    sgd = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.01))
    report = ampdoctor.diagnose(model, torch.ones(3, 4), optimizer=sgd, verify_steps=2, progress=False)
    trained = [r.evidence for r in report.recommendations if "steps on the batch with it" in (r.evidence or "")]
    assert trained and all("(SGD(lr=0.01)," in e for e in trained)
