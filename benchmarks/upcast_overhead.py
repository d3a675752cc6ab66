"""What the op-level float32 upcast costs (issue 18, item 4), in one run, as ratios to a plain AMP step.

A stack of attention blocks written in Python (scores before the 1/sqrt(d) scaling, no norms). Training-step modes,
against **plain** (autocast forward, loss, backward; ``.grad`` set to None), on N(0, 1) inputs so that no step is
slowed down by inf/NaN arithmetic:

* ``fp32_op``: ``ampdoctor.fp32_op(model, <every attention>, "matmul", 0)``, the scores' matmul in float32;
* ``fallback``: ``ampdoctor.fp32_fallback(model, <every attention>)``, the whole attention modules in float32.

Diagnosis modes, on raw sensor-like inputs (mean 200) where the scores overflow: ``diagnose`` (every rule) and
``diagnose-no-op`` (the ``fp32_op`` rule left out): what resolving and verifying the op-level upcast adds.

Times are process CPU time (1 thread), modes interleaved round by round; median and range over the rounds.

    python benchmarks/upcast_overhead.py            # about a minute here
    python benchmarks/upcast_overhead.py --quick

Measured here (2026-12-03, shared 2-core CPU, torch 2.13, 4 blocks, d 64, batch 8 x 64 tokens, 5 rounds):
fp32_op 0.96x and 1.02x a plain step in two runs (ranges 0.90-1.02, 0.97-1.16: noise); the module fallback
0.58-0.63x (on CPU float32 matmuls are faster than float16 ones, so only the op-level numbers say something about
the mode's own cost: it is within the noise). A failing diagnosis: 14.3-14.5 plain steps with the rule, 10.5-11.4
without (the rule's re-run at the used scale and its retry at scale 1: about 3-4 plain steps).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import ampdoctor
import ampdoctor.fixes.recommend as recommend_module
from ampdoctor.fixes.rules import RULES


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(-2, -1)
        return self.o(torch.softmax(scores / math.sqrt(q.shape[-1]), dim=-1) @ v)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = Attention(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.ff(x)


class Net(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _loss(out: torch.Tensor, _: object = None) -> torch.Tensor:
    return out.float().mean()


def _step(model: nn.Module, x: torch.Tensor) -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = _loss(model(x))
    (loss * 2.0**16).backward()
    for p in model.parameters():
        p.grad = None


def _timed(fn: Callable[[], object]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds, steps = (2, 2) if args.quick else (5, 5)
    torch.manual_seed(0)
    d, n = 64, 4
    model = Net(d, n)
    attn = [f"blocks.{i}.attn" for i in range(n)]
    healthy = torch.randn(8, 64, d)
    sensors = 200 + 50 * torch.randn(8, 64, d)
    without = tuple(r for r in RULES if r.name != "fp32_op")

    def plain() -> None:
        for _ in range(steps):
            _step(model, healthy)

    def op() -> None:
        with ampdoctor.fp32_op(model, attn, "matmul", 0):
            for _ in range(steps):
                _step(model, healthy)

    def fallback() -> None:
        with ampdoctor.fp32_fallback(model, attn):
            for _ in range(steps):
                _step(model, healthy)

    def diagnose() -> None:
        ampdoctor.diagnose(model, sensors, loss_fn=_loss, device_type="cpu")

    def diagnose_no_op() -> None:
        saved = recommend_module.RULES
        recommend_module.RULES = without  # type: ignore[attr-defined]
        try:
            ampdoctor.diagnose(model, sensors, loss_fn=_loss, device_type="cpu")
        finally:
            recommend_module.RULES = saved  # type: ignore[attr-defined]

    sensors_step = lambda: _step(model, sensors)  # noqa: E731
    modes: dict[str, Callable[[], None]] = {
        "plain": plain, "fp32_op": op, "fallback": fallback, "diagnose": diagnose, "diagnose-no-op": diagnose_no_op,
    }
    plain(), op(), fallback(), diagnose()  # warm up
    times: dict[str, list[float]] = {name: [] for name in modes}
    failing_plain: list[float] = []
    for _ in range(rounds):
        for name, fn in modes.items():
            times[name].append(_timed(fn))
        failing_plain.append(_timed(sensors_step))
    step = statistics.median(times["plain"]) / steps
    sensors_plain = statistics.median(failing_plain)
    print(f"plain step (N(0,1) inputs): {step * 1e3:.1f} ms; on the failing inputs: {sensors_plain * 1e3:.1f} ms")
    for name in ("fp32_op", "fallback"):
        ratios = [t / (p) for t, p in zip(times[name], times["plain"])]
        print(f"{name:>16}: {statistics.median(ratios):.3f}x a plain step (range {min(ratios):.3f}-{max(ratios):.3f})")
    for name in ("diagnose", "diagnose-no-op"):
        ratios = [t / p for t, p in zip(times[name], failing_plain)]
        print(f"{name:>16}: {statistics.median(ratios):.1f} plain steps (range {min(ratios):.1f}-{max(ratios):.1f})")


if __name__ == "__main__":
    main()
