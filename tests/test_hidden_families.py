"""Hidden overflows of every shape we know: a float16 op makes inf from finite values inside a module, a later op
hides it, the module's output is finite. Each tiny model runs real CPU float16 autocast; ``diagnose`` must not say
HEALTHY and must name the module, the op, its line and what hid the values.

Arithmetic shared by the models: ``fc`` (weights scaled to give |h| up to ~6 on this batch) feeds ``h * 60000``,
which is inf wherever |h| > 65520 / 60000 = 1.092 (float16's rounding edge); the hiding op brings everything back
into range and ``/ 60000`` keeps the output (and so the backward) small.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_untouched, snapshot
from torch import nn

import ampdoctor

BIG = 60000.0  # fits float16; |h| > 1.092 times it does not


class _Custom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor) -> torch.Tensor:
        return torch.clamp(h * BIG, -BIG, BIG)  # hidden in a custom Function's own forward

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _clamp(h: torch.Tensor) -> torch.Tensor:
    return torch.clamp(h * BIG, -BIG, BIG)


def _nan_to_num(h: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(h * BIG, posinf=BIG, neginf=-BIG)


def _where_isinf(h: torch.Tensor) -> torch.Tensor:
    y = h * BIG
    return torch.where(torch.isinf(y), torch.zeros_like(y), y)


def _masked_fill(h: torch.Tensor) -> torch.Tensor:
    y = h * BIG
    return y.masked_fill(~torch.isfinite(y), 0.0)


def _amax(h: torch.Tensor) -> torch.Tensor:
    y = -(h * h) * BIG
    return torch.stack([y, torch.zeros_like(y)]).amax(0)  # the max of (-inf, 0) is 0: the -inf is ignored


def _softmax(h: torch.Tensor) -> torch.Tensor:
    return (-(h * h) * BIG).softmax(-1) * BIG  # -inf scores become 0 probabilities


def _custom_function(h: torch.Tensor) -> torch.Tensor:
    return _Custom.apply(h)


def _no_grad(h: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        gate = torch.clamp(h * BIG, -BIG, BIG)
    return h * 1000.0 + gate * 0


def _aten(h: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.clamp(torch.ops.aten.mul.Scalar(h, BIG), -BIG, BIG)


def _mul_inplace(h: torch.Tensor) -> torch.Tensor:
    y = h.clone()
    y.mul_(BIG)
    return y.clamp_(-BIG, BIG)


def _pow_inplace(h: torch.Tensor) -> torch.Tensor:
    y = h * 300.0  # |y| up to ~1800: y**2 is inf beyond 256
    y.pow_(2)
    return y.clamp_(max=BIG) / 300.0


def _iadd(h: torch.Tensor) -> torch.Tensor:
    y = h * 8000.0  # fits (|h| < 8.2); twice it does not where |h| > 4.1
    y += h * 8000.0
    return y.clamp(-BIG, BIG)


def _view_inplace(h: torch.Tensor) -> torch.Tensor:
    y = h.clone()
    y[:, :4].mul_(BIG)  # written through a view: the clamp of the base hides it
    return y.clamp(-BIG, BIG)


def _where_fill_minus_1e9(h: torch.Tensor) -> torch.Tensor:
    return torch.where(h > 0, h, -1e9).softmax(-1) * BIG  # -1e9 cannot be float16: -inf, softmax hides it


def _setitem_minus_1e9(h: torch.Tensor) -> torch.Tensor:
    y = h.clone()
    y[h < 0] = -1e9
    return y.softmax(-1) * BIG


def _int_cast(h: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(h.shape[-1], device=h.device) * 10000  # int64: 0 .. 70000
    gate = torch.sigmoid(positions.to(h.dtype).clamp(max=BIG))  # 70000 -> inf in float16, the clamp hides it
    return h * gate * 1000.0


def _tensor_constant(h: torch.Tensor) -> torch.Tensor:
    fill = torch.tensor(-1e9, dtype=h.dtype, device=h.device)  # -inf in float16, silently
    return torch.where(h > 0, h, fill).softmax(-1) * BIG


# case: (hide, op the watch names, the hiding op, text on the line)
CASES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str, str, str]] = {
    "clamp": (_clamp, "mul", "clamp", "torch.clamp(h * BIG"),
    "nan_to_num": (_nan_to_num, "mul", "nan_to_num", "nan_to_num(h * BIG"),
    "where_isinf": (_where_isinf, "mul", "where", "y = h * BIG"),
    "masked_fill": (_masked_fill, "mul", "masked_fill", "y = h * BIG"),
    "amax": (_amax, "mul", "amax", "y = -(h * h) * BIG"),
    "softmax": (_softmax, "mul", "softmax", "(-(h * h) * BIG).softmax"),
    "custom_function": (_custom_function, "mul", "clamp", "torch.clamp(h * BIG"),
    "no_grad": (_no_grad, "mul", "clamp", "gate = torch.clamp(h * BIG"),
    "torch_ops_aten": (_aten, "mul", "clamp", "torch.ops.aten.mul.Scalar"),
    "mul_inplace": (_mul_inplace, "mul", "clamp", "y.mul_(BIG)"),
    "pow_inplace": (_pow_inplace, "pow", "clamp", "y.pow_(2)"),
    "iadd": (_iadd, "add", "clamp", "y += h * 8000.0"),
    "view_inplace": (_view_inplace, "mul", "clamp", "y[:, :4].mul_(BIG)"),
    "where_fill_minus_1e9": (_where_fill_minus_1e9, "where", "softmax", "torch.where(h > 0, h, -1e9)"),
    "int_cast": (_int_cast, "to", "clamp", "positions.to(h.dtype)"),
    "tensor_constant": (_tensor_constant, "tensor", "softmax", "torch.tensor(-1e9, dtype=h.dtype"),
    "setitem_minus_1e9": (_setitem_minus_1e9, "setitem", "softmax", "y[h < 0] = -1e9"),
}


class Hider(nn.Module):
    def __init__(self, hide: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.hide = hide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hide(self.fc(x)) / BIG


class Net(nn.Module):
    def __init__(self, hide: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.block = Hider(hide)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def _case(name: str) -> tuple[Net, torch.Tensor]:
    torch.manual_seed(0)
    model = Net(CASES[name][0])
    with torch.no_grad():
        model.block.fc.weight.mul_(3.0)
    return model, torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", sorted(CASES))
def test_premise_the_op_makes_inf_and_the_block_output_is_finite(name: str) -> None:
    model, x = _case(name)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        h = model.block.fc(x)
        out = model(x)
    assert h.dtype == torch.float16 and float(h.abs().max()) > 1.1
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_hidden_overflow_is_named_with_its_module_op_line_and_hider(name: str) -> None:
    model, x = _case(name)
    _, op, hider, code = CASES[name]
    before = snapshot(model)
    report = ampdoctor.diagnose(model, x)
    assert_untouched(model, before)
    assert report.verdict == "hidden_overflow", report.to_text()
    found = [(h.module, h.op, h.hidden_by) for h in report.findings.hidden]
    assert found == [("block", op, hider)], report.to_text()
    (hidden,) = report.findings.hidden
    assert hidden.classified and hidden.count is not None and hidden.count > 0 and hidden.sentinels == 0
    assert hidden.location is not None and code in hidden.location.code, hidden.location


def test_intentional_fills_beside_the_minus_1e9_fill_stay_sentinels() -> None:
    """`where(mask, x, -inf)` and `where(mask, x, finfo.min)` write sentinels; only the -1e9 fill is an overflow."""

    def fills(h: torch.Tensor) -> torch.Tensor:
        low = torch.finfo(h.dtype).min
        a = torch.where(h > 0, h, float("-inf")).softmax(-1)
        b = torch.where(h > 0, h, low).softmax(-1)
        c = torch.where(h > 0, h, -1e9).softmax(-1)
        return (a + b + c) * BIG

    torch.manual_seed(0)
    model = Net(fills)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    report = ampdoctor.diagnose(model, x)
    assert [(h.op, h.location.code.strip() if h.location else "") for h in report.findings.hidden] == [
        ("where", "c = torch.where(h > 0, h, -1e9).softmax(-1)")
    ], report.to_text()


def test_an_additive_finfo_min_mask_through_torch_ops_aten_stays_a_sentinel() -> None:
    """`torch.ops.aten.add.Tensor(scores, mask)` is the same arithmetic as `scores + mask`: where the mask holds
    finfo.min, the -inf is mask arithmetic (a sentinel), not an overflow."""

    def masked(h: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros_like(h).masked_fill(h < 0, torch.finfo(h.dtype).min)
        return torch.ops.aten.add.Tensor(h * 100.0, mask).softmax(-1) * BIG

    torch.manual_seed(0)
    model = Net(masked)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        h = model.block.fc(x)
        assert torch.isinf(h * 100.0 + torch.zeros_like(h).masked_fill(h < 0, -65504.0)).any()  # it does overflow
    report = ampdoctor.diagnose(model, x)
    assert report.findings.hidden == () and report.verdict == "healthy", report.to_text()


def test_minus_1e9_scalar_is_an_overflow_but_a_finfo_min_scalar_is_mask_arithmetic() -> None:
    """`(1 - m) * -1e9` makes -inf from a constant float16 cannot hold; `(1 - m) * finfo.min` is finite; and
    `(scores - 1) + m * finfo.min` overflows only where an operand is at the max (mask arithmetic)."""

    def arith(h: torch.Tensor) -> torch.Tensor:
        m = (h < 0).to(h.dtype)
        a = (h * 100.0 + m * torch.finfo(h.dtype).min).softmax(-1)  # sentinel arithmetic (-inf where h < -0.16)
        b = (h + (1.0 - m) * -1e9).softmax(-1)  # the constant overflows
        return (a + b) * BIG

    torch.manual_seed(0)
    model = Net(arith)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    report = ampdoctor.diagnose(model, x)
    found = [(h.op, h.location.code.strip() if h.location else "") for h in report.findings.hidden]
    assert found == [("mul", "b = (h + (1.0 - m) * -1e9).softmax(-1)  # the constant overflows")], report.to_text()
    assert report.verdict == "hidden_overflow"


def test_f_softmax_of_float16_scores_under_a_module_is_seen() -> None:
    """F.softmax spelled functionally, scores made -inf by a square: the same finding as Tensor.softmax."""

    def scores(h: torch.Tensor) -> torch.Tensor:
        return F.softmax(-(h * h) * BIG, dim=-1) * BIG

    torch.manual_seed(0)
    model = Net(scores)
    with torch.no_grad():
        model.block.fc.weight.mul_(3.0)
    report = ampdoctor.diagnose(model, torch.randn(4, 8, generator=torch.Generator().manual_seed(1)))
    assert [(h.module, h.op, h.hidden_by) for h in report.findings.hidden] == [("block", "mul", "softmax")]


def test_known_limit_a_write_through_data_is_found_but_its_hider_is_not_seen() -> None:
    """Pins a limit (README, "What it cannot see"): `y.data` is an alias, not a view, so the clamp that later reads
    `y` is not known to read the mul_'s values. The overflow is still found, named and counted; only `hidden_by`
    reads "not visible in the module's output"."""

    def through_data(h: torch.Tensor) -> torch.Tensor:
        y = h.clone()
        y.data.mul_(BIG)
        return y.clamp(-BIG, BIG)

    torch.manual_seed(0)
    model = Net(through_data)
    with torch.no_grad():
        model.block.fc.weight.mul_(3.0)
    report = ampdoctor.diagnose(model, torch.randn(4, 8, generator=torch.Generator().manual_seed(1)))
    assert report.verdict == "hidden_overflow", report.to_text()
    assert [(h.module, h.op, h.hidden_by) for h in report.findings.hidden] == [
        ("block", "mul", ampdoctor.analysis.NOT_VISIBLE)
    ]


class _MaskedScores(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) * 10000.0 + mask).softmax(-1)


class _MaskedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.att = _MaskedScores()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.att(x, mask))


def test_an_overflow_in_the_same_add_as_an_intentional_minus_inf_mask_is_found() -> None:
    """`scores + mask`: the mask (an input) brings its own -inf (key 0), and the same add makes -inf at other
    elements (-60000 plus scores below -5520), which softmax hides. The survey's reduction of the output where the
    mask is finite tells them apart; the re-run counts only the made ones (3), not the mask's 4."""
    torch.manual_seed(0)
    model = _MaskedNet()
    with torch.no_grad():
        model.att.fc.weight.mul_(3.0)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    mask = torch.full((8,), -60000.0)
    mask[4:] = 0.0
    mask[0] = float("-inf")  # the intentional mask: key 0 is never attended
    mask = mask.half()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        scores = model.att.fc(x) * 10000.0
        assert torch.isfinite(scores).all()
        made = torch.isinf(scores + mask) & torch.isfinite(mask)
        assert int(made.sum()) == 3  # real overflows, beside the mask's 4 (one per row)
        assert torch.isfinite(model(x, mask)).all()
    before = snapshot(model)
    report = ampdoctor.diagnose(model, (x, mask))
    assert_untouched(model, before)
    assert report.verdict == "hidden_overflow", report.to_text()
    assert [(h.module, h.op, h.hidden_by, h.count) for h in report.findings.hidden] == [("att", "add", "softmax", 3)]
    (hidden,) = report.findings.hidden
    assert hidden.location is not None and "self.fc(x) * 10000.0 + mask" in hidden.location.code


