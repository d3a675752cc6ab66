"""Selections that make values: copying a wider tensor into a float16 one casts it down (a float32 KV cache update
into a float16 cache), and an accumulating index_put / index_add sums. Hidden behind a clamp, each overflow is
found and counted; the same ops that only move float16 values (or sentinels) are not flagged."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

import ampdoctor

FP16 = torch.float16


def _copy(y: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros_like(y)
    buf.copy_(y.float() * 1e5)
    return buf


def _setitem(y: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros_like(y)
    buf[:] = y.float() * 1e5
    return buf


def _index_add(y: torch.Tensor) -> torch.Tensor:
    return torch.zeros(1, 8, dtype=y.dtype).index_add_(0, torch.zeros(4, dtype=torch.long), y.clamp(-1, 1) * 6e4)


def _index_put_accumulate(y: torch.Tensor) -> torch.Tensor:
    index = (torch.zeros(4, dtype=torch.long),)
    return torch.zeros(1, 8, dtype=y.dtype).index_put_(index, y.clamp(-1, 1) * 6e4, accumulate=True)


def _scatter_add(y: torch.Tensor) -> torch.Tensor:
    index = torch.zeros(4, 8, dtype=torch.long)
    return torch.zeros(1, 8, dtype=y.dtype).scatter_add_(0, index, y.clamp(-1, 1) * 6e4)


class Hides(nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * self.fn(y).clamp(-1, 1)  # the clamp hides what fn made


def _truth(model: Hides, x: torch.Tensor) -> tuple[int, bool]:
    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
        made = int(torch.isinf(model.fn(model.lin(x))).sum())
        finite = bool(torch.isfinite(model(x)).all())
    return made, finite


def _loss(out: Any, _batch: Any) -> torch.Tensor:
    return out.float().mean()


@pytest.mark.parametrize(
    ("fn", "op"),
    [(_copy, "copy"), (_setitem, "setitem"), (_index_add, "index_add"), (_index_put_accumulate, "index_put"),
     (_scatter_add, "scatter_add")],
)
def test_a_selection_that_makes_inf_is_a_hidden_overflow(fn: Callable[[torch.Tensor], torch.Tensor], op: str) -> None:
    torch.manual_seed(0)
    model = Hides(fn)
    x = torch.randn(4, 8)
    made, finite = _truth(model, x)
    assert made > 0 and finite  # the premise: inf made, hidden from the module's output
    report = ampdoctor.diagnose(model, x, loss_fn=_loss, dtype=FP16, progress=False)
    assert report.verdict == "hidden_overflow"
    found = [h for h in report.findings.hidden if h.op == op]
    assert [(h.module, h.count) for h in found] == [("", made)]  # (the root's own code)


def _copy_low(y: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros_like(y)
    buf.copy_(y * 10.0)  # float16 into float16: moves values, makes none
    return buf


def _index_put_plain(y: torch.Tensor) -> torch.Tensor:
    index = (torch.zeros(4, dtype=torch.long),)
    return torch.zeros(1, 8, dtype=y.dtype).index_put_(index, y.clamp(-1, 1) * 6e4)  # places, does not sum


def _setitem_mask(y: torch.Tensor) -> torch.Tensor:
    buf = y.clone()
    buf[:, :2] = torch.full((4, 2), float("-inf"))  # a float32 -inf sentinel: a mask, not an overflow
    return buf


@pytest.mark.parametrize("fn", [_copy_low, _index_put_plain, _setitem_mask])
def test_selections_that_only_move_values_are_not_flagged(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    torch.manual_seed(0)
    report = ampdoctor.diagnose(Hides(fn), torch.randn(4, 8), loss_fn=_loss, dtype=FP16, progress=False)
    assert not report.findings.hidden


class FillsRows(nn.Module):
    """A float16 buffer from ``empty`` (stale bytes: some read as inf/NaN) filled row by row with float32 values,
    as a cache update loop does; ``scale`` makes the last row overflow when cast down."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        buf = torch.empty(4, 8, dtype=y.dtype)
        buf.view(torch.int16).fill_(0x7C00)  # the stale bytes: +inf everywhere until written
        for row in range(4):
            buf[row] = y[row].float() * (self.scale if row == 3 else 1.0)
        return y * buf.clamp(-1, 1)


def test_a_row_written_into_an_empty_buffer_is_judged_on_what_was_written() -> None:
    torch.manual_seed(0)
    quiet = ampdoctor.diagnose(FillsRows(1.0), torch.randn(4, 8), loss_fn=_loss, dtype=FP16, progress=False)
    assert not quiet.findings.hidden  # the buffer's unwritten inf is no op's
    model, x = FillsRows(1e6), torch.randn(4, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=FP16):
        made = int(torch.isinf((model.lin(x)[3].float() * 1e6).half()).sum())
    loud = ampdoctor.diagnose(model, x, loss_fn=_loss, dtype=FP16, progress=False)
    assert [(h.op, h.count) for h in loud.findings.hidden] == [("setitem", made)]
