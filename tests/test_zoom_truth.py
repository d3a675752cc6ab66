"""Op zoom truth: the named op is the one whose non-finite result reaches the bad output (CPU, float16).

Uninitialised memory (``torch.empty``, ``new_empty``, ``empty_like``) never made a value, nor did a cast or copy
of it, nor an input the op ignores (``baddbmm(empty, q, k, beta=0)``); a non-finite value that the call
discards (``torch.where``, ``nan_to_num``, integer indices, never used) is a note, never the op. Uninitialised
bytes are made deterministic here: a dispatch mode below the zoom fills every allocation op's output with
``ctypes.memset``, outside the dispatcher, exactly as stale memory would be: 0xFF is NaN in float16 and
float32; 0x7F is 3.4e38 in float32, which a float16 cast turns into inf (and NaN in float16). Every diagnosis
must give the same report whatever the bytes.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from helpers import assert_untouched, constant_linear, snapshot
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ampdoctor
from ampdoctor.capture.zoom import BackwardZoom, OpZoom
from ampdoctor.capture.zoom_flow import ALLOCATION_OPS
from ampdoctor.records import OpFinding

HERE = Path(__file__).resolve()
GARBAGE = (0x00, 0x7F, 0xFF)  # clean zeros; huge float32 / NaN float16; NaN everywhere


def mean_loss(out: Any, _: Any) -> torch.Tensor:
    return out.float().mean()


def diagnose(model: nn.Module, batch: Any, **kwargs: Any) -> ampdoctor.Report:
    before = snapshot(model)
    report = ampdoctor.diagnose(model, batch, loss_fn=mean_loss, **kwargs)
    assert_untouched(model, before)
    return report


def line_of(code: str) -> int:
    """The line of this file whose text (stripped) starts with ``code``; it must be unique."""
    lines = HERE.read_text(encoding="utf-8").splitlines()
    hits = [n for n, text in enumerate(lines, 1) if text.strip().startswith(code)]
    assert len(hits) == 1, f"{code!r} is on lines {hits}"
    return hits[0]


def assert_at(op: Optional[OpFinding], name: str, code: str) -> OpFinding:
    """The finding names op ``name`` on the line of this file that starts with ``code``."""
    assert op is not None, "the zoom named no op"
    assert op.op == name, f"named {op.op} at {op.location}"
    assert op.location is not None and Path(op.location.file).resolve() == HERE
    assert op.location.line == line_of(code) and op.location.code.startswith(code)
    return op


class StaleMemory(TorchDispatchMode):
    """Every allocation op's output holds ``byte`` everywhere, as memory from a freed tensor would.

    Entered outside the zoom (below it on the mode stack), it runs the real op and fills the bytes with
    ``ctypes.memset``, outside the dispatcher, before the zoom sees the op's output.
    """

    def __init__(self, byte: int) -> None:
        super().__init__()
        self.byte = byte

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if str(func._schema.name) in ALLOCATION_OPS and isinstance(out, torch.Tensor) and out.device.type == "cpu":
            storage = out.untyped_storage()
            ctypes.memset(storage.data_ptr(), self.byte, storage.nbytes())
        return out


def diagnose_with_garbage(make: Callable[[], nn.Module], batch: torch.Tensor) -> list[ampdoctor.Report]:
    """One diagnosis per kind of stale bytes, each on a fresh model."""
    reports = []
    for byte in GARBAGE:
        with StaleMemory(byte):
            reports.append(diagnose(make(), batch))
    return reports


def assert_same_reports(reports: list[ampdoctor.Report]) -> None:
    first = reports[0]
    for other in reports[1:]:
        assert other.verdict == first.verdict
        assert other.findings == first.findings
        assert other.trace == first.trace


# -- allocation ops never make a value ----------------------------------------------------------------------


class FilledBuffers(nn.Module):
    """Allocates three ways and writes every element before reading it: through two strided views (neither
    covers the buffer), a copy, a fill, ``index_put_`` and ``scatter_``. The overflow is ``mixed * mixed``.

    x = ones(2, 8): h = 8 * 40 = 320 per unit (float16); mixed = h; 320 * 320 = 102400 > 65504 -> inf.
    """

    def __init__(self) -> None:
        super().__init__()
        self.proj = constant_linear(8, 8, 40.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        pairs = h.new_empty(h.shape[0], h.shape[1], 2)  # filled by two strided writes: no single one covers it
        pairs[..., 0] = h
        pairs[..., 1] = -h
        copied = torch.empty(h.shape, device=h.device)  # float32, filled by a copy
        copied.copy_(h)
        ones = torch.empty_like(h).fill_(1.0)
        order = torch.arange(h.shape[1] - 1, -1, -1, device=h.device)
        reversed_h = torch.empty_like(h)
        reversed_h[:, order] = h  # index_put_: each column written once
        back = torch.empty_like(h).scatter_(1, order.expand_as(h), reversed_h)  # scatter_: h again
        mixed = pairs.flatten(-2)[..., ::2] * ones + copied.to(h.dtype) * 0 + (back - h)
        return mixed * mixed  # the overflow: 320 * 320


def test_allocations_filled_before_use_are_not_the_op_whatever_the_stale_bytes() -> None:
    reports = diagnose_with_garbage(FilledBuffers, torch.ones(2, 8))
    assert_same_reports(reports)
    for report in reports:
        assert report.verdict == "overflow"
        origin = report.forward_origin
        assert origin is not None and origin.module == ""
        op = assert_at(origin.op, "aten::mul.Tensor", "return mixed * mixed  # the overflow")
        assert op.input_abs_max == (320.0, 320.0) and op.output_posinf_count == 16 and op.output_nan_count == 0
        assert op.discarded == ()


class DiffusersAttention(nn.Module):
    """diffusers' ``get_attention_scores`` without a mask: ``baddbmm(torch.empty(...), q, k^T, beta=0, alpha)``.

    x = ones(1, 4, 16): q = k = gain per unit; scores = 16 * gain**2 * 0.25. gain 200: 160000 -> inf.
    ``empty_dtype=torch.float32``: autocast casts the ignored garbage to float16 first (``aten::_to_copy``).
    """

    def __init__(self, gain: float, empty_dtype: Optional[torch.dtype]) -> None:
        super().__init__()
        self.q = constant_linear(16, 16, gain / 16)
        self.k = constant_linear(16, 16, gain / 16)
        self.scale = 16**-0.5
        self.empty_dtype = empty_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.q(x), self.k(x)
        dtype = self.empty_dtype or q.dtype
        baddbmm_input = torch.empty(q.shape[0], q.shape[1], k.shape[1], dtype=dtype, device=q.device)
        scores = torch.baddbmm(baddbmm_input, q, k.transpose(-1, -2), beta=0, alpha=self.scale)  # the scores
        return scores.softmax(dim=-1) @ q


@pytest.mark.parametrize("empty_dtype", [torch.float32, None], ids=["float32-empty", "float16-empty"])
def test_diffusers_attention_names_baddbmm_every_run(empty_dtype: Optional[torch.dtype]) -> None:
    reports = diagnose_with_garbage(lambda: nn.Sequential(DiffusersAttention(200.0, empty_dtype)), torch.ones(1, 4, 16))
    assert_same_reports(reports)
    for report in reports:
        assert report.verdict == "overflow"
        origin = report.forward_origin
        assert origin is not None and origin.module == "0"
        op = assert_at(origin.op, "aten::baddbmm", "scores = torch.baddbmm(baddbmm_input, q, k.transpose")
        # q and k^T only: the ignored input is no input of the computation
        assert op.input_dtypes == ("float16", "float16") and op.input_abs_max == (200.0, 200.0)
        assert op.output_posinf_count == 16 and op.scalar_args == (0.0, 0.25)
        assert op.discarded == ()


@pytest.mark.parametrize("empty_dtype", [torch.float32, None], ids=["float32-empty", "float16-empty"])
def test_diffusers_attention_with_finite_scores_is_healthy_whatever_the_garbage(
    empty_dtype: Optional[torch.dtype],
) -> None:
    reports = diagnose_with_garbage(lambda: nn.Sequential(DiffusersAttention(1.0, empty_dtype)), torch.ones(1, 4, 16))
    assert_same_reports(reports)
    assert all(r.verdict == "healthy" and r.forward_origin is None for r in reports)


def test_zoom_sees_the_allocation_and_ignores_its_bytes() -> None:
    """Directly under the zoom: the garbage is cast (inf) and ignored by baddbmm; the real overflow is named."""
    q = torch.full((1, 4, 16), 200.0, dtype=torch.float16)
    for byte in GARBAGE:
        zoom = OpZoom("m", 0)
        with StaleMemory(byte), zoom:
            garbage = torch.empty(1, 4, 4)  # float32
            cast = garbage.to(torch.float16)  # 0x7F: 3.4e38 -> inf; 0xFF: NaN
            out = torch.baddbmm(cast, q, q.transpose(-1, -2), beta=0, alpha=0.25)  # zoom: the direct baddbmm
            zoom.finish(out)
        assert_at(zoom.finding, "aten::baddbmm", "out = torch.baddbmm(cast, q, q.transpose(-1, -2), beta=0")
        assert zoom.finding is not None and zoom.finding.discarded == ()
        # Its per-storage flags (a bool per byte of the fresh allocation) are spent once the op is named: the rest
        # of the pass runs without them.
        assert zoom._flow.cells == {}


# -- discarded non-finite values are notes, never the op ---------------------------------------------------


class WhereLogThenExp(nn.Module):
    """x = [0, 1, 2, 3]: log(0) = -inf is discarded by torch.where; h = 6 * 5 = 30, exp(30) = 1.1e13 -> inf."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = constant_linear(4, 4, 5.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        safe_log = torch.where(x > 0, torch.log(x), 0.0)  # log(0) = -inf, discarded
        h = self.proj(x)
        return torch.exp(h) + safe_log  # exp(30): the inf that reaches the output