def test_an_intentional_minus_inf_mask_alone_is_not_an_overflow() -> None:
    """The same model with scores that fit beside the mask: the add only passes the mask's -inf on (HEALTHY)."""
    torch.manual_seed(0)
    model = _MaskedNet()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(8)
    mask[0] = float("-inf")
    mask[1] = torch.finfo(torch.float16).min  # a finfo.min key beside it: mask arithmetic where the sum overflows
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        scores = model.att.fc(x) * 10000.0
        assert torch.isfinite(scores).all() and torch.isinf(scores + mask.half())[:, 1].any()
    report = ampdoctor.diagnose(model, (x, mask.half()))
    assert report.findings.hidden == () and report.verdict == "healthy", report.to_text()


def test_known_limit_arithmetic_on_a_computed_value_at_the_max_counts_as_mask_arithmetic() -> None:
    """Pins a limit (README, "What it cannot see"): per element, an operand at float16's max is taken for an
    additive `finfo.min` mask, whatever made it. A computed value that rounds to 65504 and is then doubled makes
    inf that is counted as a sentinel, and the clamp hides it: HEALTHY."""

    def at_the_max(h: torch.Tensor) -> torch.Tensor:
        y = h * 0.0 + 65500.0  # rounds to 65504, float16's max, computed (not a fill)
        return (y * 2.0).clamp(max=BIG) / BIG * h

    torch.manual_seed(0)
    model = Net(at_the_max)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        h = model.block.fc(x)
        assert float((h * 0.0 + 65500.0).max()) == 65504.0 and torch.isinf((h * 0.0 + 65500.0) * 2.0).all()
    report = ampdoctor.diagnose(model, x)
    assert report.findings.hidden == () and report.verdict == "healthy"  # the limit: should be hidden_overflow


