"""The Hugging Face callback in a real ``transformers.Trainer.train()`` run on CPU (issue 14, item 6).

On CPU the Trainer's ``fp16=True`` needs CUDA, so this run uses ``bf16=True`` (accelerate's bfloat16 autocast, no
GradScaler: the callback closes each step at ``on_pre_optimizer_step`` and the loss comes from ``output.loss``).
bfloat16 rarely overflows, so the model goes non-finite by construction: one sample of the data set is all zeros,
and the model takes its log (``-inf``), which the next layer mixes into NaN.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ampdoctor.integrations import hf_callback

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

SAMPLES = 24
BAD_SAMPLE = 13


class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class LogRegressor(nn.Module):
    """log -> mix -> head, returning ``{"loss", "logits"}`` as Hugging Face models do."""

    def __init__(self) -> None:
        super().__init__()
        self.log = Log()
        self.mix = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 1)
        with torch.no_grad():
            self.mix.weight.copy_(torch.tensor([[1.0, -1.0, 0.5, 0.5]] * 4))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.mix(self.log(x)))
        return {"loss": (logits.float().squeeze(-1) - labels).pow(2).mean(), "logits": logits}


class Rows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        self.x = torch.rand(SAMPLES, 4, generator=torch.Generator().manual_seed(0)) + 0.5
        self.x[BAD_SAMPLE] = 0.0

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": torch.tensor(1.0)}


def train(model: nn.Module, tmp_path: Path, **args: Any) -> Any:
    """``Trainer.train()`` in bfloat16 on the CPU (lr 0) with the callback; its report."""
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, bf16=True, per_device_train_batch_size=4, learning_rate=0.0,
        report_to=[], save_strategy="no", disable_tqdm=True, logging_strategy="no", dataloader_num_workers=0, **args,
    )
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=Rows())
    callback = hf_callback(trainer, save_bundle=False)
    trainer.train()
    return callback.report


def test_hf_trainer_bf16_names_the_log_of_zero(tmp_path: Path) -> None:
    model = LogRegressor()
    report = train(model, tmp_path, num_train_epochs=1)
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
        # (accelerate leaves its own instance forward on the root for mixed precision: only ours must go)
        assert not hasattr(m.__dict__.get("forward"), "_ampdoctor_forward_tap") and "__getstate__" not in m.__dict__
    steps = report.steps
    assert report.run.limits.dtype == "bfloat16" and len(steps) == SAMPLES // 4
    assert all(s.loss is not None for s in steps)  # from output["loss"]: no scaler here
    # the Trainer shuffles: the batch with the zero sample is the first non-finite one, and every one before is fine
    bad = next(s.step for s in steps if not s.forward_finite)
    assert all(s.forward_finite for s in steps[:bad])
    assert steps[bad].captured and steps[bad].run == "persistent"
    assert report.verdict == "nan"  # log(0) is a pole
    assert report.forward_origin is not None and report.forward_origin.module == "log"
    assert report.forward_origin.op is not None and report.forward_origin.op.op == "aten::log"
    assert report.run.loss_source == "output['loss']"


class ZeroGainRegressor(nn.Module):
    """mix -> ``x * (1 + sqrt(gain * gain))`` with ``gain`` at zero -> head: a finite loss and a NaN gradient for
    ``gain`` (d sqrt(u)/du = inf at 0, times 0), from the first step on."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(4, 4)
        self.gate = nn.Module()
        self.gate.gain = nn.Parameter(torch.zeros(4))
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.mix(x)
        logits = self.head(h * (1 + torch.sqrt(self.gate.gain * self.gate.gain)))
        return {"loss": (logits.float().squeeze(-1) - labels).pow(2).mean(), "logits": logits}


def test_hf_trainer_bf16_nan_gradients_under_a_finite_loss_fail_at_the_first_step(tmp_path: Path) -> None:
    """No GradScaler in bfloat16: the watch checks the gradients itself when the callback closes the step (the
    Trainer's gradient clipping has spread the NaN to every gradient by then); the capture names the root's
    square root, whose backward made ``gate.gain``'s gradient NaN."""
    report = train(ZeroGainRegressor(), tmp_path, max_steps=2)
    first = report.steps[0]
    assert first.forward_finite and not first.grads_finite and first.loss is not None
    assert first.captured and first.run == "persistent"
    assert first.nonfinite_params == ("gate.gain",)  # the capture's own backward: before any clipping
    assert report.backward_origin is not None and report.backward_origin.label == "<root>"
    assert report.backward_origin.op is not None and report.backward_origin.op.node == "SqrtBackward0"