def test_where_discarded_log_is_a_note_and_exp_is_the_op() -> None:
    report = diagnose(WhereLogThenExp(), torch.tensor([[0.0, 1.0, 2.0, 3.0]]))
    assert report.verdict == "overflow"
    op = assert_at(report.forward_origin.op if report.forward_origin else None, "aten::exp", "return torch.exp(h)")
    assert op.input_abs_max == (30.0,) and op.output_posinf_count == 4
    (log,) = op.discarded
    assert_at(log, "aten::log", "safe_log = torch.where(x > 0, torch.log(x), 0.0)")
    assert log.output_neginf_count == 1 and log.discarded == ()
    assert ampdoctor.Report.from_json(report.to_json(absolute_paths=True)) == report


class NanToNumThenSquare(nn.Module):
    """x / 0 is inf and NaN, replaced by nan_to_num; h = 8 * 40 = 320, h * h = 102400 -> inf."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = constant_linear(8, 8, 40.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ratio = torch.nan_to_num(x / 0.0)  # inf and NaN, replaced by finite numbers
        unused = torch.log(x - x)  # -inf, never used
        del unused
        h = self.proj(x)
        return h * h + ratio * 0  # h * h: the inf that reaches the output


def test_nan_to_num_and_unused_values_are_notes() -> None:
    batch = torch.ones(2, 8)
    batch[0, 0] = 0.0  # 0 / 0 = NaN, 1 / 0 = inf
    report = diagnose(NanToNumThenSquare(), batch)
    assert report.verdict == "overflow"
    origin = report.forward_origin
    assert origin is not None
    op = assert_at(origin.op, "aten::mul.Tensor", "return h * h + ratio * 0")
    assert op.input_abs_max == (320.0, 320.0)
    assert [d.op for d in op.discarded] == ["aten::div.Tensor", "aten::log"]
    assert_at(op.discarded[0], "aten::div.Tensor", "ratio = torch.nan_to_num(x / 0.0)")
    assert_at(op.discarded[1], "aten::log", "unused = torch.log(x - x)")
    assert op.discarded[0].output_nan_count == 1 and op.discarded[0].output_posinf_count == 15


class LogBuckets(nn.Module):
    """T5-style buckets: log(0) = -inf only picks an integer bucket; the overflow is the later h * h."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = constant_linear(8, 8, 40.0)
        self.table = nn.Embedding(4, 8)
        with torch.no_grad():
            self.table.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        position = torch.arange(8, device=x.device).float()
        bucket = (torch.log(position) * 2).long().clamp(0, 3)  # log(0) = -inf becomes an index
        h = self.proj(x + self.table(bucket))
        return h * h  # 320 * 320: the overflow


