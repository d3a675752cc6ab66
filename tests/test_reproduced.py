"""A step that is not the same twice: the survey saw inf/NaN and the detailed re-run did not (the model changed
state that diagnose does not rewind). The report stands on the survey and says so; it is never HEALTHY."""

from __future__ import annotations

import torch
from torch import nn

import ampdoctor

FP16 = torch.float16


class FirstCallOverflows(nn.Module):
    """A Python flag its forward flips: only its first call scales the hidden state into float16's overflow."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.warm = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if not self.warm:
            self.warm = True
            h = h * 1e6
        return self.b(h)


class AlwaysOverflows(FirstCallOverflows):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * 1e6)


def _loss(out: torch.Tensor, _batch: object) -> torch.Tensor:
    return out.float().mean()


def test_a_survey_overflow_the_rerun_does_not_show_is_reported_not_hidden() -> None:
    torch.manual_seed(0)
    model = FirstCallOverflows()
    report = ampdoctor.diagnose(model, torch.ones(3, 4), loss_fn=_loss, dtype=FP16, progress=False)
    assert report.verdict != "healthy"
    assert report.findings.forward_origin is not None and report.findings.forward_origin.module == ""
    (note,) = [n for n in report.run.notes if n.startswith("the step is not the same twice")]
    assert "forward: inf/NaN from <root> in the survey, finite in the re-run" in note
    assert report.trace.detailed is False  # the survey's own records


def test_a_step_that_is_the_same_twice_has_no_such_note() -> None:
    torch.manual_seed(0)
    report = ampdoctor.diagnose(AlwaysOverflows(), torch.ones(3, 4), loss_fn=_loss, dtype=FP16, progress=False)
    assert report.verdict != "healthy"
    assert report.trace.detailed is True
    assert not [n for n in report.run.notes if n.startswith("the step is not the same twice")]


class NoisyGate(nn.Module):
    """Draws from a torch.Generator of its own: its first draw (0.62 from seed 50) overflows, its second does not."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.gen = torch.Generator().manual_seed(50)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = torch.rand((), generator=self.gen).item()
        return self.b(self.a(x) * (1e6 if k > 0.5 else 1.0))


def test_a_generator_the_model_holds_is_rewound_for_every_pass_and_put_back() -> None:
    torch.manual_seed(0)
    model = NoisyGate()
    state = model.gen.get_state()
    report = ampdoctor.diagnose(model, torch.ones(3, 4), loss_fn=_loss, dtype=FP16, progress=False)
    assert torch.equal(model.gen.get_state(), state)  # the user's next step draws what it would have drawn
    assert report.verdict == "overflow"  # every pass drew the first draw: the re-run shows what the survey saw
    assert report.trace.detailed is True
    assert not [n for n in report.run.notes if n.startswith("the step is not the same twice")]
