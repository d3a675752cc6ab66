"""End-to-end ``diagnose`` on tiny models that carry their expected answer (CPU, float16 and bfloat16)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_untouched, constant_linear, snapshot
from torch import nn

import ampdoctor
from ampdoctor.records import LOSS

FP16 = torch.float16
BF16 = torch.bfloat16


def run(model: nn.Module, batch, **kwargs) -> ampdoctor.Report:  # type: ignore[no-untyped-def]
    """diagnose, and check that nothing the user owns changed."""
    before = snapshot(model)
    report = ampdoctor.diagnose(model, batch, **kwargs)
    assert_untouched(model, before)
    # the report survives a JSON round trip unchanged
    assert ampdoctor.Report.from_json(report.to_json()).to_json() == report.to_json()
    return report


# -- forward origins ---------------------------------------------------------------------------------------


def test_origin_in_a_leaf_linear() -> None:
    # input ones(2, 16); "boom" has weight 5000: 16 * 5000 = 80000 > 65504 -> inf in float16.
    # "pre" is the identity-ish 0.5 * 16 = 8 per unit ... kept small: weight 1/16 -> output exactly 1.
    model = nn.Sequential()
    model.add_module("pre", constant_linear(16, 16, 1 / 16))
    model.add_module("boom", constant_linear(16, 16, 5000.0))
    model.add_module("post", nn.Linear(16, 4))
    report = run(model, torch.ones(2, 16))
    assert report.verdict == "overflow"
    origin = report.forward_origin
    assert origin is not None and (origin.module, origin.call) == ("boom", 0)
    assert origin.class_name == "Linear"
    assert origin.bad.posinf_count == 2 * 16  # every output: 80000 rounds to +inf
    assert origin.input_abs_max == 1.0
    assert origin.op is not None and origin.op.op == "aten::mm"  # a bias-free Linear: x @ W.T
    assert origin.op.location is None  # nn.Sequential/nn.Linear have no user line; never the caller's line
    assert report.findings.propagation == ("post", "<root>")
    # verified: boom in float32 hands 80000 to post, whose float16 input cast overflows next: both are needed
    assert report.recommendations[0].action == "fp32_fallback"
    assert report.recommendations[0].modules == ("boom", "post")
    assert report.recommendations[0].verified
    assert report.exit_code == 1


class OwnMatmulAttention(nn.Module):
    """q @ k.T in the module's own forward: the overflow is in no child."""

    def __init__(self, width: int, gain: float) -> None:
        super().__init__()
        self.q = constant_linear(width, width, gain / width)
        self.k = constant_linear(width, width, gain / width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.q(x), self.k(x)
        scores = q @ k.transpose(-2, -1)  # the line the zoom must name
        return self.out(scores.softmax(-1) @ x)


def test_origin_inside_a_modules_own_forward() -> None:
    # x = ones(1, 4, 16); q = k = 300 per unit (gain 300); q . k = 16 * 300 * 300 = 1.44e6 -> inf.
    model = nn.Sequential(OwnMatmulAttention(16, 300.0))
    report = run(model, torch.ones(1, 4, 16))
    assert report.verdict == "overflow"
    origin = report.forward_origin
    assert origin is not None and origin.module == "0" and origin.class_name == "OwnMatmulAttention"
    assert origin.op is not None and origin.op.op == "aten::bmm"  # q @ k.T on 3-D tensors
    assert origin.op.location is not None and origin.op.location.code.startswith("scores = q @ k.transpose")
    assert origin.op.location.file.endswith("test_api.py")
    assert origin.op.input_abs_max == (300.0, 300.0)
    # the child that receives the NaN is propagation, not the origin
    assert "0.out" in report.findings.propagation


def test_origin_deep_in_a_modulelist() -> None:
    class Deep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stages = nn.ModuleList(
                nn.ModuleList(nn.Sequential(constant_linear(8, 8, 1 / 8), nn.ReLU()) for _ in range(3))
                for _ in range(2)
            )
            with torch.no_grad():
                self.stages[1][2][0].weight.fill_(1e5)  # 8 * 1e5 > 65504

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for stage in self.stages:
                for block in stage:
                    x = block(x)
            return x

    report = run(Deep(), torch.ones(2, 8))
    assert report.forward_origin is not None
    assert report.forward_origin.module == "stages.1.2.0"
    assert report.findings.propagation == ("stages.1.2.1", "stages.1.2", "<root>")


def test_module_called_twice_names_the_second_call() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = constant_linear(8, 8, 40.0)  # x -> 320 x per call

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.shared(self.shared(x))  # 1 -> 320 -> 102400 (> 65504)

    report = run(Twice(), torch.ones(1, 8))
    origin = report.forward_origin
    assert origin is not None and (origin.module, origin.call) == ("shared", 1)
    assert origin.label == "shared#1"
    assert origin.input_abs_max == 320.0


def test_growing_stream_overflows_at_a_late_layer() -> None:
    # Each layer multiplies by 8 * 2 = 16 (weight 2, width 8); input 1: layer i outputs 16**(i+1).
    # 16**3 = 4096, 16**4 = 65536 > 65504: the 4th layer (index 3) is the first to overflow.
    model = nn.Sequential(*[constant_linear(8, 8, 2.0) for _ in range(6)])
    report = run(model, torch.ones(1, 8))
    assert report.forward_origin is not None and report.forward_origin.module == "3"
    assert report.findings.propagation == ("4", "5", "<root>")


def test_batch_with_nan_is_named_and_stops_there() -> None:
    batch = torch.ones(2, 4)
    batch[1, 2] = float("nan")
    report = run(nn.Linear(4, 4), batch)
    assert report.verdict == "nan"
    assert report.forward_origin is not None and report.forward_origin.module == "<batch>"
    assert [r.action for r in report.recommendations] == ["fix_batch"]


def test_nan_made_by_the_loss_function() -> None:
    # relu(-1) = 0 exactly; the entropy-style loss computes 0 * log(0) = 0 * -inf = NaN.
    model = nn.Sequential(constant_linear(4, 4, -1.0), nn.ReLU())

    def entropy(out: torch.Tensor, _batch: torch.Tensor) -> torch.Tensor:
        p = out.float()
        return (p * torch.log(p)).sum()

    report = run(model, torch.ones(2, 4), loss_fn=entropy)
    assert report.verdict == "nan"
    origin = report.forward_origin
    assert origin is not None and origin.module == LOSS
    assert origin.op is not None and origin.op.op == "aten::log"
    assert origin.op.location is not None and "torch.log(p)" in origin.op.location.code
    assert report.recommendations[0].action == "fix_loss"


# -- backward ----------------------------------------------------------------------------------------------


def _backward_model(gain: float) -> nn.Sequential:
    model = nn.Sequential()
    model.add_module("pre", constant_linear(64, 64, 1e-4))
    model.add_module("big", constant_linear(64, 64, gain))
    return model


def test_backward_only_overflow_is_a_defect_even_at_scale_1() -> None:
    # Forward: pre gives 64 * 1e-4 = 0.0064; big gives 64 * 2000 * 0.0064 = 819: finite.
    # Backward of out.sum(): big's input gradient = 64 * 2000 * scale = 128000 * scale: inf even at scale 1.
    model = _backward_model(2000.0)
    report = run(model, torch.ones(4, 64), loss_fn=lambda out, _: out.float().sum())
    assert report.forward_origin is None
    assert report.verdict == "overflow"
    scale = report.findings.scale
    assert scale is not None and scale.largest_finite_scale is None
    assert scale.probes[0].scale == 1.0 and not scale.probes[0].gradients_finite
    origin = report.backward_origin
    assert origin is not None and origin.module == "big"
    assert origin.tensor.startswith("grad:")
    assert report.exit_code == 1


def test_harmless_scale_overflow() -> None:
    # big's input gradient = 64 * 20 * S = 1280 S: finite in float16 up to S = 32 (40960), inf at 64 (81920).
    # The input is 1e-3 so that pre's weight gradient (4 * 1e-3 * 1280 S) stays far from the limit.
    model = _backward_model(20.0)
    report = run(model, torch.full((4, 64), 1e-3), loss_fn=lambda out, _: out.float().sum())
    assert report.verdict == "scale_overflow"
    scale = report.findings.scale
    assert scale is not None and scale.used_scale == 2.0**16
    assert scale.largest_finite_scale == 32.0
    assert scale.harmless and scale.lost_share_at_largest == 0.0
    assert scale.analysed_scale == 64.0  # the backward origin is placed where the first gradient overflows
    assert report.backward_origin is not None and report.backward_origin.module == "big"
    assert report.exit_code == 0
    assert report.recommendations[0].action == "loss_scale"
    assert "init_scale=16.0" in report.recommendations[0].snippet  # 1 bit of margin below the largest finite 32


def test_scaler_is_only_read() -> None:
    model = _backward_model(20.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scaler.__dict__.items()}
    report = run(model, torch.full((4, 64), 1e-3), loss_fn=lambda out, _: out.float().sum(), scaler=scaler)
    assert report.run.scale == 16.0 and report.verdict == "healthy"  # 1280 * 16 = 20480: finite
    assert scaler._scale is None and scaler.__dict__.keys() == before.keys()


def test_deprecated_cuda_scaler_on_a_machine_without_cuda_is_said_first() -> None:
    # The seed's loop (torch.cuda.amp.GradScaler + torch.cuda.amp.autocast) trains in float32 without scaling
    # on a CPU-only machine: the report must say so in its first lines, and assume the scale CUDA would use.
    with pytest.warns(Warning):
        scaler = torch.cuda.amp.GradScaler()  # disabled without CUDA
    report = run(_backward_model(20.0), torch.ones(4, 64), scaler=scaler)
    assert report.run.scale == 65536.0 and "disabled here" in report.run.scale_source
    (fact,) = report.run.environment
    assert "your own loop runs in float32 without loss scaling on this machine" in fact
    lines = str(report).splitlines()
    assert "your own loop runs in float32" in lines[2]  # right under the verdict and the run facts
    assert report.verdict == "scale_overflow"  # what float16 at 65536 does: big's gradient 1280 * 65536 is inf


def _weighted_sum(weights: torch.Tensor):  # type: ignore[no-untyped-def]
    return lambda out, _batch: (out.float() * weights).sum()


def test_gradient_underflow_counts_match_an_fp32_reference() -> None:
    # No scaler (scale 1). The loss weights output unit i by 2**-(2 i): the gradient reaching the float16
    # output is cast to float16 on its way back, and every weight below 2**-25 flushes to zero there, so
    # the weight-gradient rows of units 13..15 are lost (2**-26 .. 2**-30), a few more round away in the mm.
    torch.manual_seed(0)
    layer = nn.Linear(8, 16)
    x = torch.rand(2, 8) + 0.5
    weights = 2.0 ** -(2 * torch.arange(16.0))
    report = run(layer, x, loss_fn=_weighted_sum(weights), scale=1.0)
    # The fp32 reference, and the float16 autocast gradients at scale 1, computed here by hand.
    ref = torch.autograd.grad((layer(x) * weights).sum(), [layer.weight, layer.bias])
    with torch.autocast("cpu", dtype=FP16):
        out = layer(x)
    amp = torch.autograd.grad((out.float() * weights).sum(), [layer.weight, layer.bias])
    expected_lost = sum(int(((r != 0) & (a == 0)).sum()) for r, a in zip(ref, amp))
    assert expected_lost >= 3 * 8 + 3
    under = report.findings.underflow
    assert under is not None
    assert under.lost == expected_lost
    assert under.reference_nonzero == sum(int((r != 0).sum()) for r in ref)
    assert report.verdict == "underflow"  # 27+ of 144 values: far above 5 %
    assert [s.module for s in under.spots] == [""]
    assert report.recommendations[0].action == "loss_scale"


def test_healthy_relu_net_reports_no_underflow() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    report = run(model, torch.randn(8, 16), loss_fn=lambda out, _: out.float().pow(2).mean(),
                 underflow_reference="always")
    assert report.verdict == "healthy"
    assert report.forward_origin is None and report.backward_origin is None
    under = report.findings.underflow
    # the default reference: the same dtype at the largest finite scale (a float32 step is opt-in)
    assert under is not None and under.reference == "backward at scale 524288, the largest finite"
    assert under.lost == 0 and under.reference_nonzero > 0
    assert report.findings.near_limit == () and report.recommendations == ()
    assert report.exit_code == 0


@pytest.mark.parametrize("dtype", [FP16, BF16])
def test_healthy_model_both_dtypes(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 2))
    report = run(model, torch.randn(4, 8), dtype=dtype)
    assert report.verdict == "healthy"
    assert report.run.limits.dtype == str(dtype).split(".")[1]
    assert report.run.loss_source == "surrogate" and "surrogate" in " ".join(report.run.notes)


