"""Tests that kill the one-line mutants which used to survive the whole fast suite (issue 17, item 4).

Each test's docstring names the mutation it catches. Every mutation was applied by hand and the test seen to fail.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch
from helpers import assert_untouched, constant_linear, snapshot
from torch import nn

import ampdoctor
from ampdoctor.capture.zoom import BackwardZoom
from ampdoctor.cli.fileio import check_output, write_output
from ampdoctor.cli.main import main
from ampdoctor.errors import InvalidInput
from ampdoctor.training.quiet import diagnosing, own_capture

FP16 = torch.float16
INF, NAN = math.inf, math.nan


# -- 1. version counters of parameters a forward writes are set back after each pass ------------------------


class ClampsItsWeight(nn.Module):
    """Clamps its own weight in place in every forward (a weight constraint written as in-place code)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)
        with torch.no_grad():
            self.lin.weight.copy_(torch.linspace(-3, 3, 16).reshape(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.lin.weight.clamp_(-1, 1)
        return self.lin(x)


def test_a_pending_backward_that_saved_the_parameter_itself_runs_after_diagnose() -> None:
    """Mutation: ``StateGuard._restore_params`` restores the values of parameters the forward wrote (``copy_``)
    but no longer sets their version counters back (the ``_unsafe_set_version_counter`` call removed).

    The other tests' pending graphs run under autocast, which saves a float16 *copy* of a weight, never the
    parameter itself, so a moved counter went unnoticed. Here the user's graph saves ``lin.weight`` itself
    (float32 ``w * w``, no autocast): with the counter left moved, its backward raises "one of the variables
    needed for gradient computation has been modified by an inplace operation".
    """
    model = ClampsItsWeight()
    weight = model.lin.weight
    pending = (weight * weight).sum()  # MulBackward0 saves the parameter itself, at its current version
    version = weight._version
    before = snapshot(model)
    report = ampdoctor.diagnose(model, torch.ones(2, 4), device_type="cpu")
    assert_untouched(model, before)
    assert any("writes parameters in place (lin.weight)" in note for note in report.run.notes)
    pending.backward()  # the user's graph: used to raise "modified by an inplace operation"
    assert weight.grad is not None and torch.equal(weight.grad, 2 * torch.linspace(-3, 3, 16).reshape(4, 4))
    assert weight._version == version


# -- 2. the op zoom runs inside the failing call, not call #0 of the same module -------------------------------


class Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x  # overflows in float16 for |x| > 256


class SquaredTwice(nn.Module):
    """``sq`` runs twice. Call #0 squares 1 (finite); ``proj`` makes 4 * 100 = 400; call #1 squares 400 = 160000:
    +inf in float16. The origin is ``sq#1``."""

    def __init__(self) -> None:
        super().__init__()
        self.sq = Square()
        self.proj = constant_linear(4, 4, 100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sq(self.proj(self.sq(x)))


def test_the_op_zoom_follows_the_second_call_of_a_module_called_twice() -> None:
    """Mutation: the detailed re-run zooms on call #0 of the origin's module (``(origin.module, 0)`` in
    ``api.py``, or a recorder matching ``(name, 0)``) instead of the failing call ``origin.call``: the zoom then
    watches the healthy first call, finds nothing, and the report loses its op line."""
    model = SquaredTwice()
    before = snapshot(model)
    report = ampdoctor.diagnose(model, torch.ones(2, 4), loss_fn=lambda out, _: out.float().mean(), device_type="cpu")
    assert_untouched(model, before)
    origin = report.forward_origin
    assert origin is not None and (origin.module, origin.call, origin.label) == ("sq", 1, "sq#1")
    op = origin.op
    assert op is not None and op.op == "aten::mul.Tensor" and (op.module, op.call) == ("sq", 1)
    assert op.input_abs_max == (400.0, 400.0) and op.output_posinf_count == 8
    assert op.location is not None and op.location.code == "return x * x  # overflows in float16 for |x| > 256"
    assert "  op aten::mul.Tensor (float16 |x|max 400, float16 |x|max 400) -> float16" in str(report).splitlines()


# -- 3. the backward zoom's rule: which non-finite inputs mean that an op did not make its output -------------


def _zoom_backward(saved: list[float], grad: list[float], dtype: torch.dtype = torch.float32) -> BackwardZoom:
    """y = x * m with m a constant the forward saved; the zoom watches only the backward of grad -> x.grad,
    which is one op: ``grad * m`` (``aten::mul.Tensor`` of ``MulBackward0``)."""
    x = torch.ones(len(saved), dtype=dtype, requires_grad=True)
    m = torch.tensor(saved, dtype=dtype)
    y = x * m
    g = torch.tensor(grad, dtype=dtype)
    zoom = BackwardZoom()
    with zoom:
        (dx,) = torch.autograd.grad(y, x, g)
    assert not dx.isfinite().all()  # each case's gradient is non-finite: the question is only who made it
    return zoom


@pytest.mark.parametrize(
    ("saved", "grad", "why"),
    [
        ([INF, 1.0], [1.0, 1.0], "+inf in, +inf out"),
        ([-INF, 1.0], [1.0, 1.0], "-inf in, -inf out: a -inf input counts as an inf"),
        ([INF, 1.0], [-1.0, 1.0], "+inf in, -inf out: the sign does not make a new kind"),
        ([NAN, 1.0], [1.0, 1.0], "NaN in, NaN out"),
        ([INF, NAN], [1.0, 1.0], "both kinds in, both out"),
    ],
)
def test_backward_zoom_passing_on_a_non_finite_saved_value_makes_nothing(
    saved: list[float], grad: list[float], why: str
) -> None:
    """Mutations of ``BackwardZoom._creates`` that change which inputs count: ``input_inf`` reading only +inf
    (``f[1]``) or only -inf (``f[2]``), the ``not input_nan`` or ``not input_inf`` test dropped, or infs compared
    by sign. Each makes an op that only passes on a value the forward saved into the origin. It is named only
    as what it is: the node that read a non-finite saved value (``from_saved``), never as the op that made it."""
    zoom = _zoom_backward(saved, grad)
    assert zoom.error is None
    assert zoom.finding is not None and zoom.finding.from_saved, why
    assert zoom.finding.node == "MulBackward0"


@pytest.mark.parametrize(
    ("saved", "grad", "dtype", "nan", "posinf"),
    [
        ([INF, INF], [0.0, 1.0], torch.float32, 1, 1),  # 0 * inf: a NaN, though an inf came in
        ([1000.0, 1.0], [100.0, 1.0], FP16, 0, 1),  # 1000 * 100 = 1e5: an inf from finite values (float16)
        ([1000.0, NAN], [100.0, 1.0], FP16, 1, 1),  # an inf, though a NaN came in
    ],
)
def test_backward_zoom_an_op_makes_a_kind_of_value_none_of_its_inputs_holds(
    saved: list[float], grad: list[float], dtype: torch.dtype, nan: int, posinf: int
) -> None:
    """Mutations of ``BackwardZoom._creates`` the other way: counting any non-finite input (NaN or inf) as the
    reason for any non-finite output (``input_nan`` reading infs too, or one ``input_bad`` for both kinds), or
    ``or`` turned into ``and``. Each loses the op that made the value: ``0 * inf`` (the untaken branch of a
    ``torch.where``) and a float16 product too large for the format."""
    zoom = _zoom_backward(saved, grad, dtype)
    finding = zoom.finding
    assert zoom.error is None and finding is not None
    assert (finding.op, finding.node, finding.direction) == ("aten::mul.Tensor", "MulBackward0", "backward")
    assert (finding.output_nan_count, finding.output_posinf_count, finding.output_neginf_count) == (nan, posinf, 0)
    assert not finding.from_saved  # made here, not passed on


# -- 4. an output inside any folder below an input directory is refused ---------------------------------------


def test_an_output_in_a_sub_folder_of_an_input_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Mutation: ``check_output`` refuses an output only when its parent *is* the input directory
    (``folder == real.parent``) instead of any ancestor (``folder in real.parents``): a report written into
    ``shards/nested/`` would land inside the checkpoint directory the user asked to read."""
    shards = tmp_path / "shards"
    nested = shards / "nested" / "deeper"
    nested.mkdir(parents=True)
    torch.save(nn.Linear(2, 2).state_dict(), shards / "part-0.pt")
    for target in (shards / "nested" / "report.txt", nested / "report.txt"):
        with pytest.raises(InvalidInput, match=f"-o {target}: that is inside the input directory {shards};"):
            check_output(str(target), [shards])
        with pytest.raises(InvalidInput, match="inside the input directory"):
            write_output("text\n", str(target), [shards])
    assert main(["scan", str(shards), "-o", str(nested / "report.txt")]) == 2
    assert "inside the input directory" in capsys.readouterr().err
    assert sorted(str(p.relative_to(shards)) for p in shards.rglob("*")) == [
        "nested", "nested/deeper", "part-0.pt",
    ]
    check_output(str(tmp_path / "report.txt"), [shards])  # beside the directory, not inside it: allowed


# -- 5. the own-capture counter, on its own --------------------------------------------------------------------


def test_own_capture_marks_this_thread_as_diagnosing_and_nests() -> None:
    """Mutation: ``own_capture`` no longer counts (``_local.depth`` left unchanged, or the counter not read
    by ``diagnosing``). Another mechanism (the copy-on-write mode of a ``diagnose``) hid it in the watch tests;
    here nothing else is active, so only the counter can answer."""
    seen: list[bool] = []
    assert not diagnosing(thorough=False) and not diagnosing()
    with own_capture():
        assert diagnosing(thorough=False) and diagnosing()
        with own_capture():
            assert diagnosing(thorough=False)
        assert diagnosing(thorough=False)  # the inner exit leaves the outer capture on
        other = threading.Thread(target=lambda: seen.append(diagnosing(thorough=False)))
        other.start()
        other.join()
    assert seen == [False]  # per thread: a capture here is nothing to another thread's watch
    assert not diagnosing(thorough=False) and not diagnosing()
    with pytest.raises(RuntimeError, match="inside"), own_capture():
        raise RuntimeError("inside")
    assert not diagnosing(thorough=False)  # unwound on an exception too


def test_a_forward_inside_own_capture_is_not_a_micro_batch_of_the_watch() -> None:
    """Mutation: ``own_capture`` made a no-op. A forward run inside it (with no ``diagnose`` on the stack and no
    ampdoctor mode active) would be recorded by the watch: two micro-batches and a non-finite forward on a step
    whose only real forward is finite."""
    model = nn.Sequential(constant_linear(16, 16, 5000.0))  # 16 * 5000 * x: 80000 (+inf) for x = 1
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with ampdoctor.watch(model, scaler, save_bundle=False, stats_every=1) as doctor:
        with own_capture(), torch.autocast("cpu", dtype=FP16):
            assert model(torch.ones(2, 16)).isinf().all()  # ampdoctor's own pass: never training
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            # 16 * 5000 * 0.5 = 40000 per value (finite); the tiny loss keeps the scaled gradients finite
            loss = model(torch.full((2, 16), 0.5)).float().sum() * 1e-7
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    (record,) = doctor.report().steps
    assert record.micro_batches == 1 and record.forward_finite and not record.skipped
    assert record.nonfinite_outputs == ()
    assert record.out_abs_max["0"] == 40000.0
