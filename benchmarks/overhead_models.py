"""The models and batches of ``benchmarks/overhead.py``, and their failing variants.

Batch sizes are realistic for each model's task, then kept small where this benchmark's CPU emulates float16
matmuls (about 1 GFLOP/s): each case states its batch. ``--batch-div`` divides them further for a smoke run.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

LossFn = Callable[[Any, Any], torch.Tensor]
# The failing variants: a forward that overflows (one layer's weight multiplied), and a loss scale that makes
# the backward overflow (GradScaler's classic first steps at too large a scale).
FORWARD_OVERFLOW_FACTOR = 2.0**16
SCALE_OVERFLOW_SCALE = 2.0**24


@dataclass
class Case:
    name: str
    description: str
    model: nn.Module
    batch: Any
    loss_fn: LossFn
    boom: str  # the module whose weight the forward-overflow variant multiplies


def _classifier(
    name: str, description: str, model: nn.Module, batch: torch.Tensor, classes: int, boom: str, device: torch.device
) -> Case:
    """A case whose loss is the cross entropy against random labels (computed in float32, as usual)."""
    targets = torch.randint(0, classes, (batch.shape[0],), device=device)

    def loss_fn(output: torch.Tensor, _batch: Any) -> torch.Tensor:
        return F.cross_entropy(output.float(), targets)

    return Case(name, description, model.to(device), batch.to(device), loss_fn, boom)


class TextClassifier(nn.Module):
    """BERT-style: token and position embeddings, a TransformerEncoder, a classifier on the first token."""

    def __init__(self, vocab: int, d_model: int, layers: int, heads: int, ff: int, seq: int, classes: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(seq, d_model)
        self.norm = nn.LayerNorm(d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.1, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.tokens(ids) + self.positions.weight[: ids.shape[1]])
        return self.head(self.encoder(x)[:, 0])


def _encoder(device: torch.device, div: int) -> Case:
    vocab, seq = 200_000, 64
    model = TextClassifier(vocab, d_model=256, layers=4, heads=4, ff=1024, seq=seq, classes=2)
    n = max(1, 8 // div)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    description = (
        f"BERT-style classifier, {params:.0f}M parameters (vocabulary 200k x d_model 256 = 51M in the embedding; "
        f"4 layers, 4 heads, ff 1024), batch {n} x {seq} tokens"
    )
    ids = torch.randint(0, vocab, (n, seq))
    return _classifier("transformer encoder", description, model, ids, 2, "encoder.layers.3.linear1", device)


def _convnet(device: torch.device, div: int) -> Case:
    layers: list[nn.Module] = []
    cin = 3
    for c in (32, 64, 128):
        for _ in range(2):
            layers += [nn.Conv2d(cin, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True)]
            cin = c
        layers.append(nn.MaxPool2d(2))
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    model = nn.Sequential(*layers)
    n = max(2, 32 // div)  # BatchNorm in train mode needs more than one value per channel
    description = f"VGG-style, 6 x (conv3x3 + BN + ReLU) at 32/64/128 channels, 32x32 images, batch {n}"
    # boom: the last conv
    return _classifier("convnet + BatchNorm", description, model, torch.randn(n, 3, 32, 32), 10, "17", device)


def _narrow(device: torch.device, div: int) -> Case:
    layers: list[nn.Module] = []
    for _ in range(200):
        linear = nn.Linear(64, 64)
        # He init keeps the activations O(1) through 200 ReLU layers (the default init would decay them into
        # fp16 subnormals and zeros, and subnormal arithmetic would distort the timing).
        nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")
        nn.init.zeros_(linear.bias)
        layers += [linear, nn.ReLU()]
    n = max(1, 64 // div)
    description = f"200 x (Linear(64) + ReLU), batch {n}"
    # boom: the last Linear
    return _classifier("200-layer narrow MLP", description, nn.Sequential(*layers), torch.randn(n, 64), 64, "398",
                       device)


CASES: dict[str, Callable[[torch.device, int], Case]] = {"encoder": _encoder, "convnet": _convnet, "narrow": _narrow}


def build_case(key: str, device: torch.device, batch_div: int = 1) -> Case:
    torch.manual_seed(0)
    case = CASES[key](device, batch_div)
    case.model.train()
    return case


def forward_overflow(case: Case) -> nn.Module:
    """A copy of the model whose ``boom`` module's weight is multiplied: its output overflows float16."""
    model = copy.deepcopy(case.model)
    weight: Optional[torch.Tensor] = getattr(dict(model.named_modules())[case.boom], "weight", None)
    assert weight is not None
    with torch.no_grad():
        weight.mul_(FORWARD_OVERFLOW_FACTOR)
    return model
