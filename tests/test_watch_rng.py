"""Re-runs of a failing training step draw what the failing forward drew: the watch's capture and a bundle replay.

Each model here fails only for some random draws (a dropout mask, Python's ``random``, numpy), and each test
picks seeds so that the failing step's draw makes it overflow while the *next* draw of the same stream would
not. A capture or a replay that does not restore the failing forward's RNG state, all of its streams, draws the
next values and finds a healthy step: these tests then fail. Both facts about the draws are asserted, so the
tests stay sensitive if torch or numpy ever change what a seed draws.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.training.replay import replay_bundle
from ampdoctor.training.runtime import Watch

FP16 = torch.float16
N_IN = 8
P_DROP = 0.5


def tiny_loss(out: torch.Tensor, _: Any) -> torch.Tensor:
    """d loss / d out = 2e-7 * out: an inf output makes inf gradients (GradScaler skips the step); on the good
    steps here (|out| <= 40000) the scaled gradient is at most 2e-7 * 40000 * 65536 = 524, far from the limit."""
    return out.float().pow(2).sum() * 1e-7


def dropout_model() -> nn.Sequential:
    """drop: Dropout(0.5) on x = ones(1, 8), kept inputs become 2; boom: weight 40000 on input 0, 1e-3 elsewhere.

    Input 0 kept: boom's outputs are 2 * 40000 + (at most 7 * 2 * 1e-3) = 80000.014 >= 65520: +inf in float16.
    Input 0 dropped: at most 7 * 2 * 1e-3 = 0.014, finite. The mask alone decides the overflow.
    """
    model = nn.Sequential()
    model.add_module("drop", nn.Dropout(P_DROP))
    boom = nn.Linear(N_IN, 4, bias=False)
    with torch.no_grad():
        boom.weight.fill_(1e-3)
        boom.weight[:, 0] = 40000.0
    model.add_module("boom", boom)
    return model


def keeps_input_0(draws: int) -> list[bool]:
    """Whether each of the next ``draws`` dropout masks of the global torch RNG keeps input 0 (consumes them)."""
    drop = nn.Dropout(P_DROP)  # what dropout_model's drop draws (building the whole model would draw its init)
    return [bool(drop(torch.ones(1, N_IN))[0, 0] != 0) for _ in range(draws)]


def torch_seed_for(pattern: list[bool]) -> int:
    """The first seed whose successive dropout masks keep input 0 exactly as ``pattern`` says."""
    for seed in range(10_000):
        torch.manual_seed(seed)
        if keeps_input_0(len(pattern)) == pattern:
            return seed
    raise AssertionError(f"no seed draws {pattern}")


def train(model: nn.Module, scaler: torch.amp.GradScaler, steps: int) -> None:
    """The classic loop on x = ones(1, 8); nothing in it draws random numbers except the model's forward."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=FP16):
            out = model(torch.ones(1, N_IN))
        scaler.scale(tiny_loss(out, None)).backward()
        scaler.step(opt)
        scaler.update()


def rng_streams() -> tuple[torch.Tensor, Any, Any]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def assert_same_streams(a: tuple[torch.Tensor, Any, Any], b: tuple[torch.Tensor, Any, Any]) -> None:
    assert torch.equal(a[0], b[0]), "the torch CPU stream was not put back"
    assert a[1] == b[1], "Python's random stream was not put back"
    assert a[2][0] == b[2][0] and np.array_equal(a[2][1], b[2][1]) and a[2][2:] == b[2][2:], "numpy's was not"


# Steps 0-2 drop input 0 (good), step 3 keeps it (overflows), and the draw after step 3 would drop it again.
DROPOUT_PATTERN = [False, False, False, True, False]
FAILING_STEP = 3


@pytest.fixture
def dropout_run(tmp_path: Path) -> tuple[Watch, int]:
    seed = torch_seed_for(DROPOUT_PATTERN)
    torch.manual_seed(seed)
    assert keeps_input_0(5) == DROPOUT_PATTERN  # the failing mask keeps input 0; the next draw drops it
    model = dropout_model()
    scaler = torch.amp.GradScaler("cpu")
    torch.manual_seed(seed)
    with ampdoctor.watch(model, scaler, loss_fn=tiny_loss, bundle_dir=tmp_path) as doctor:
        train(model, scaler, len(DROPOUT_PATTERN))
    return doctor, seed


def test_the_capture_draws_the_failing_forwards_dropout_mask(dropout_run: tuple[Watch, int]) -> None:
    doctor, _ = dropout_run
    report = doctor.report()
    steps = report.steps
    assert [s.forward_finite for s in steps] == [not kept for kept in DROPOUT_PATTERN]
    assert [s.skipped for s in steps] == DROPOUT_PATTERN  # the inf output made inf gradients
    assert [s.run for s in steps] == [None, None, None, "persistent", None]
    # The capture re-ran step 3 under step 3's RNG state: its mask kept input 0 and boom overflowed again.
    # Under the state at capture time (after step 3's forward) the mask drops input 0 and boom is finite.
    assert steps[FAILING_STEP].captured and steps[FAILING_STEP].forward_origin == "boom"
    assert report.verdict == "overflow"
    assert report.forward_origin is not None and report.forward_origin.module == "boom"


