"""``diagnose`` on float16 AMP failures that users reported in other projects' issue trackers.

Each case (built in ``real_failures_models.py``, where its docstring cites the issue and carries the arithmetic)
is first checked without ampdoctor, so the test proves the reported mechanism really happens here; then
``diagnose`` must name what the issue's own diagnosis named: the module whose code made the inf/NaN, the op, the
source line, and a remedy that a re-run verified. Nothing the user owns may change (``helpers.assert_untouched``)
and a later plain step runs no ampdoctor code.

Where ampdoctor's answer is wrong, the test asserts the right answer and is marked ``xfail(strict=True)`` with the
defect in its reason: it turns into a failure (XPASS) the day the defect is fixed, so the mark has to go then.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import real_failures_models as cases
import torch
import torch.nn.functional as F
from helpers import ampdoctor_frames_during, assert_untouched, snapshot
from torch import nn

import ampdoctor

FP16_MAX = 65504.0
MATMUL_OPS = {"aten::bmm", "aten::baddbmm", "aten::mm", "aten::addmm", "aten::matmul"}


def _call_model(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, tuple):
        return model(*batch)
    return model(batch)


def _diagnose(model: nn.Module, batch: Any, **kwargs: Any) -> ampdoctor.Report:
    """diagnose, then: nothing the user owns changed, no hook left, the JSON round trip holds, and a later plain
    float16 forward runs no ampdoctor code."""
    before = snapshot(model)
    report = ampdoctor.diagnose(model, batch, **kwargs)
    assert_untouched(model, before)
    assert ampdoctor.Report.from_json(report.to_json(absolute_paths=True)) == report

    def plain_forward() -> None:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            _call_model(model, batch)

    assert ampdoctor_frames_during(plain_forward) == [], "a later plain forward ran ampdoctor code"
    return report


def _fallback(report: ampdoctor.Report) -> Any:
    return next((r for r in report.recommendations if r.action == "fp32_fallback"), None)


def _file(origin: Any) -> str:
    assert origin.op is not None and origin.op.location is not None, "no op or source line found"
    return os.path.basename(origin.op.location.file)


# -- pytorch/pytorch#60939: MultiheadAttention's q @ k overflows in float16 ----------------------------------------


def test_mha_scores_overflow_names_multihead_attention_and_its_bmm() -> None:
    model, batch, kwargs = cases.mha_scores_overflow()
    attn = model.attn
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        q = F.linear(batch, attn.in_proj_weight[:16], attn.in_proj_bias[:16])
        assert float(q.abs().max()) < FP16_MAX / 64, "setup: the projections are far from the float16 max"
        assert not torch.isfinite(model(batch)).all(), "setup: the step is non-finite"

    report = _diagnose(model, batch, **kwargs)

    assert report.verdict == "overflow", report.to_text()
    origin = report.forward_origin
    assert origin is not None and origin.exact
    # The diagnosis: MHA's own q @ k product, not the projection (finite) nor `head` (received the NaN).
    assert (origin.module, origin.call, origin.class_name, origin.tensor) == ("attn", 0, "MultiheadAttention", "out[0]")
    assert origin.input_abs_max is not None and origin.input_abs_max < 10
    assert origin.op is not None and origin.op.op in MATMUL_OPS, origin.op
    assert origin.op.output_posinf_count + origin.op.output_neginf_count > 0
    assert all(m is not None and m < FP16_MAX for m in origin.op.input_abs_max)
    # torch's own frames are filtered: the line is the user's call into MultiheadAttention.
    assert _file(origin) == "real_failures_models.py"
    assert "self.attn(x, x, x" in origin.op.location.code
    assert report.findings.propagation == ("head", "<root>")
    fallback = _fallback(report)
    assert fallback is not None and fallback.modules == ("attn",) and fallback.verified, report.to_text()
    assert report.recommendations[0] is fallback
    assert any(r.action == "bf16" and r.verified for r in report.recommendations)
    assert report.exit_code == 1


# -- pytorch/pytorch#41508, #26098: a fully masked key_padding_mask row ----------------------------------------


def test_mha_fully_masked_row_names_the_softmax_and_offers_no_false_fix() -> None:
    model, batch, kwargs = cases.mha_fully_masked_row()
    with torch.no_grad():
        out32 = model(*batch)  # float32: the premise is that this NaN does not come from float16's range
    assert torch.isnan(out32[1]).all() and torch.isfinite(out32[0]).all()

    report = _diagnose(model, batch, **kwargs)

    assert report.verdict == "nan", report.to_text()
    origin = report.forward_origin
    assert origin is not None and origin.exact
    assert (origin.module, origin.class_name, origin.tensor) == ("attn", "MultiheadAttention", "out[0]")
    assert origin.bad.nan_count == 6 * 16  # sample 1: 6 queries x 16 features; sample 0 stays finite
    assert origin.op is not None and origin.op.op == "aten::_softmax"
    assert origin.op.output_nan_count > 0
    assert "key_padding_mask=key_padding_mask" in origin.op.location.code
    # float32 does not help, and ampdoctor must not pretend it does.
    assert not any(r.verified and r.action == "fp32_fallback" for r in report.recommendations), report.to_text()
    fallback = _fallback(report)
    assert fallback is not None and "stays the origin even in float32" in fallback.evidence


def test_mha_fully_masked_row_is_nan_under_the_cuda_policy_too() -> None:
    model, batch, kwargs = cases.mha_fully_masked_row()
    report = _diagnose(model, batch, policy="cuda", **kwargs)
    assert report.verdict == "nan", report.to_text()
    origin = report.forward_origin
    assert origin is not None and origin.module == "attn"
    assert origin.op is not None and origin.op.op == "aten::_softmax" and origin.op.output_dtype == "float32"


def test_mha_fully_masked_row_note_does_not_blame_the_cpu_policy() -> None:
    model, batch, kwargs = cases.mha_fully_masked_row()
    report = _diagnose(model, batch, **kwargs)
    origin = report.forward_origin
    assert origin is not None and origin.module == "attn"
    assert "specific to the CPU policy" not in origin.policy_note, origin.policy_note


# -- NVIDIA/apex#1105, facebookresearch/fairseq#3575: masked_fill(-1e9) on float16 scores --------------------------


def test_masked_fill_minus_1e9_is_reported_as_the_model_raising_under_float16() -> None:
    model, batch, kwargs = cases.masked_fill_minus_1e9()
    with torch.no_grad():
        assert torch.isfinite(model(*batch)).all(), "setup: the float32 forward runs"
    before = snapshot(model)

    with pytest.raises(ampdoctor.ModelRaised) as caught:
        ampdoctor.diagnose(model, batch, **kwargs)

    assert caught.value.stage == "forward"
    message = str(caught.value)
    assert "value cannot be converted to type c10::Half without overflow" in message
    assert "inside 'attn'" in message
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert_untouched(model, before)


# -- pytorch/pytorch#41527, tensorflow/tensorflow#24979: LayerNorm eps=1e-12 is 0 in float16 -----------------------


def test_bert_layernorm_eps_1e12_on_a_zero_variance_row_names_its_division() -> None:
    model, batch, kwargs = cases.layernorm_eps_zero_variance()
    assert torch.tensor(1e-12, dtype=torch.float16) == 0, "premise: 1e-12 is 0 in float16"
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert torch.isfinite(model.dense(batch)).all()
        assert torch.isnan(model(batch)).any()

    report = _diagnose(model, batch, **kwargs)

    assert report.verdict == "nan", report.to_text()
    origin = report.forward_origin
    assert origin is not None and origin.exact
    assert (origin.module, origin.class_name, origin.tensor) == ("LayerNorm", "BertLayerNorm", "out")
    assert origin.bad.nan_count == 3 * 16  # sample 1, positions 3, 4, 5: all 16 features
    assert origin.op is not None and origin.op.op == "aten::div.Tensor"
    assert origin.op.location.code == "x = (x - u) / torch.sqrt(s + self.variance_epsilon)"
    assert report.findings.propagation == ("classifier", "<root>")
    fallback = _fallback(report)
    assert fallback is not None and fallback.modules == ("LayerNorm",) and fallback.verified, report.to_text()


# -- pytorch/pytorch#66707: the hand-written LayerNorm's variance overflows and divides to zero ---------------------


def test_layernorm_variance_overflow_premise() -> None:
    """Without ampdoctor: pow makes inf inside BertLayerNorm, the division hides it, the output is finite zeros."""
    model, batch, _ = cases.layernorm_variance_overflow()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        h = model.dense(batch)
        u = h.mean(-1, keepdim=True)
        s = (h - u).pow(2).mean(-1, keepdim=True)
        out = model.LayerNorm(h)
    assert h.dtype == torch.float16 and float(h.abs().max()) < FP16_MAX / 100
    assert int(torch.isinf(s).sum()) == 8  # of 12 rows
    assert torch.isfinite(out).all()
    assert int((out == 0).all(-1).sum()) == 8  # those rows lost all information


def test_layernorm_variance_overflow_is_a_hidden_overflow_at_its_pow() -> None:
    """BertLayerNorm's own `(x - u).pow(2)` makes inf in 8 of 12 rows (CPU float16 autocast keeps pow in float16),
    `/ torch.sqrt(s + eps)` turns it into exact zeros: the module's output is finite and wrong, the backward finite
    too (d/ds at s=inf is 0). No call's output is non-finite, so there is no forward origin (an origin is a call that
    makes a non-finite output); the hidden-overflow finding names the module, the op and its line instead."""
    model, batch, kwargs = cases.layernorm_variance_overflow()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        h = model.dense(batch)
        expected = int(torch.isinf((h - h.mean(-1, keepdim=True)).pow(2)).sum())
    report = _diagnose(model, batch, **kwargs)
    assert report.verdict == "hidden_overflow", report.to_text()
    assert report.forward_origin is None
    (hidden,) = report.findings.hidden
    assert (hidden.module, hidden.class_name, hidden.op, hidden.function) == (
        "LayerNorm", "BertLayerNorm", "pow", "Tensor.pow"
    )
    assert hidden.classified and hidden.count == expected > 0 and hidden.sentinels == 0
    assert hidden.hidden_by == "div"
    assert hidden.location is not None and ".pow(2)" in hidden.location.code
    assert "LayerNorm  BertLayerNorm  pow (Tensor.pow)" in report.to_text()


# -- pytorch/pytorch#32137: F.normalize's eps=1e-12 is 0 in float16 ------------------------------------------------


def test_normalize_of_a_zero_vector_names_the_projection_head() -> None:
    model, batch, kwargs = cases.normalize_eps_zero_vector()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        z = torch.relu(model.head.proj(model.backbone(batch)))
        assert (z == 0).all(-1).tolist() == [False] * 7 + [True]  # sample 7's embedding is the zero vector
        assert torch.isnan(model(batch)).any()

    report = _diagnose(model, batch, **kwargs)

    assert report.verdict == "nan", report.to_text()
    origin = report.forward_origin
    assert origin is not None and origin.exact
    assert (origin.module, origin.class_name, origin.tensor) == ("head", "ProjectionHead", "out")
    assert origin.bad.nan_count == 8  # sample 7's 8 features
    assert origin.op is not None and origin.op.op == "aten::div.Tensor"
    assert "F.normalize(torch.relu(self.proj(x)), dim=-1)" in origin.op.location.code
    assert report.findings.propagation == ("<root>",)
    fallback = _fallback(report)
    assert fallback is not None and fallback.modules == ("head",) and fallback.verified, report.to_text()
    assert fallback.cost is not None and fallback.cost.fp32_matmul_flop_share < 0.05


# -- pytorch/pytorch#61098, Lightning-AI/pytorch-lightning#13871: Sigmoid + BCELoss under AMP -----------------------


def test_bce_under_the_cuda_policy_raises_what_cuda_raises() -> None:
    model, batch, kwargs = cases.sigmoid_bce(policy="cuda")
    before = snapshot(model)
    with pytest.raises(ampdoctor.ModelRaised) as caught:
        ampdoctor.diagnose(model, batch, **kwargs)
    assert caught.value.stage == "loss"
    message = str(caught.value)
    assert "unsafe to autocast" in message and "BCEWithLogitsLoss" in message
    assert "CUDA autocast policy, emulated" in message
    assert_untouched(model, before)


def test_bce_premise_loss_in_float32_does_not_help_and_with_logits_does() -> None:
    model, batch, kwargs = cases.sigmoid_bce()
    loss_fn = kwargs["loss_fn"]
    target = torch.randint(0, 2, (8, 2), generator=torch.Generator().manual_seed(2)).float()
    variants = {
        "as is": lambda: loss_fn(model(batch), batch),
        "loss in float32": lambda: loss_fn(model(batch).float(), batch),
        "with logits": lambda: F.binary_cross_entropy_with_logits(model[0](batch), target),
    }
    finite = {}
    for name, step in variants.items():
        with torch.autocast("cpu", dtype=torch.float16):
            loss = step()
        grads = torch.autograd.grad(loss, list(model.parameters()))
        finite[name] = all(bool(torch.isfinite(g).all()) for g in grads)
    assert finite == {"as is": False, "loss in float32": False, "with logits": True}


def test_bce_saturated_sigmoid_gradient_is_non_finite_at_every_scale() -> None:
    model, batch, kwargs = cases.sigmoid_bce()

    report = _diagnose(model, batch, **kwargs)

    assert report.verdict == "overflow", report.to_text()
    assert report.forward_origin is None  # the loss value itself is finite
    origin = report.backward_origin
    assert origin is not None and origin.module == "<loss>"
    assert origin.op is not None and origin.op.node == "ToCopyBackward0"
    scale = report.findings.scale
    assert scale is not None and scale.largest_finite_scale is None  # GradScaler would skip every step
    assert report.recommendations[0].action == "fix_loss"


def test_bce_remedy_is_bce_with_logits() -> None:
    """The loss in float32 does not help (the sigmoid's float16 output is exactly 1.0 already; see
    test_bce_premise_loss_in_float32_does_not_help_and_with_logits_does): the first remedy is the one torch names,
    binary_cross_entropy_with_logits on the logits, verified by a re-run that computes it."""
    model, batch, kwargs = cases.sigmoid_bce()
    report = _diagnose(model, batch, **kwargs)
    texts = [(r.title + " " + r.snippet).lower() for r in report.recommendations]
    assert any("with_logits" in t or "withlogits" in t for t in texts), texts
    first = report.recommendations[0]
    assert first.rule == "bce_with_logits" and first.verified, report.to_text()
    assert "BCEWithLogitsLoss()" in first.snippet and "computing the rewritten arithmetic" in first.evidence


# -- NVIDIA/apex#379: log(softmax(x)) underflows to log(0) in float16 ---------------------------------------------


def test_log_of_softmax_in_the_loss_names_the_loss_and_its_log() -> None:
    model, batch, kwargs = cases.log_of_softmax_loss()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        out = model(batch)
        assert torch.isfinite(out).all()
        assert (torch.softmax(out, dim=-1) == 0).any(), "setup: some probabilities underflow to 0"

    report = _diagnose(model, batch, **kwargs)

    assert report.verdict == "nan", report.to_text()
    origin = report.forward_origin
    assert origin is not None and origin.module == "<loss>"
    assert origin.bad.posinf_count == 1  # the scalar loss is +inf
    assert origin.op is not None and origin.op.op == "aten::log"
    assert "torch.log(torch.softmax(out, dim=-1))" in origin.op.location.code
    assert "on CUDA `log` runs in float32" in origin.policy_note
    # The rewrite of that line comes first, proven by a re-run; the model is not at fault (no fallback).
    first = report.recommendations[0]
    assert first.action == "rewrite" and "log_softmax" in first.snippet and first.verified
    assert not any(r.action == "fp32_fallback" for r in report.recommendations)


def test_log_of_softmax_in_the_loss_is_finite_in_the_forward_under_the_cuda_policy() -> None:
    model, batch, kwargs = cases.log_of_softmax_loss()
    report = _diagnose(model, batch, policy="cuda", **kwargs)
    assert report.forward_origin is None, report.to_text()  # CUDA runs softmax and log in float32


# -- huggingface/transformers#12225 (+ #7243's clamp): Pegasus' residual add overflows in float16 ----------------


def _pegasus_outputs(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    layer = model.model.encoder.layers[0]
    seen: dict[str, torch.Tensor] = {}
    handles = [
        layer.fc2.register_forward_hook(lambda m, a, o: seen.__setitem__("fc2", o)),
        layer.register_forward_hook(lambda m, a, o: seen.__setitem__("layer", o)),
        layer.final_layer_norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("residual", a[0])),
    ]
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            seen["loss"] = model(**batch).loss
    finally:
        for h in handles:
            h.remove()
    return seen


@pytest.fixture(scope="module")
def pegasus() -> Any:
    pytest.importorskip("transformers")
    return cases.pegasus_half_residual_overflow()


def test_pegasus_premise_the_layer_clamp_hides_an_inf(pegasus: Any) -> None:
    model, batch, _ = pegasus
    seen = _pegasus_outputs(model, batch)
    assert seen["fc2"].dtype == torch.float16 and float(seen["fc2"].abs().max()) == 64992.0  # finite
    residual = seen["residual"]  # the layer's input to final_layer_norm: the residual stream before fc1
    assert torch.isinf(residual + seen["fc2"]).any(), "the layer's residual add overflows"
    assert float(seen["layer"].abs().max()) == 64512.0  # finfo.max - 1000, rounded: the clamp replaced the inf
    assert torch.isfinite(seen["loss"])


@pytest.fixture(scope="module")
def pegasus_report(pegasus: Any) -> ampdoctor.Report:
    model, batch, kwargs = pegasus
    return _diagnose(model, batch, **kwargs)


def test_pegasus_reports_fc2_within_one_bit_of_the_max(pegasus_report: ampdoctor.Report) -> None:
    report = pegasus_report
    near = {(n.module, n.tensor) for n in report.findings.near_limit}
    assert ("model.encoder.layers.0.fc2", "out") in near
    assert ("model.encoder.layers.0", "out") in near
    assert any("within 1 bit" in w for w in report.findings.warnings)


def test_pegasus_hidden_overflow_in_training_is_the_dropout_rescale(pegasus_report: ampdoctor.Report) -> None:
    """The case runs in training mode (a freshly built model): dropout(p=0.1) scales fc2's kept 64992s by 1/0.9 to
    72213, inf in float16, before the residual add; the add only carries those infs and the layer's fp16 clamp
    (transformers#7243) hides them. Not HEALTHY: its own verdict, the finding names the layer, dropout and its
    line. No call's output is non-finite, so there is no forward origin."""
    report = pegasus_report
    assert report.verdict == "hidden_overflow", report.to_text()
    assert report.forward_origin is None
    (hidden,) = report.findings.hidden
    assert (hidden.module, hidden.class_name, hidden.op) == ("model.encoder.layers.0", "PegasusEncoderLayer", "dropout")
    assert hidden.hidden_by == "clamp" and hidden.classified and hidden.count is not None and hidden.count > 0
    assert hidden.location is not None and "dropout(hidden_states" in hidden.location.code


def test_pegasus_hidden_residual_overflow_in_eval_is_the_add(pegasus: Any) -> None:
    """Without dropout (eval), the layer's own `residual + hidden_states` makes the inf (64992 + ~820), and the clamp
    hides it: a hidden overflow at model.encoder.layers.0, op add, on the residual line; never HEALTHY."""
    model, batch, kwargs = pegasus
    model.eval()
    try:
        report = _diagnose(model, batch, **kwargs)
    finally:
        model.train()
    assert report.verdict == "hidden_overflow", report.to_text()
    adds = [h for h in report.findings.hidden if h.module == "model.encoder.layers.0"]
    assert [(h.op, h.hidden_by) for h in adds] == [("add", "clamp")], report.to_text()
    assert adds[0].location is not None and "residual + hidden_states" in adds[0].location.code
    assert adds[0].count is not None and adds[0].count > 0


# -- huggingface/transformers#9295, #4287, #5651: T5 (v1.1, gated-gelu) in float16, `wo` overflows -----------------

T5_WO = "encoder.block.0.layer.1.DenseReluDense.wo"


@pytest.fixture(scope="module")
def t5_half() -> Any:
    pytest.importorskip("transformers")
    return cases.t5_gated_half_wo_overflow()


def test_t5_half_gated_ffn_names_wo_and_its_mm(t5_half: Any) -> None:
    model, batch, kwargs = t5_half
    wo = model.get_submodule(T5_WO)
    assert type(model.get_submodule(T5_WO.rsplit(".", 1)[0])).__name__ == "T5DenseGatedActDense"
    seen: dict[str, torch.Tensor] = {}
    handle = wo.register_forward_hook(lambda m, a, o: seen.update(x=a[0], out=o))
    rng = torch.get_rng_state()  # train mode: dropout; diagnose replays the masks drawn from the state it starts in
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            loss = model(**batch).loss
    finally:
        handle.remove()
    assert torch.isfinite(seen["x"]).all() and torch.isinf(seen["out"]).any() and not torch.isfinite(loss)

    torch.set_rng_state(rng)
    report = _diagnose(model, batch, **kwargs)

    assert report.verdict == "overflow", report.to_text()
    origin = report.forward_origin
    assert origin is not None and origin.exact
    assert (origin.module, origin.class_name, origin.tensor) == (T5_WO, "Linear", "out")
    assert origin.bad.posinf_count + origin.bad.neginf_count == int(torch.isinf(seen["out"]).sum())
    assert origin.op is not None and origin.op.op in MATMUL_OPS
    assert _file(origin) == "modeling_t5.py" and origin.op.location.code == "hidden_states = self.wo(hidden_states)"
    assert "encoder.block.0.layer.1.DenseReluDense" in report.findings.propagation
    actions = {r.action: r for r in report.recommendations}
    # The weights are stored in float16: Hugging Face's own remedy is _keep_in_fp32_modules = ["wo"].
    keep = actions["keep_in_fp32"]
    assert keep.modules == (T5_WO,) and "_keep_in_fp32_modules = ['wo']" in keep.snippet
    assert actions["bf16"].verified


@pytest.mark.slow  # a second T5 diagnosis (~5 s on a loaded 2-core machine)
def test_t5_half_fp32_fallback_of_wo_is_verified(t5_half: Any) -> None:
    model, batch, kwargs = t5_half
    report = _diagnose(model, batch, **kwargs)
    fallback = _fallback(report)
    assert fallback is not None and fallback.modules == (T5_WO,)
    assert fallback.verified, fallback.evidence


# -- facebookresearch/fairseq#1529, ymcui/Chinese-LLaMA-Alpaca#534: the loss scale falls forever ----------------


def test_watch_sees_gradscaler_back_off_below_one_and_names_the_loss(tmp_path: Any) -> None:
    """GradScaler halves the scale on every skipped step; with a gradient that is inf at any scale (the saturated
    sigmoid + BCELoss above), it never recovers ("Minimum loss scale reached" in fairseq, DeepSpeed's "Current
    loss scale already at minimum"). The watch must call it persistent once the scale falls below 1."""
    model, batch, kwargs = cases.sigmoid_bce()
    loss_fn = kwargs["loss_fn"]
    before = snapshot(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampdoctor.watch(model, scaler, loss_fn=loss_fn, bundle_dir=str(tmp_path)) as doctor:
        for _ in range(5):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(batch), batch)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    report = doctor.report()

    assert [(s.scale, s.skipped, s.new_scale) for s in report.steps] == [
        (4.0, True, 2.0), (2.0, True, 1.0), (1.0, True, 0.5), (0.5, True, 0.25), (0.25, True, 0.125),
    ]
    assert {s.run for s in report.steps} == {"persistent"}
    assert all(s.backward_origin == "<loss>" and s.forward_finite for s in report.steps)
    assert report.verdict == "overflow"
    assert report.backward_origin is not None and report.backward_origin.module == "<loss>"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ampdoctor-bundle-step2.pt"]  # first scale below 1
    model.zero_grad(set_to_none=True)
    assert_untouched_params = {k: v for k, v in snapshot(model).state.items()}
    assert assert_untouched_params == before.state  # every step was skipped: the weights never moved
    assert snapshot(model).hook_counts == before.hook_counts


def test_scale_section_has_no_empty_probe_list() -> None:
    """Non-finite gradients already at scale 1: no lower scale to re-run at, and the report says no empty list."""
    model, batch, kwargs = cases.sigmoid_bce()
    report = _diagnose(model, batch, scale=1.0, **kwargs)
    assert report.findings.scale is not None and report.findings.scale.probes == ()
    text = report.to_text()
    assert "gradients non-finite at scale 1\n" in text and "re-run at" not in text, text


# -- NVIDIA/apex#93: an additive mask (1 - mask) * -1e9 is -inf in float16 ----------------------------------------


def test_additive_mask_minus_1e9_with_an_empty_sequence_names_the_mask_line() -> None:
    model, batch, kwargs = cases.additive_mask_minus_1e9(empty_sequence=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert torch.isinf(torch.tensor(-1e9).half()) and not torch.isfinite(model(*batch)).all()

    report = _diagnose(model, batch, **kwargs)

    assert report.verdict == "overflow", report.to_text()
    origin = report.forward_origin
    assert origin is not None and origin.exact
    assert (origin.module, origin.class_name, origin.tensor) == ("attn", "AdditiveMaskAttention", "out")
    assert origin.bad.nan_count == 6 * 16  # sample 1: every query row has no key left
    assert origin.op is not None and origin.op.op == "aten::mul.Tensor"
    assert origin.op.scalar_args == (-1e9,)
    assert origin.op.output_neginf_count > 0
    assert "* -1e9" in origin.op.location.code
    assert any(r.action == "bf16" and r.verified for r in report.recommendations)


def test_additive_mask_minus_1e9_offers_the_finfo_min_constant() -> None:
    """The op zoom names aten::mul.Tensor with scalar_args (-1e9,) on the line `(1.0 - mask...) * -1e9`: the
    mask-constant remedy covers this additive form too, verified by re-running the line with finfo.min."""
    model, batch, kwargs = cases.additive_mask_minus_1e9(empty_sequence=True)
    report = _diagnose(model, batch, **kwargs)
    assert any(r.action == "mask_constant" for r in report.recommendations), report.to_text()
    first = report.recommendations[0]
    assert first.rule == "scaled_mask_constant" and first.verified, report.to_text()
    assert "-1e+09" in first.title and "(1.0 - mask) * torch.finfo(scores.dtype).min" in first.snippet
    # The rewritten line, run for real: the empty row is a finite uniform softmax.
    attn = model.attn
    x, mask = batch
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        q, k, v = attn.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / 4.0
        extended = (1.0 - mask[:, None, :].to(scores.dtype)) * torch.finfo(scores.dtype).min
        assert torch.isfinite(model.head(attn.out((scores + extended).softmax(dim=-1) @ v))).all()


def test_additive_mask_minus_1e9_is_not_healthy_even_when_no_row_is_empty() -> None:
    """With every row keeping a key, `(1 - mask) * -1e9` still makes -inf from finite values (the scalar -1e9 is a
    constant float16 cannot hold: not a sentinel) and the softmax hides it: a hidden overflow at the mul's line."""
    model, batch, kwargs = cases.additive_mask_minus_1e9(empty_sequence=False)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        assert torch.isfinite(model(*batch)).all()
    report = _diagnose(model, batch, **kwargs)
    assert report.verdict == "hidden_overflow", report.to_text()
    (hidden,) = report.findings.hidden
    assert (hidden.module, hidden.class_name, hidden.op, hidden.hidden_by) == (
        "attn", "AdditiveMaskAttention", "mul", "softmax"
    )
    assert hidden.count == 2 and hidden.sentinels == 0  # sample 1's two padded keys, in its one mask row
    assert hidden.location is not None and "* -1e9" in hidden.location.code


# -- fastino-ai/GLiNER2#155: clamp(max=1 - 1e-6) is a no-op in float16; only the backward breaks ------------------


def test_clamp_eps_below_one_names_the_log1p_backward_at_every_scale() -> None:
    model, batch, kwargs = cases.clamp_eps_below_one()
    assert torch.tensor(1.0 - 1e-6, dtype=torch.float16) == 1.0, "premise: 1 - 1e-6 is 1.0 in float16"
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(batch)
        loss = kwargs["loss_fn"](out, batch)
    assert torch.isfinite(out).all() and out.tolist() == [1.0] * 4, "the forward stays finite"
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert not all(bool(torch.isfinite(g).all()) for g in grads), "the backward is not"

    report = _diagnose(model, batch, **kwargs)

    assert report.verdict == "nan", report.to_text()
    assert report.forward_origin is None
    origin = report.backward_origin
    assert origin is not None
    assert (origin.module, origin.class_name, origin.tensor) == ("any_span", "AnySpanProbability", "grad:args[0]")
    assert origin.bad.nan_count == 4  # unit 0's gradient, one per sample
    assert origin.op is not None and origin.op.node == "Log1PBackward0"
    assert origin.op.location.code == "log_survival = torch.log1p(-probabilities.clamp(max=1.0 - 1e-6))"
    scale = report.findings.scale
    assert scale is not None and scale.largest_finite_scale is None  # no loss scale helps: GradScaler skips forever
    fallback = _fallback(report)
    assert fallback is not None and fallback.modules == ("any_span",) and fallback.verified, report.to_text()
    # bfloat16 rounds 1 - 1e-6 to 1.0 as well: the re-run says so instead of recommending it.
    bf16 = next(r for r in report.recommendations if r.action == "bf16")
    assert not bf16.verified and "still non-finite" in bf16.evidence


# -- the CPU policy's note, when the named op is not the one CUDA runs differently --------------------------------

CPU_ONLY_NANS = {
    # F.normalize's norm (linalg_vector_norm) and BertLayerNorm's pow: float16 on CPU autocast, float32 on CUDA.
    "normalize_eps_zero_vector": "head",
    "layernorm_eps_zero_variance": "LayerNorm",
}


@pytest.mark.parametrize("case", sorted(CPU_ONLY_NANS))
def test_cpu_only_nans_are_absent_under_the_cuda_policy(case: str) -> None:
    model, batch, kwargs = getattr(cases, case)()
    native = _diagnose(model, batch, **kwargs)
    assert native.forward_origin is not None and native.forward_origin.module == CPU_ONLY_NANS[case]
    cuda = _diagnose(model, batch, policy="cuda", **kwargs)
    assert cuda.forward_origin is None, cuda.to_text()


@pytest.mark.parametrize("case", sorted(CPU_ONLY_NANS))
def test_cpu_only_nans_carry_the_policy_note(case: str) -> None:
    model, batch, kwargs = getattr(cases, case)()
    report = _diagnose(model, batch, **kwargs)
    assert report.forward_origin is not None and report.forward_origin.module == CPU_ONLY_NANS[case]
    assert report.forward_origin.policy_note, report.to_text()
