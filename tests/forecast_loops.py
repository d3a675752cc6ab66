"""Training loops that drift towards a float16 overflow (and healthy ones that do not), for the forecast tests.

Each loop is the classic autocast + GradScaler loop on CPU float16 around a tiny model, inside
``ampdoctor.watch`` with its defaults; it runs until the first step whose loss is non-finite (or ``steps``).
The arithmetic of each drift is in its docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import ampdoctor

FP16 = torch.float16


@dataclass
class Outcome:
    doctor: Any
    report: ampdoctor.Report
    first_bad: Optional[int]  # the first step whose loss was non-finite
    steps: int  # steps run


def run_loop(
    model: nn.Module,
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    opt: torch.optim.Optimizer,
    steps: int,
    stop_after_bad: int = 2,
    **watch_kwargs: Any,
) -> Outcome:
    scaler = torch.amp.GradScaler("cpu")
    first_bad: Optional[int] = None
    done = 0
    with ampdoctor.watch(model, scaler, save_bundle=False, **watch_kwargs) as doctor:
        for step in range(steps):
            x, y = batch(step)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=FP16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            done = step + 1
            if first_bad is None and not math.isfinite(loss.item()):
                first_bad = step
            if first_bad is not None and step >= first_bad + stop_after_bad:
                break
    return Outcome(doctor, doctor.report(), first_bad, done)


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float(), y)


def data_drift(growth: float = 1.15, seed: int = 0, steps: int = 80, **kw: Any) -> Outcome:
    """Input scale grows ``growth`` a step, the weights stay put (lr 0): every activation grows with it. The
    hidden layer ``body.1`` has the gain (weights 0.5 on 64 inputs of about 3 -> |x|max near 100 at step 0,
    1.15**n later): it crosses 65504 at about log(655)/log(1.15) = 46 steps; the head divides by 64 again."""
    torch.manual_seed(seed)
    model = nn.Sequential()
    model.add_module("body", nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 64), nn.ReLU()))
    model.add_module("head", nn.Linear(64, 4))
    with torch.no_grad():
        model.body[0].weight.uniform_(0.1, 0.3)
        model.body[0].bias.zero_()
        model.body[1].weight.fill_(0.5)
        model.body[1].bias.zero_()
        model.head.weight.normal_(0, 1 / 64)
    g = torch.Generator().manual_seed(seed + 1)
    base = torch.rand(256, 16, generator=g) + 0.5
    labels = torch.randint(0, 4, (8,), generator=g)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.randint(0, 256, (8,), generator=g)
        return base[rows] * growth**step, labels

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    return run_loop(model, batch, _ce, opt, steps, **kw)


def lr_too_high(factor: float = 1.2, seed: int = 0, steps: int = 120, **kw: Any) -> Outcome:
    """A linear fit with a step size past the stable limit: out = w . a, loss = mean(out**2), so SGD multiplies
    w . a by 1 - 2 lr |a|**2 = -``factor`` each step it is not skipped: |out| grows ``factor`` a step (0.26 bits at
    1.2) from about 4 to 65504 in some 55 steps (a few more where GradScaler skips while it backs off)."""
    torch.manual_seed(seed)
    d = 16
    model = nn.Sequential(nn.Linear(d, 1, bias=False))
    a = torch.full((4, d), 0.5)
    a[2:] = -0.5  # outputs of both signs: an overflow makes +inf (an all -inf output would pass for a mask)
    with torch.no_grad():
        model[0].weight.fill_(0.5)  # out = 16 * 0.25 = 4
    lr = (1 + factor) / (2 * float((a[0] ** 2).sum()))
    g = torch.Generator().manual_seed(seed + 1)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return a * (1 + 0.01 * torch.rand(4, 1, generator=g)), torch.zeros(4, 1)

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (out.float() - y).pow(2).mean()

    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return run_loop(model, batch, loss, opt, steps, **kw)


class Block(nn.Module):
    """x + alpha * f(x): the residual add is the block's own code (an overflow there has the block as origin)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.f = nn.Linear(d, d, bias=False)
        self.alpha = nn.Parameter(torch.tensor(0.0))
        with torch.no_grad():
            self.f.weight.copy_(torch.eye(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.alpha * self.f(x)


def residual_growth(lr: float = 0.02, seed: int = 0, steps: int = 150, **kw: Any) -> Outcome:
    """Eight residual blocks whose gains grow: the loss rewards a large output, so Adam raises every ``alpha`` by
    about ``lr`` a step, and the float16 stream (``inp`` makes it float16: the identity, under autocast) grows as
    (1 + alpha)**8 from about 300: it crosses 65504 when 1 + alpha = 218**(1/8) = 1.96, after about 48 steps, in
    the last block's own residual add (``blocks.7``: its output is the largest)."""
    torch.manual_seed(seed)
    d = 16
    model = nn.Sequential()
    model.add_module("inp", nn.Linear(d, d, bias=False))
    model.add_module("blocks", nn.Sequential(*[Block(d) for _ in range(8)]))
    model.add_module("head", nn.Linear(d, 2))
    with torch.no_grad():
        model.inp.weight.copy_(torch.eye(d))
        model.head.weight.fill_(1 / 1024)
        model.head.bias.zero_()
    g = torch.Generator().manual_seed(seed + 1)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return 250 + 50 * torch.rand(8, d, generator=g), torch.zeros(8, dtype=torch.long)

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return -out.float().mean()

    opt = torch.optim.Adam([b.alpha for b in model.blocks], lr=lr)  # only the gains learn
    return run_loop(model, batch, loss, opt, steps, **kw)


def healthy(tight: bool, seed: int = 0, steps: int = 200, **kw: Any) -> Outcome:
    """A stationary classification run that learns (its logits grow while the loss falls). ``tight``: the inputs
    are scaled so the first layer's outputs sit near 2000 (about 5 bits of headroom), noisy from batch to batch,
    but not trending."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(seed + 1)
    centers = torch.randn(4, 16, generator=g)
    scale = 400.0 if tight else 1.0

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 4, (16,), generator=g)
        return (centers[y] + 0.5 * torch.randn(16, 16, generator=g)) * scale, y

    opt = torch.optim.SGD(model.parameters(), lr=1e-6 if tight else 0.05)
    return run_loop(model, batch, _ce, opt, steps, **kw)
