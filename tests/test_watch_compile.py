"""Issue 14, item 5: ``watch`` on a ``torch.compile``-d model, and under activation checkpointing.

Measured on torch 2.13 before this: hooks that append to Python lists recompile the graph every step until the
recompile limit, then run eagerly for good; ``.item()`` in a hook breaks the graph. Goal: after warm-up, zero
recompiles and zero graph breaks, the model still compiled at step 20, and per-module statistics on sampled steps,
for both ``torch.compile(model)`` and ``model.compile()``.

The tests compile with ``backend="aot_eager"`` wrapped in a counter (every compilation and every run of a
compiled forward graph is counted): inductor works on this machine (gcc) but takes ~20 s per graph on a loaded
CPU; ``benchmarks/watch_overhead.py --compile`` uses inductor.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch._dynamo
from helpers import ampdoctor_frames_during
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import ampdoctor
from ampdoctor.training.compiled import COMPILED_NOTE

FP16 = torch.float16
STEPS = 24
BLOWUP_STEP = 22


class CountingBackend:
    """aot_eager, counting compilations and forward-graph runs."""

    def __init__(self) -> None:
        self.compiles = 0
        self.runs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        self.compiles += 1

        def forward_compiler(graph: torch.fx.GraphModule, inputs: Any) -> Callable[..., Any]:
            inner = boxed_nop(graph, inputs)

            def run(args: list[Any]) -> Any:
                self.runs += 1
                return inner(args)

            run._boxed_call = True  # type: ignore[attr-defined]
            return run

        compiled: Callable[..., Any] = aot_autograd(fw_compiler=forward_compiler, bw_compiler=boxed_nop)(
            gm, example_inputs
        )
        return compiled


class Net(nn.Module):
    """fc1 -> relu -> boom -> relu -> head. boom multiplies by 5000: fine for |x| <= 1 (outputs ~ 2500 at most),
    +inf in float16 when the batch is 1000x larger."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.boom = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)
        with torch.no_grad():
            self.boom.weight.fill_(5000.0 / 32 / 8)
            self.head.weight.mul_(1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.boom(self.act(self.fc1(x)))))


def batch(step: int) -> torch.Tensor:
    x = torch.rand(8, 16, generator=torch.Generator().manual_seed(step))
    return x * 1000 if step == BLOWUP_STEP else x


def train(model: nn.Module, compiled: nn.Module, steps: int, backend: CountingBackend, **kw: Any) -> Any:
    """The classic loop on ``compiled``; returns the report and (compilations, graph runs) seen after each step."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # constant weights: every step's arithmetic is known
    seen = []
    with ampdoctor.watch(compiled, scaler, save_bundle=False, **kw) as doctor:
        for step in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=FP16):
                loss = compiled(batch(step)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            seen.append((backend.compiles, backend.runs))
    return doctor.report(), seen


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Any:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()"])
def test_a_compiled_model_stays_compiled_and_keeps_its_statistics(how: str) -> None:
    torch.manual_seed(0)
    model = Net()
    backend = CountingBackend()
    if how == "model.compile()":
        model.compile(backend=backend)
        compiled: nn.Module = model
    else:
        compiled = torch.compile(model, backend=backend)
    report, seen = train(model, compiled, STEPS, backend, stats_every=5)
    # warm-up: the graph with the statistics flag on (step 0) and off (step 1); nothing compiled after that
    assert seen[1][0] == seen[STEPS - 1][0] == 2
    assert not counters["graph_break"], dict(counters["graph_break"])
    # still compiled at step 20: every step ran the compiled forward graph (once per step)
    assert [b - a for (_, a), (_, b) in zip(seen, seen[1:])] == [1] * (STEPS - 1)
    steps = report.steps
    sampled = [s.step for s in steps if s.sampled]
    assert sampled[:5] == [0, 5, 10, 15, 20]
    for s in (steps[0], steps[20]):
        assert set(s.out_abs_max) == {"", "fc1", "act", "boom", "head"}
        assert set(s.grad_abs_max) >= {"fc1", "boom", "head"}
        assert s.weight_norm["boom"] == pytest.approx(5000 / 8, rel=1e-2)
    assert steps[5].out_abs_max["boom"] > 0 and not steps[6].out_abs_max  # only sampled steps
    # the blow-up: captured eagerly, with its origin, and the report says the replay was eager
    assert steps[BLOWUP_STEP].skipped and not steps[BLOWUP_STEP].forward_finite
    assert report.forward_origin is not None and report.forward_origin.module == "boom"
    assert COMPILED_NOTE in report.run.notes
    # after the watch: the hooks are gone; dynamo guards on their count, so the model compiles once more,
    # without them, and then runs no ampdoctor code at all
    for m in (*model.modules(), compiled):
        assert not m._forward_hooks and not m._forward_pre_hooks

    def step() -> None:
        with torch.autocast("cpu", dtype=FP16):
            compiled(batch(0)).float().sum().backward()

    step()
    assert backend.compiles == 3
    assert ampdoctor_frames_during(step) == [] and backend.compiles == 3


@pytest.mark.slow
def test_a_watch_started_after_the_first_compiled_call_says_it_has_no_statistics() -> None:
    torch.manual_seed(0)
    model = Net()
    backend = CountingBackend()
    compiled = torch.compile(model, backend=backend)
    with torch.autocast("cpu", dtype=FP16):
        compiled(batch(0)).float().sum().backward()  # compiled without the watch's hooks
    report, _ = train(model, compiled, 3, backend, stats_every=1)
    assert report.steps[0].out_abs_max.keys() == {""}  # the root's own, taken outside the graph
    assert any("no per-module statistics came from the compiled model" in n for n in report.run.notes)


# -- activation checkpointing: the same findings with and without it ------------------------------------------


class Blocks(nn.Module):
    """Two blocks (boom inside the second); ``mode`` checkpoints each block (reentrant or not) or not at all."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.ReLU()), Net()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.mode == "none":
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return x


def checkpoint_run(mode: str) -> ampdoctor.Report:
    torch.manual_seed(0)
    model = Blocks(mode)
    scaler = torch.amp.GradScaler("cpu")  # 65536: the head's gradients overflow at first (backward skips)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with ampdoctor.watch(model, scaler, stats_every=2, save_bundle=False) as doctor:
        for step in range(6):
            opt.zero_grad()
            x = batch(step).requires_grad_() * (1e4 if step == 4 else 1)  # boom's output overflows
            with torch.autocast("cpu", dtype=FP16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return doctor.report()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["reentrant", "non-reentrant"])
def test_activation_checkpointing_gives_the_same_findings(mode: str) -> None:
    plain, checkpointed = checkpoint_run("none"), checkpoint_run(mode)
    assert plain.forward_origin is not None and plain.forward_origin.module == "blocks.1.boom"
    for field in ("verdict", "forward_origin", "backward_origin", "exit_code"):
        assert getattr(checkpointed, field) == getattr(plain, field), field
    keep = ("step", "scale", "skipped", "forward_finite", "forward_origin", "backward_origin", "run",
            "nonfinite_params", "nonfinite_outputs", "out_abs_max", "grad_abs_max", "micro_batches")
    for a, b in zip(plain.steps, checkpointed.steps):
        assert {k: getattr(a, k) for k in keep} == {k: getattr(b, k) for k in keep}, a.step
    assert plain.steps[4].nonfinite_outputs[0] == "blocks.1.boom"
