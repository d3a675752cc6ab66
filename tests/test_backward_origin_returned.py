"""A tensor the model returns and also uses inside (an intermediate, a KV cache) gets its gradient from inside.

Its root-output gradient turns non-finite *after* the call that made it so; it is not "the gradient of the loss
reaching the model". Found on Hugging Face Bloom: the returned cache holds layer 0's keys and values, which the
GeLU's custom autograd backward (``x * x`` at x = 1257 overflows float16, times 0 makes NaN) poisons later in the
backward; diagnose named ``<loss>`` and offered only "compute the loss in float32" and bfloat16.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampdoctor


class _SquareBackward(torch.autograd.Function):
    """Forward scales down; backward multiplies by 100 x**2, which leaves float16 for |x| > 25.6."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 0.001

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad * x * x * 100.0


class Act(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SquareBackward.apply(x)


class ReturnsItsIntermediate(nn.Module):
    """fc1's output (800 per element) is returned beside the prediction, as a cache would be."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 8), Act(), nn.Linear(8, 1)
        with torch.no_grad():
            self.fc1.weight.fill_(100.0)  # 8 * 100 = 800 per output: 100 * 800**2 = 6.4e7 > 65504 in the backward

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.fc1(x)
        return {"y": self.fc2(self.act(h)), "cache": h}


def test_a_returned_intermediate_does_not_make_the_loss_the_backward_origin() -> None:
    torch.manual_seed(0)
    model = ReturnsItsIntermediate()
    report = ampdoctor.diagnose(model, torch.ones(4, 8), loss_fn=lambda out, batch: out["y"].float().mean(),
                                progress=False)  # fmt: skip
    origin = report.backward_origin
    assert origin is not None and origin.module == "act", report.to_text()
    assert origin.tensor == "grad:args[0]" and origin.bad.posinf_count == 24 and origin.bad.neginf_count == 8
    assert "outside the model" not in report.to_text()


def test_without_the_returned_intermediate_the_origin_is_the_same() -> None:
    """The same model returning only the prediction: the answer must not depend on what else is returned."""
    torch.manual_seed(0)
    model = ReturnsItsIntermediate()
    report = ampdoctor.diagnose(model, torch.ones(4, 8), loss_fn=lambda out, batch: out["y"].float().mean(),
                                progress=False)  # fmt: skip
    plain = nn.Sequential(model.fc1, model.act, model.fc2)
    alone = ampdoctor.diagnose(plain, torch.ones(4, 8), loss_fn=lambda out, batch: out.float().mean(), progress=False)
    assert alone.backward_origin is not None and alone.backward_origin.module == "1"
    assert report.backward_origin is not None and report.backward_origin.bad == alone.backward_origin.bad


def test_bloom_gelu_backward_nan_is_found_in_the_gelu_not_the_loss() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=100)
    model = transformers.BloomForCausalLM(config).train()
    with torch.no_grad():
        # h.0's MLP input reaches |x| 1257: the GeLU's backward x * x (1.6e6) overflows, times (1 - tanh^2) = 0 is NaN
        model.transformer.h[0].mlp.dense_h_to_4h.weight.mul_(3000.0)
    ids = torch.randint(0, 100, (2, 12))
    with torch.autocast("cpu", dtype=torch.float16):
        assert torch.isfinite(model(input_ids=ids, labels=ids).loss)  # the forward is fine; the backward is not
    report = ampdoctor.diagnose(model, {"input_ids": ids, "labels": ids}, progress=False)
    origin = report.backward_origin
    assert origin is not None and origin.module == "transformer.h.0.mlp.gelu_impl", report.to_text()
    assert origin.op is not None and origin.op.node == "GeLUFunctionBackward"
    first = report.recommendations[0]
    assert first.action == "fp32_fallback" and first.verified and "transformer.h.0.mlp.gelu_impl" in first.snippet