def test_bf16_does_not_overflow_where_fp16_does() -> None:
    model = nn.Sequential(constant_linear(16, 16, 5000.0))
    assert run(model, torch.ones(2, 16)).verdict == "overflow"
    report = run(model, torch.ones(2, 16), dtype=BF16)
    assert report.verdict == "healthy" and report.run.scale == 1.0


# -- masks, in-place ops, keyword inputs, dict outputs ------------------------------------------------------


def test_transformer_encoder_with_float_causal_mask_overflowing_attention() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    with torch.no_grad():
        encoder.layers[1].self_attn.in_proj_weight.mul_(1e5)  # its own in-projection (F.linear) overflows
    mask = nn.Transformer.generate_square_subsequent_mask(6)  # float, full of -inf
    assert torch.isinf(mask).any()
    report = run(encoder, {"src": torch.randn(2, 6, 16), "mask": mask, "is_causal": True})
    origin = report.forward_origin
    assert origin is not None and origin.module == "layers.1.self_attn", origin
    assert origin.class_name == "MultiheadAttention"
    # the mask reached layers.0.self_attn too, which stays finite: no false origin there
    assert "layers.0.self_attn" not in report.findings.propagation


def test_inplace_relu_after_linear_on_3d_input() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    report = run(model, torch.randn(2, 3, 8), loss_fn=lambda out, _: out.float().mean())
    assert report.verdict == "healthy"
    assert report.findings.not_captured == ()
    linear0 = next(c for c in report.trace.calls if c.module == "0")
    events = [e for e in report.trace.grad_events if e.kind == "output" and e.call == linear0.index]
    assert events and events[0].via_base  # captured on the view's base: the view was modified in place
    assert events[0].stats.shape == (6, 8)


