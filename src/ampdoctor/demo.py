"""A small built-in transformer that overflows in float16 in a known place (used by ``ampdoctor demo``).

The second block's attention computes ``q @ k.T`` before dividing by ``sqrt(head_dim)`` (a common way to
write it), and its q/k projections have grown large and aligned, as they can in long fp16 runs. The scores
pass 65504, the product is inf in float16, softmax turns it into NaN: the origin is ``blocks.1.attn`` (its own
matmul), not its ``proj`` child that receives the NaN.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

DEMO_ORIGIN = "blocks.1.attn"
_VOCAB, _WIDTH, _HEADS, _SEQ, _BATCH = 64, 32, 2, 16, 4
_QK_GROWTH = 100.0  # how much the second block's q/k weights have grown


class DemoAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1)  # overflows in float16 before the scaling below
        scores = scores / math.sqrt(d // self.heads)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
        y = (attn @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class DemoBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = DemoAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class DemoTransformer(nn.Module):
    """A 2-block causal language model: token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, vocab: int = _VOCAB, width: int = _WIDTH, heads: int = _HEADS, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(DemoBlock(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_demo(seed: int = 0) -> tuple[DemoTransformer, torch.Tensor, torch.Tensor]:
    """The demo model (with the grown q/k weights), a batch of token ids and the next-token targets."""
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DemoTransformer()
    with torch.no_grad():
        qkv = model.get_submodule("blocks.1.attn.qkv")
        assert isinstance(qkv, nn.Linear)
        qkv.weight[:_WIDTH].mul_(_QK_GROWTH)  # q grew, and k learned to align with it
        qkv.weight[_WIDTH : 2 * _WIDTH].copy_(qkv.weight[:_WIDTH])
        qkv.bias[_WIDTH : 2 * _WIDTH].copy_(qkv.bias[:_WIDTH])
    tokens = torch.randint(0, _VOCAB, (_BATCH, _SEQ + 1), generator=generator)
    return model, tokens[:, :-1], tokens[:, 1:]


def demo_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
