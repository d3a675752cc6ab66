"""Parameters held by a module that never runs (``self.gate.gain`` read by the parent, an ``nn.ParameterList``):
a non-finite gradient of theirs is made by the forward that reads them, the holder's closest ancestor that ran.

Each model reads a zero-initialised gain as ``sqrt(gain * gain)`` (|gain|, written as a square root): finite
forward, NaN gradient for the gain (d sqrt(u)/du = inf at 0, times 0), made in SqrtBackward0. Before, the origin
was the holder itself, approximate, with no op.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampdoctor


def gate(gain: torch.Tensor) -> torch.Tensor:
    return 1 + torch.sqrt(gain * gain)


class ReadsAHolder(nn.Module):
    """The root reads ``self.gate.gain``; ``gate`` is a bare nn.Module that only holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(4, 4)
        self.gate = nn.Module()
        self.gate.gain = nn.Parameter(torch.zeros(4))
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(x) * gate(self.gate.gain))


class Block(nn.Module):
    """A block whose per-layer gains sit in an ``nn.ParameterList`` (never called), two levels down."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.store = nn.Module()
        self.store.gains = nn.ParameterList([nn.Parameter(torch.ones(4)), nn.Parameter(torch.zeros(4))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        for g in self.store.gains:
            h = h * gate(g)
        return h


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(4, 4), Block(), nn.Linear(4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "make, origin, param",
    [(ReadsAHolder, "<root>", "gate.gain"), (Stack, "blocks.1", "blocks.1.store.gains.1")],
)
def test_a_parameter_whose_holder_never_runs_is_blamed_on_the_forward_that_reads_it(
    make: type[nn.Module], origin: str, param: str
) -> None:
    torch.manual_seed(0)
    model = make()
    report = ampdoctor.diagnose(model, torch.rand(4, 4), dtype=torch.bfloat16)
    found = report.backward_origin
    assert report.verdict == "nan"
    assert found is not None and found.exact
    assert found.label == origin and found.tensor == f"grad:{param}"
    assert found.op is not None and found.op.node == "SqrtBackward0"
    location = found.op.location
    assert location is not None and location.function == "gate"  # the line: 1 + torch.sqrt(gain * gain)
    assert location.code.strip() == "return 1 + torch.sqrt(gain * gain)"