class KwargModel(nn.Module):
    def __init__(self, gain: float) -> None:
        super().__init__()
        self.proj = constant_linear(4, 4, gain)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor, temperature: float = 1.0) -> dict[str, torch.Tensor]:
        h = self.proj(x * mask.unsqueeze(-1))
        return {"logits": self.head(h) / temperature, "hidden": h}


def test_keyword_inputs_bool_mask_and_dict_outputs() -> None:
    mask = torch.tensor([[True, True, False]])
    batch = {"x": torch.ones(1, 3, 4), "mask": mask, "temperature": 2.0}
    report = run(KwargModel(1e5), batch, loss_fn=lambda out, _: out["logits"].float().mean())
    origin = report.forward_origin
    assert origin is not None and origin.module == "proj"
    root = next(c for c in report.trace.calls if c.module == "")
    assert [r.path for r in root.inputs] == ["kwargs['x']", "kwargs['mask']"]
    assert root.inputs[1].stats.dtype == "bool" and not root.inputs[1].stats.measured
    assert [r.path for r in root.outputs] == ["out['logits']", "out['hidden']"]
    assert run(KwargModel(0.1), batch, loss_fn=lambda out, _: out["logits"].float().mean()).verdict == "healthy"


# -- errors, state, wrappers ------------------------------------------------------------------------------


