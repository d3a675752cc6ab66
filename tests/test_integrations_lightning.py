"""The Lightning callback in real ``lightning.Trainer.fit`` runs on CPU (issue 14, item 6).

On CPU, Lightning turns ``precision="16-mixed"`` into bfloat16 (it says float16 AMP needs CUDA), so the first run
uses ``"bf16-mixed"``; bfloat16 rarely overflows, so that model goes non-finite by construction: a log of zero
(``-inf``), mixed by the next layer into NaN. Lightning's own ``MixedPrecision("16-mixed", "cpu")`` plugin does run
float16 with a GradScaler on CPU: the second run uses it on a layer that overflows.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ampdoctor.integrations import lightning_callback

L = pytest.importorskip("lightning")
pytestmark = pytest.mark.slow

BAD_BATCH = 3  # the batch index whose inputs make the model go non-finite
BATCHES = 6


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class Net(L.LightningModule):  # type: ignore[misc, name-defined]
    """log -> mix -> head: log(0) = -inf; mix has weights of both signs, so -inf - inf = NaN."""

    def __init__(self, layers: OrderedDict[str, nn.Module], loss_factor: float = 1e-3) -> None:
        super().__init__()
        self.net = nn.Sequential(layers)
        self.loss_factor = loss_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self(x).float().pow(2).mean() * self.loss_factor

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def log_net() -> Net:
    mix = nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        mix.weight.copy_(torch.tensor([[1.0, -1.0, 0.5, 0.5]] * 4))
    return Net(OrderedDict(log=Log(), mix=mix, head=nn.Linear(4, 1)))


def boom_net() -> Net:
    """boom multiplies by 4 * 5000: +inf in float16 once the inputs exceed 3.3. The loss is small enough that no
    gradient overflows at 65536 on the good batches (head's weight gradient: 4 * 2 * 0.08 / 4 * 1e-4 * 20000 = 0.3,
    times the scale: 21000)."""
    boom = nn.Linear(4, 4, bias=False)
    head = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        boom.weight.fill_(5000.0)
        head.weight.fill_(1e-6)
    return Net(OrderedDict(boom=boom, head=head), loss_factor=1e-4)


def data(bad: torch.Tensor) -> DataLoader[Any]:
    x = torch.rand(BATCHES * 4, 4, generator=torch.Generator().manual_seed(0)) + 0.5
    x[BAD_BATCH * 4 : BAD_BATCH * 4 + 4] = bad
    return DataLoader(TensorDataset(x), batch_size=4, shuffle=False)


def fit(model: Net, loader: DataLoader[Any], tmp_path: Path, **trainer_kwargs: Any) -> Any:
    callback = lightning_callback(save_bundle=False)
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, callbacks=[callback], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path), **trainer_kwargs,
    )
    trainer.fit(model, loader)
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
        assert "forward" not in m.__dict__ and "__getstate__" not in m.__dict__
    return callback.report


def test_lightning_bf16_mixed_fit_names_the_log_of_zero(tmp_path: Path) -> None:
    report = fit(log_net(), data(torch.zeros(4, 4)), tmp_path, precision="bf16-mixed")
    assert report.run.limits.dtype == "bfloat16"
    steps = report.steps
    assert [s.step for s in steps] == list(range(BATCHES))  # closed by the callback before each optimizer step
    # no scaler skips the NaN gradients in bfloat16: the weights are NaN from then on (even at lr 0: 0 * NaN)
    assert [s.forward_finite for s in steps] == [i < BAD_BATCH for i in range(BATCHES)]
    assert all(s.loss is not None for s in steps)  # handed over by on_before_backward (no scaler here)
    assert steps[BAD_BATCH].captured and steps[BAD_BATCH].run == "persistent"
    assert report.verdict == "nan"  # log(0) is a pole, not a range overflow
    # the capture replayed the weights of the failing forward: the callback closed the step before the optimizer
    assert report.forward_origin is not None and report.forward_origin.module == "net.log"
    assert "the weights changed" not in " ".join(report.run.notes)
    assert report.forward_origin.op is not None and report.forward_origin.op.op == "aten::log"


def test_lightning_float16_plugin_with_its_grad_scaler_names_the_overflow(tmp_path: Path) -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    report = fit(boom_net(), data(torch.full((4, 4), 4.0)), tmp_path, plugins=[MixedPrecision("16-mixed", "cpu")])
    assert report.run.limits.dtype == "float16"
    steps = report.steps
    assert [s.skipped for s in steps] == [i == BAD_BATCH for i in range(BATCHES)]  # GradScaler skipped it
    assert [s.scale for s in steps][BAD_BATCH:BAD_BATCH + 2] == [65536.0, 32768.0]
    assert report.verdict == "overflow"
    assert report.forward_origin is not None and report.forward_origin.module == "net.boom"


class ZeroGain(nn.Module):
    """``x * (1 + |gain|)`` written as a square root, with ``gain`` at zero: finite forward and loss, a NaN gradient
    for ``gain`` (d sqrt(u)/du = inf at 0, times 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1 + torch.sqrt(self.gain * self.gain))


def test_lightning_bf16_mixed_nan_gradients_under_a_finite_loss_are_found_at_the_first_step(tmp_path: Path) -> None:
    """No GradScaler in bfloat16: the watch checks the gradients itself when the callback closes the step (before
    the optimizer), so the first step is the failure and its capture names the square root's backward."""
    net = Net(OrderedDict(mix=nn.Linear(4, 4), gate=ZeroGain(), head=nn.Linear(4, 1)))
    report = fit(net, data(torch.rand(4, 4) + 0.5), tmp_path, precision="bf16-mixed")
    steps = report.steps
    assert steps[0].forward_finite and not steps[0].grads_finite and steps[0].nonfinite_params == ("net.gate.gain",)
    assert steps[0].captured and steps[0].run == "persistent"
    assert report.backward_origin is not None and report.backward_origin.module == "net.gate"
    assert report.backward_origin.op is not None and report.backward_origin.op.node == "SqrtBackward0"
    assert "the weights changed" not in " ".join(report.run.notes)
