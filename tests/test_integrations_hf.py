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


def test_hf_trainer_bf16_names_the_log_of_zero(tmp_path: Path) -> None:
    model = LogRegressor()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, bf16=True, per_device_train_batch_size=4, num_train_epochs=1,
        learning_rate=0.0, report_to=[], save_strategy="no", disable_tqdm=True, logging_strategy="no",
        dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows())
    callback = hf_callback(trainer, save_bundle=False)
    trainer.train()
    report: Any = callback.report
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