class Exploding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(5, 4)  # wrong width: the forward raises here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def test_forward_error_names_the_last_module_and_leaves_nothing_behind() -> None:
    model = Exploding()
    before = snapshot(model)
    with pytest.raises(ampdoctor.AmpDoctorError, match="last module that ran: 'second'") as info:
        ampdoctor.diagnose(model, torch.ones(2, 4))
    assert isinstance(info.value.__cause__, RuntimeError)
    assert_untouched(model, before)


def test_loss_error_leaves_nothing_behind() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    before = snapshot(model)

    def bad_loss(out: torch.Tensor, _batch: torch.Tensor) -> torch.Tensor:
        raise ValueError("no targets")

    with pytest.raises(ampdoctor.AmpDoctorError, match="the loss raised ValueError: no targets"):
        ampdoctor.diagnose(model, torch.ones(2, 4), loss_fn=bad_loss)
    assert_untouched(model, before)


def test_bad_arguments_are_clear() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ampdoctor.AmpDoctorError, match="dtype must be"):
        ampdoctor.diagnose(model, torch.ones(1, 2), dtype=torch.float32)
    with pytest.raises(ampdoctor.AmpDoctorError, match="batch must be a Tensor"):
        ampdoctor.diagnose(model, "not a batch")
    with pytest.raises(ampdoctor.AmpDoctorError, match="must be a torch.nn.Module"):
        ampdoctor.diagnose(object(), torch.ones(1, 2))  # type: ignore[arg-type]
    with pytest.raises(ampdoctor.AmpDoctorError, match="scalar tensor"):
        ampdoctor.diagnose(model, torch.ones(1, 2), loss_fn=lambda out, _: out)