def test_the_bundle_replays_the_failing_forwards_dropout_mask(dropout_run: tuple[Watch, int]) -> None:
    doctor, _ = dropout_run
    assert doctor.bundle_path is not None and doctor.bundle_path.name == f"ampdoctor-bundle-step{FAILING_STEP}.pt"
    # A caller's stream that, once the factory has drawn its init, would drop input 0: what a replay without
    # the bundle's RNG state would draw.
    caller_seed = next(s for s in range(10_000) if drops_after_factory(s))
    assert drops_after_factory(caller_seed)
    torch.manual_seed(caller_seed)
    random.seed(1)
    np.random.seed(1)
    before = rng_streams()
    replayed = replay_bundle(doctor.bundle_path, dropout_model, loss_fn=tiny_loss)
    assert replayed.verdict == "overflow"
    assert replayed.forward_origin is not None and replayed.forward_origin.module == "boom"
    assert replayed.trace.backward_ran
    assert_same_streams(before, rng_streams())  # every stream of the caller is put back


def drops_after_factory(seed: int) -> bool:
    torch.manual_seed(seed)
    dropout_model()  # nn.Linear's init draws from the stream
    return keeps_input_0(1) == [False]


# -- Python's and numpy's streams ---------------------------------------------------------------------------


class PythonGate(nn.Module):
    """Doubles its input when Python's ``random.random()`` draws under 0.5 (a random augmentation in forward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (2.0 if random.random() < 0.5 else 1.0)


class NumpyGate(nn.Module):
    """Doubles its input when numpy's global ``np.random.rand()`` draws under 0.5."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (2.0 if float(np.random.rand()) < 0.5 else 1.0)


def gated(gate: type[nn.Module]) -> Callable[[], nn.Sequential]:
    def factory() -> nn.Sequential:
        """boom's outputs are 8 * 5000 * gain: 40000 (finite) for gain 1, 80000 (+inf in float16) for gain 2."""
        model = nn.Sequential()
        model.add_module("gate", gate())
        boom = nn.Linear(N_IN, 4, bias=False)
        with torch.no_grad():
            boom.weight.fill_(5000.0)
        model.add_module("boom", boom)
        return model

    return factory


def first_seed(draw: Callable[[int], list[float]], pattern: list[bool]) -> int:
    """The first seed whose draws are under 0.5 exactly where ``pattern`` is True."""
    return next(s for s in range(10_000) if [v < 0.5 for v in draw(s)] == pattern)


def python_draws(seed: int, n: int = 3) -> list[float]:
    rng = random.Random(seed)  # the same sequence as random.seed(seed) on the global stream
    return [rng.random() for _ in range(n)]


def numpy_draws(seed: int, n: int = 3) -> list[float]:
    return [float(v) for v in np.random.RandomState(seed).rand(n)]


STREAMS = {
    "python": (PythonGate, python_draws, random.seed),
    "numpy": (NumpyGate, numpy_draws, np.random.seed),
}


@pytest.mark.parametrize("stream", sorted(STREAMS))
def test_a_forward_that_draws_from_python_or_numpy_is_captured_and_replayed_identically(
    stream: str, tmp_path: Path
) -> None:
    gate, draws, seed_global = STREAMS[stream]
    # Step 0 draws >= 0.5 (gain 1, good), step 1 draws < 0.5 (gain 2, overflow); the next draw is >= 0.5.
    seed = first_seed(draws, [False, True, False])
    assert [v < 0.5 for v in draws(seed)] == [False, True, False]
    factory = gated(gate)
    model = factory()
    scaler = torch.amp.GradScaler("cpu")
    seed_global(seed)
    with ampdoctor.watch(model, scaler, loss_fn=tiny_loss, bundle_dir=tmp_path) as doctor:
        train(model, scaler, 2)
    report = doctor.report()
    assert [s.forward_finite for s in report.steps] == [True, False]
    assert [s.skipped for s in report.steps] == [False, True]
    assert report.steps[1].captured and report.steps[1].forward_origin == "boom"
    assert doctor.bundle_path is not None and doctor.bundle_path.name == "ampdoctor-bundle-step1.pt"

    # The caller's stream would draw >= 0.5 next (gain 1, no overflow): only the bundle's state overflows.
    caller_seed = first_seed(lambda s: draws(s, 1), [False])
    seed_global(caller_seed)
    before = rng_streams()
    replayed = replay_bundle(doctor.bundle_path, factory, loss_fn=tiny_loss)
    assert replayed.verdict == "overflow"
    assert replayed.forward_origin is not None and replayed.forward_origin.module == "boom"
    assert_same_streams(before, rng_streams())