def test_values_turned_into_indices_are_notes() -> None:
    report = diagnose(LogBuckets(), torch.ones(8, 8))
    origin = report.forward_origin
    assert report.verdict == "overflow" and origin is not None
    op = assert_at(origin.op, "aten::mul.Tensor", "return h * h  # 320 * 320")
    (log,) = op.discarded
    assert_at(log, "aten::log", "bucket = (torch.log(position) * 2).long()")


class MaskedSoftmax(nn.Module):
    """The first query is padding: its whole row is masked with -inf, and softmax of that row is 0/0 = NaN.

    The -inf fill is an intentional constant (a mask), not a made value: softmax is the op that turned a row
    with no finite entry into NaN, and the fix belongs there (leave fully masked rows out, or fill with
    torch.finfo(dtype).min, which softmax turns into a uniform row instead).
    """

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.proj(x)
        padding = torch.zeros_like(scores, dtype=torch.bool)
        padding[0] = True  # every key masked for the first query
        masked = scores.masked_fill(padding, float("-inf"))
        return masked.softmax(dim=-1)  # NaN for the fully masked row


def test_fully_masked_softmax_row_names_the_softmax() -> None:
    torch.manual_seed(0)
    report = diagnose(MaskedSoftmax(), torch.ones(3, 4))
    origin = report.forward_origin
    assert report.verdict == "nan" and origin is not None
    op = assert_at(origin.op, "aten::_softmax", "return masked.softmax(dim=-1)")
    assert op.output_nan_count == 4 and op.output_posinf_count == 0 and op.discarded == ()