def test_batchnorm_dropout_grads_and_rng_are_restored() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5), nn.Flatten(), nn.Linear(4 * 36, 2))
    model.train()
    model[4].weight.grad = torch.full_like(model[4].weight, 0.25)  # an existing .grad stays; None stays None
    report = run(model, torch.randn(2, 3, 8, 8), loss_fn=lambda out, _: out.float().mean(), scale=1024.0)
    assert report.verdict == "healthy"
    assert model[1].num_batches_tracked.item() == 0


def test_dropout_passes_are_identical() -> None:
    # Re-runs rewind the RNG: with dropout, the detailed pass sees the very same values as the survey.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), constant_linear(8, 8, 1e6))
    report = run(model, torch.ones(4, 8))
    assert report.forward_origin is not None and report.forward_origin.module == "2"
    assert report.trace.detailed


def test_compiled_model_is_diagnosed_through_its_original_module() -> None:
    model = nn.Sequential(constant_linear(16, 16, 5000.0))
    compiled = torch.compile(model)
    report = run(compiled, torch.ones(2, 16))  # type: ignore[arg-type]
    assert report.forward_origin is not None and report.forward_origin.module == "0"
    assert any("torch.compile" in note for note in report.run.notes)


def test_huggingface_style_output_loss() -> None:
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            out = self.lin(x)
            return {"loss": out.float().pow(2).mean(), "logits": out}

    report = run(WithLoss(), torch.ones(2, 4))
    assert report.run.loss_source == "output['loss']"


def test_report_text_mentions_the_essentials() -> None:
    model = nn.Sequential(constant_linear(16, 16, 5000.0))
    text = str(run(model, torch.ones(2, 16)))
    first = text.splitlines()[0]
    assert first == "ampdoctor: OVERFLOW - forward origin: 0"
    for needle in ("torch " + torch.__version__, "float16 autocast on cpu", "loss scale 65536", "Recommendations"):
        assert needle in text
    # the origin's own numbers: 2 x 16 outputs of 16 * 5000 = 80000, every one +inf in float16, made by the mm
    lines = text.splitlines()
    origin_at = lines.index("Forward origin: 0 (Linear)")
    assert lines[origin_at + 1 : origin_at + 3] == [
        "  inputs finite (|x|max 1); its own code made out non-finite: 32 +inf of 32 values",
        "  op aten::mm (float16 |x|max 1, float16 |x|max 5000) -> float16",
    ]


def test_activation_checkpointing_recompute_is_not_recorded_as_calls() -> None:
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self, gain: float) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2)])
            self.blocks.append(nn.Sequential(constant_linear(8, 8, gain), nn.ReLU()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)  # re-runs block's forward during backward
            return x

    torch.manual_seed(0)
    report = run(Net(0.01), torch.randn(4, 8), loss_fn=lambda out, _: out.float().mean())
    assert report.verdict == "healthy"
    assert [c.label for c in report.trace.calls] == [
        "<root>", "blocks.0", "blocks.0.0", "blocks.0.1", "blocks.1", "blocks.1.0", "blocks.1.1",
        "blocks.2", "blocks.2.0", "blocks.2.1",
    ]
    assert report.findings.not_captured == ()
    report = run(Net(1e6), torch.ones(4, 8), loss_fn=lambda out, _: out.float().mean())
    assert report.forward_origin is not None and report.forward_origin.label == "blocks.2.0"


def test_a_model_compiled_in_place_is_diagnosed_eagerly() -> None:
    model = nn.Sequential(constant_linear(16, 16, 5000.0))  # 16 * 5000 = 80000: inf in float16
    model.compile(backend="eager")
    model(torch.ones(2, 16))  # compiled once, as in training
    report = run(model, torch.ones(2, 16))
    assert report.verdict == "overflow" and report.forward_origin is not None and report.forward_origin.module == "0"
    assert "_compiled_call_impl" in model.__dict__  # the compiled call is put back
