"""Op-level zoom (forward and backward) and the verification loop of float32 fallbacks (CPU, fp16 and bf16)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_untouched, constant_linear, snapshot
from torch import nn

import ampdoctor


def diagnose(model: nn.Module, batch, **kwargs) -> ampdoctor.Report:  # type: ignore[no-untyped-def]
    before = snapshot(model)
    report = ampdoctor.diagnose(model, batch, **kwargs)
    assert_untouched(model, before)
    return report


# -- forward zoom: ops between child modules ---------------------------------------------------------------


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.left = constant_linear(4, 4, 10000.0)  # 4 * 10000 = 40000: finite in float16
        self.right = constant_linear(4, 4, 10000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.left(x) + self.right(x)  # 40000 + 40000 = 80000: the add overflows, between the children
        return y * 0.5


def test_zoom_names_a_residual_add_between_two_children() -> None:
    report = diagnose(Residual(), torch.ones(1, 4), loss_fn=lambda out, _: out.float().mean())
    origin = report.forward_origin
    assert origin is not None and origin.module == "" and origin.class_name == "Residual"
    assert origin.op is not None and origin.op.op == "aten::add.Tensor"
    assert origin.op.input_abs_max == (40000.0, 40000.0)
    assert origin.op.location is not None
    assert origin.op.location.code.startswith("y = self.left(x) + self.right(x)  # 40000 + 40000")
    # the origin is the whole model's own code: no fallback of the whole model is offered
    assert "fix_code" in [r.action for r in report.recommendations]
    assert not any(r.action == "fp32_fallback" for r in report.recommendations)


class NanScalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + float("nan")  # a NaN operand, not a value an op made: no op is named


def test_root_fix_points_at_the_named_line_only_when_one_is_named() -> None:
    named = diagnose(Residual(), torch.ones(1, 4), loss_fn=lambda out, _: out.float().mean())
    fix = next(r for r in named.recommendations if r.action == "fix_code")
    assert fix.snippet.endswith("# the line named above")
    torch.manual_seed(0)
    report = diagnose(NanScalar(), torch.randn(4, 8))
    origin = report.forward_origin
    assert origin is not None and origin.module == "" and origin.op is None
    fix = next(r for r in report.recommendations if r.action == "fix_code")
    assert "named above" not in fix.snippet  # the report names no line
    assert "the op in NanScalar.forward that makes the value" in fix.snippet


class SquareNorm(nn.Module):
    """A custom energy norm: x * x overflows in float16 for |x| > 256, and inf / inf is NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        power = x * x
        return power / power.sum(-1, keepdim=True)


def test_zoom_names_x_times_x_in_a_custom_norm() -> None:
    model = nn.Sequential()
    model.add_module("proj", constant_linear(8, 8, 40.0))  # 8 * 40 = 320 per unit, in float16
    model.add_module("norm", SquareNorm())
    model.add_module("head", nn.Linear(8, 2))
    report = diagnose(model, torch.ones(2, 8), loss_fn=lambda out, _: out.float().mean())
    origin = report.forward_origin
    assert origin is not None and origin.module == "norm"
    assert origin.op is not None and origin.op.op == "aten::mul.Tensor"
    assert origin.op.location is not None and origin.op.location.code == "power = x * x"
    assert origin.op.input_abs_max == (320.0, 320.0)  # 320 * 320 = 102400 > 65504