# -- in-place ops, views, ops with several outputs -----------------------------------------------------------


class InPlaceScale(nn.Module):
    """h = 8 * 40 = 320 per unit; h * 1000 = 320000 -> inf, written in place (all of h, or a view of it)."""

    def __init__(self, through_view: bool) -> None:
        super().__init__()
        self.proj = constant_linear(8, 8, 40.0)
        self.through_view = through_view

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if self.through_view:
            h[:, :2].mul_(1000.0)  # in place, through a view of h
        else:
            h.mul_(1000.0)  # in place, all of h
        return h.softmax(dim=-1)


@pytest.mark.parametrize("through_view", [False, True], ids=["whole", "view"])
def test_in_place_overflow_is_named_with_its_inputs_before_the_write(through_view: bool) -> None:
    report = diagnose(InPlaceScale(through_view), torch.ones(2, 8))
    origin = report.forward_origin
    assert report.verdict == "overflow" and origin is not None
    code = "h[:, :2].mul_(1000.0)" if through_view else "h.mul_(1000.0)"
    op = assert_at(origin.op, "aten::mul_.Tensor", code)
    assert op.input_abs_max == (320.0,) and op.scalar_args == (1000.0,)  # h as it was before the write
    assert op.output_posinf_count == (4 if through_view else 16) and op.discarded == ()


class VarMean(nn.Module):
    """h alternates +320 and -320: var = 8/7 * 320**2 = 117029 -> inf in float16; the mean (0) is finite."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = constant_linear(8, 8, 40.0)
        with torch.no_grad():
            self.proj.weight[1::2] *= -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        var, mean = torch.var_mean(h, dim=-1)  # two outputs; only var overflows
        return torch.stack([mean, var], dim=-1)


def test_op_with_two_outputs() -> None:
    report = diagnose(VarMean(), torch.ones(2, 8))
    origin = report.forward_origin
    assert report.verdict == "overflow" and origin is not None
    op = assert_at(origin.op, "aten::var_mean.correction", "var, mean = torch.var_mean(h, dim=-1)")
    assert op.output_posinf_count == 2 and op.output_nan_count == 0 and op.input_abs_max == (320.0,)


# -- which output: finish() is told what the call returned --------------------------------------------------


def test_finish_names_the_op_behind_the_first_bad_output() -> None:
    x = torch.full((4,), 300.0, dtype=torch.float16, requires_grad=True)
    told, guessed = OpZoom("m", 0), OpZoom("m", 0)
    saved: list[torch.Tensor] = []
    for zoom in (told, guessed):
        with zoom:
            aux = x * x  # 90000 -> inf, made first, returned second
            out = torch.exp(x)  # inf, returned first
            if zoom is told:
                # the zoom's own reads save nothing for backward (a non-reentrant checkpoint counts them)
                with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                    zoom.finish((out, aux))
    assert saved == []
    # told: the first non-finite output is ``out``; aux reached an output too, so it was not discarded
    assert_at(told.finding, "aten::exp", "out = torch.exp(x)")
    assert told.finding is not None and told.finding.discarded == ()
    # not told: every live value the call left unconsumed counts, and the first op among them is named
    assert_at(guessed.finding, "aten::mul.Tensor", "aux = x * x")


def test_no_finding_when_the_bad_value_is_an_explicit_constant() -> None:
    zoom = OpZoom("m", 0)
    x = torch.ones(4, dtype=torch.float16)
    with zoom:
        discarded = torch.where(x < 0, x.log() - 1 / x.log(), x)  # 1/log(1) = inf: made, then not taken
        out = discarded + torch.full_like(x, float("inf"))  # an inf constant, made by nothing
        zoom.finish(out)
    assert zoom.finding is None


# -- backward: a gradient discarded by a later backward op is not the origin ---------------------------------


class DiscardedGradient(nn.Module):
    """Two untaken exp branches that overflow (h = 4 * 5 = 20: exp(20) -> inf in float16; the fill 50).

    Backward runs ``clipped`` first: its ExpBackward makes 0 * inf = NaN in column 0, which masked_fill's
    backward zeroes (column 0 was filled): discarded. ``safe``'s ExpBackward makes the NaN that reaches
    ``lin.weight``'s gradient.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lin = constant_linear(4, 4, 5.0)
        self.side = constant_linear(4, 4, 0.1)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        safe = torch.where(h < 10, torch.exp(h), h)  # the NaN that reaches the weights
        column0 = torch.zeros_like(x, dtype=torch.bool)
        column0[:, 0] = True
        filled = self.side(x).masked_fill(column0, 50.0)
        clipped = torch.where(filled < 10, torch.exp(filled), 0.0)  # a NaN gradient, discarded
        return self.head(safe + clipped)