class _BaddbmmScores(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)  # (1, 4, 8)
        return torch.baddbmm(mask, h * 100.0, h.transpose(1, 2) * -100.0).softmax(-1)


class _BaddbmmNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.att = _BaddbmmScores()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.att(x, mask))


def test_known_limit_baddbmm_onto_an_intentional_minus_inf_mask_passes_it_on() -> None:
    """Pins a limit (README, "What it cannot see"): `baddbmm(mask, q, k)` is not elementwise arithmetic, so with
    the mask's own -inf among its inputs it counts as passing it on; the -inf it makes beside it (-60000 plus
    scores below -5520) is not seen and softmax hides it: HEALTHY."""
    torch.manual_seed(0)
    model = _BaddbmmNet()
    x = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(1))
    mask = torch.full((1, 4, 4), -60000.0)
    mask[..., 0] = float("-inf")
    mask = mask.half()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        h = model.att.fc(x)
        scores = torch.baddbmm(mask, h * 100.0, h.transpose(1, 2) * -100.0)
        assert scores.dtype == torch.float16 and torch.isfinite((h * 100.0) @ (h.transpose(1, 2) * -100.0)).all()
        assert bool((torch.isinf(scores) & torch.isfinite(mask)).any())  # made beside the mask's own -inf
        assert torch.isfinite(model(x, mask)).all()
    report = ampdoctor.diagnose(model, (x, mask))
    assert report.findings.hidden == () and report.verdict == "healthy"  # the limit: should be hidden_overflow