def test_mask_constant_too_large_for_float16() -> None:
    class MaskedScores(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scores = self.proj(x)
            mask = torch.zeros_like(scores, dtype=torch.bool)
            mask[..., -1] = True
            return torch.where(mask, -1e9, scores)  # -1e9 is -inf in float16

    report = diagnose(MaskedScores(), torch.ones(2, 4), loss_fn=lambda out, _: out.float().clamp(min=-1).mean())
    origin = report.forward_origin
    # torch.where(mask, scalar, t) makes the scalar a float16 tensor first: that is where -1e9 becomes -inf
    assert origin is not None and origin.op is not None and origin.op.op == "aten::scalar_tensor"
    assert -1e9 in origin.op.scalar_args
    assert report.recommendations[0].action == "mask_constant"
    assert "torch.finfo(scores.dtype).min" in report.recommendations[0].snippet


# -- backward zoom -----------------------------------------------------------------------------------------


class WhereExp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = constant_linear(4, 4, 5.0)  # 4 * 5 = 20; exp(20) = 4.9e8: inf in float16
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        safe = torch.where(h < 10, torch.exp(h), h)  # the untaken branch overflows; its backward makes 0 * inf
        return self.head(safe)


def test_backward_zoom_names_the_forward_line_of_a_where_with_an_overflowing_branch() -> None:
    report = diagnose(WhereExp(), torch.ones(2, 4), loss_fn=lambda out, _: out.float().mean())
    assert report.forward_origin is None  # the forward output is finite
    assert report.verdict == "nan"
    assert report.findings.scale is not None and report.findings.scale.largest_finite_scale is None
    origin = report.backward_origin
    assert origin is not None and origin.module == "" and origin.op is not None
    op = origin.op
    assert op.direction == "backward" and op.node == "ExpBackward0" and op.op == "aten::mul.Tensor"
    assert op.location is not None and op.location.file.endswith("test_zoom_and_verify.py")
    assert op.location.code.startswith("safe = torch.where(h < 10, torch.exp(h), h)")


# -- verification loop -------------------------------------------------------------------------------------


class TwoOrigins(nn.Module):
    """first: 8 * 1e4 = 80000 (inf in fp16). In float32 it hands 80000 to second, whose float16 input cast
    overflows next; second's weight 1e-4 brings it back to 8 * 80000 * 1e-4 = 64. rest stays in float16."""

    def __init__(self) -> None:
        super().__init__()
        self.first = constant_linear(8, 8, 1e4)
        self.second = constant_linear(8, 8, 1e-4)
        self.rest = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rest(self.second(self.first(x)))


def test_verification_loop_finds_exactly_the_two_origins() -> None:
    model = TwoOrigins()
    report = diagnose(model, torch.ones(2, 8), loss_fn=lambda out, _: out.float().mean())
    assert report.forward_origin is not None and report.forward_origin.module == "first"
    fallback = next(r for r in report.recommendations if r.action == "fp32_fallback")
    assert fallback.modules == ("first", "second")
    assert fallback.verified
    assert "forward and backward finite" in fallback.evidence
    assert fallback.cost is not None and 0 < fallback.cost.fp32_matmul_flop_share < 1
    # Apply it ourselves: finite, and every module outside the set still runs in float16.
    dtypes: dict[str, torch.dtype] = {}
    handles = [
        m.register_forward_hook(lambda mod, i, o, name=name: dtypes.__setitem__(name, o.dtype))
        for name, m in model.rest.named_modules(prefix="rest")
    ]
    with ampdoctor.fp32_fallback(model, fallback.modules), torch.autocast("cpu", dtype=torch.float16):
        out = model(torch.ones(2, 8))
    for handle in handles:
        handle.remove()
    assert torch.isfinite(out).all()
    assert dtypes == {"rest": torch.float16, "rest.0": torch.float16, "rest.1": torch.float16, "rest.2": torch.float16}


def test_verification_refuses_to_claim_a_fix_for_an_inf_batch() -> None:
    batch = torch.ones(2, 8)
    batch[0, 0] = float("inf")
    report = diagnose(TwoOrigins(), batch)
    assert report.forward_origin is not None and report.forward_origin.module == "<batch>"
    assert [r.action for r in report.recommendations] == ["fix_batch"]
    assert not any(r.verified for r in report.recommendations)


def test_weights_already_inf_are_not_fixed_by_a_fallback() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with torch.no_grad():
        model[1].weight[0, 0] = float("inf")
    report = diagnose(model, torch.ones(2, 4), loss_fn=lambda out, _: out.float().mean())
    assert report.forward_origin is not None and report.forward_origin.module == "1"
    assert [r.action for r in report.recommendations] == ["fix_weights"]  # said plainly; no fallback offered
    assert report.recommendations[0].modules == ("1",) and "1.weight" in report.recommendations[0].title
    assert report.modules[2].params[0].stats.posinf_count == 1  # the weight itself is reported


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fallback_handle_restores_parameters_hooks_and_forward(dtype: torch.dtype) -> None:
    model = TwoOrigins()
    hook = model.first.register_forward_hook(lambda m, i, o: None)
    forwards = {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    before = snapshot(model)
    handle = ampdoctor.fp32_fallback(model, ["first", "rest.0"])
    with torch.autocast("cpu", dtype=dtype):
        assert model.first(torch.ones(1, 8, dtype=dtype)).dtype == torch.float32
        assert model.rest[2](torch.ones(1, 8)).dtype == dtype
    handle.remove()
    assert {name: m.__dict__.get("forward") for name, m in model.named_modules()} == forwards
    assert model.first._forward_hooks and list(model.first._forward_hooks.values())[0] is hook.hooks_dict_ref()[hook.id]  # type: ignore[attr-defined,index]
    hook.remove()
    after = snapshot(model)
    assert after.state == before.state


def test_bfloat16_remedy_is_verified_by_a_bf16_rerun() -> None:
    report = diagnose(TwoOrigins(), torch.ones(2, 8), loss_fn=lambda out, _: out.float().mean())
    bf16 = next(r for r in report.recommendations if r.action == "bf16")
    assert bf16.verified and "bfloat16" in bf16.evidence


# -- bfloat16: the same zooms where its (float32-like) range is exceeded ------------------------------------


class WideMatmul(nn.Module):
    def __init__(self, gain: float) -> None:
        super().__init__()
        self.q = constant_linear(16, 16, gain / 16)  # x = 1 -> q = k = gain per unit
        self.k = constant_linear(16, 16, gain / 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-2, -1)  # 16 * gain**2
        return scores.softmax(-1)


def test_bfloat16_forward_zoom() -> None:
    # 16 * (1e19)**2 = 1.6e39 > 3.39e38, the bfloat16 max; q and k themselves (1e19) fit.
    report = diagnose(nn.Sequential(WideMatmul(1e19)), torch.ones(1, 4, 16), dtype=torch.bfloat16)
    origin = report.forward_origin
    assert report.verdict == "overflow" and origin is not None and origin.module == "0"
    assert origin.op is not None and origin.op.op == "aten::bmm" and origin.op.input_dtypes == ("bfloat16",) * 2
    assert origin.op.location is not None and "self.q(x) @ self.k(x)" in origin.op.location.code
    assert report.run.scale == 1.0 and report.run.limits.dtype == "bfloat16"


def test_bfloat16_backward_zoom() -> None:
    model = WhereExp()
    with torch.no_grad():
        model.lin.weight.fill_(25.0)  # h = 100; exp(100) = 2.7e43: inf in bfloat16 (and float32)
    report = diagnose(model, torch.ones(2, 4), loss_fn=lambda out, _: out.float().mean(), dtype=torch.bfloat16)
    origin = report.backward_origin
    assert report.forward_origin is None and origin is not None and origin.op is not None
    assert origin.op.node == "ExpBackward0" and origin.op.op == "aten::mul.Tensor"
    assert origin.op.location is not None and origin.op.location.code.startswith("safe = torch.where(")


def test_fallback_verified_when_norms_after_it_follow_its_float32_output() -> None:
    # conv: 3 * 9 * 3000 = 81000 > 65504. In float32 its output feeds BatchNorm and ReLU, which follow their
    # input dtype under autocast: that is expected, not a module whose autocast was switched off.
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, bias=False)
    with torch.no_grad():
        conv.weight.fill_(3000.0)
    model = nn.Sequential(conv, nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))
    report = diagnose(model, torch.ones(2, 3, 8, 8), loss_fn=lambda out, _: out.float().mean())
    assert report.forward_origin is not None and report.forward_origin.module == "0"
    fallback = next(r for r in report.recommendations if r.action == "fp32_fallback")
    assert fallback.modules == ("0",) and fallback.verified
    assert "ran on its float32 output (1, 2)" in fallback.evidence