def test_backward_zoom_skips_a_gradient_that_a_later_backward_op_discards() -> None:
    torch.manual_seed(0)
    report = diagnose(DiscardedGradient(), torch.ones(2, 4))
    assert report.forward_origin is None and report.verdict == "nan"
    origin = report.backward_origin
    assert origin is not None
    op = assert_at(origin.op, "aten::mul.Tensor", "safe = torch.where(h < 10, torch.exp(h), h)")
    assert op.direction == "backward" and op.node == "ExpBackward0"
    (note,) = op.discarded
    assert_at(note, "aten::mul.Tensor", "clipped = torch.where(filled < 10, torch.exp(filled), 0.0)")
    assert note.node == "ExpBackward0" and note.output_nan_count == 2


def test_backward_zoom_ignores_garbage_gradients() -> None:
    """The incoming gradient comes from allocated memory (stale NaN bytes), then filled: never the op."""
    x = torch.full((4,), 20.0, requires_grad=True)
    zoom = BackwardZoom()
    with StaleMemory(0xFF):
        y = torch.where(x < 10, torch.exp(x.half()).float(), x)  # exp(20) -> inf, untaken
        with zoom:
            grad = torch.empty_like(x).fill_(1.0)  # the gradient, from allocated memory
            (g,) = torch.autograd.grad(y, x, grad)
    assert g.isnan().all()
    assert zoom.finding is not None and zoom.finding.op == "aten::mul.Tensor" and zoom.finding.node == "ExpBackward0"


# -- a real model: T5's log(0) in its relative position buckets only picks an index --------------------------


def test_t5_position_bucket_log_is_a_note_when_zooming_over_the_whole_model() -> None:
    """Zoomed over the whole T5 forward: ``torch.log(relative_position / max_exact)`` makes -inf for position 0
    (turned into an integer bucket), in the encoder and in the decoder; the inf that reaches the loss is wo's
    float16 mm (weights scaled to |w|max 30000: 64 terms of ~1 * ~5000 exceed 65504)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=1, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, attn_implementation="eager",
    )
    model = transformers.T5ForConditionalGeneration(config)
    wo = model.get_submodule("encoder.block.1.layer.1.DenseReluDense.wo")
    with torch.no_grad():
        wo.weight.mul_(30000.0 / wo.weight.abs().max())
    gen = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(2, 64, (2, 12), generator=gen), torch.randint(2, 64, (2, 8), generator=gen)
    zoom = OpZoom("", 0)
    with torch.autocast("cpu", dtype=torch.float16), zoom:
        out = model(input_ids=ids, labels=labels)
        zoom.finish(out.loss)
    assert not torch.isfinite(out.loss)
    op = zoom.finding
    assert op is not None and op.op == "aten::mm" and op.location is not None
    assert op.location.file.endswith("modeling_t5.py") and op.location.code == "hidden_states = self.wo(hidden_states)"
    assert [d.op for d in op.discarded] == ["aten::log", "aten::log"]  # encoder, then decoder
    assert all(d.location is not None and "torch.log(relative_position.float() / max_exact)" in d.location.code
               for d in op.discarded)
    assert zoom.error is None


def test_a_zoom_left_without_finish_names_from_what_outlives_the_call_and_drops_its_flags() -> None:
    zoom = OpZoom("m", 0)
    x = torch.full((4,), 300.0, dtype=torch.float16)
    with zoom:
        out = x * x  # 90,000: inf in float16
    assert_at(zoom.finding, "aten::mul.Tensor", "out = x * x")
    assert zoom._flow.cells == {} and out.isinf().all()
