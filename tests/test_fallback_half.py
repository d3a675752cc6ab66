"""The float32 fallback on a model whose parameters are STORED in float16 (``model.half()``), and a remedy whose
verification re-run raises (never offered as if it worked)."""

from __future__ import annotations

import torch
from helpers import assert_untouched, snapshot
from torch import nn

import ampdoctor
from ampdoctor.fixes.fallback import Fp32Fallback


def _half_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).half()


def test_fallback_of_a_half_module_runs_it_in_float32_and_puts_its_parameters_back() -> None:
    model = _half_mlp()
    x = torch.randn(3, 4, dtype=torch.float16)
    stored = {name: p for name, p in model.named_parameters()}
    before = snapshot(model)
    seen: dict[str, torch.dtype] = {}
    handle = model[0].register_forward_hook(lambda m, a, o: seen.update(out=o.dtype))
    try:
        with Fp32Fallback(model, ["0"]), torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
            assert model[0].weight is stored["0.weight"]  # back in place as soon as the call returned
        out.float().sum().backward()
    finally:
        handle.remove()
    # The module ran in float32 (without the weight cast: "mat1 and mat2 must have the same dtype").
    assert seen == {"out": torch.float32}
    assert {name: p for name, p in model.named_parameters()} == stored  # the same Parameter objects
    assert all(p.dtype == torch.float16 for p in model.parameters())
    # The stored parameters still train: gradients reach them, in their own dtype.
    assert model[0].weight.grad is not None and model[0].weight.grad.dtype == torch.float16
    model.zero_grad(set_to_none=True)
    assert_untouched(model, before)


def test_fallback_puts_the_parameters_back_when_the_forward_raises() -> None:
    model = _half_mlp()
    stored = model[2].weight
    with Fp32Fallback(model, ["2"]):
        try:
            model(torch.randn(3, 5, dtype=torch.float16))  # wrong width: the first Linear raises
        except RuntimeError:
            pass
        try:
            model[2](torch.randn(3, 5))  # wrong width inside the fallback call itself
        except RuntimeError:
            pass
    assert model[2].weight is stored and stored.dtype == torch.float16
    assert "weight" in model[2]._parameters and model[2]._parameters["weight"] is stored


def test_a_remedy_whose_verification_raises_is_not_offered() -> None:
    from ampdoctor.analysis import Findings
    from ampdoctor.fixes.verify import VerifyContext, verify_recommendations
    from ampdoctor.records import Recommendation

    def boom(scale: float) -> object:
        raise RuntimeError("expected m1 and m2 to have the same dtype")

    ctx = VerifyContext(root=nn.Linear(1, 1), modules=[], baseline=None, low_dtype="float16",  # type: ignore[arg-type]
                        run=boom, run_other_dtype=boom)  # type: ignore[arg-type]
    rec = Recommendation(action="bf16", modules=(), title="train in bfloat16", snippet="dtype=torch.bfloat16",
                         verified=False, evidence="", rule="forward_bf16")  # verified by the bfloat16 re-run
    findings = Findings(verdict="overflow", forward_origin=None, backward_origin=None, propagation=(),
                        near_limit=(), underflow=None, scale=None, not_captured=(), warnings=())
    (out,) = verify_recommendations(ctx, findings, [rec], 1.0)
    assert not out.verified
    assert out.evidence == "the verification re-run failed (RuntimeError: expected m1 and m2 to have the same dtype)"
    assert out.snippet.startswith("# not offered: re-running the step with this remedy raised RuntimeError")
    assert out.title.startswith("not offered: train in bfloat16")


def test_diagnose_of_a_half_model_verifies_the_fallback() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)).half()
    with torch.no_grad():
        model[1].weight.fill_(2000.0)  # 4 inputs of ~10 x 2000 -> 8e4: inf in float16, finite in float32
    x = torch.full((2, 4), 10.0, dtype=torch.float16)
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
        model[0].bias.zero_()
    before = snapshot(model)
    report = ampdoctor.diagnose(model, x, loss_fn=lambda o, _: o.float().mean() * 1e-6)
    assert_untouched(model, before)
    assert report.forward_origin is not None and report.forward_origin.module == "1"
    fallback = next(r for r in report.recommendations if r.action == "fp32_fallback")
    assert fallback.modules == ("1",) and fallback.verified, fallback.evidence
