"""``diagnose`` on real Hugging Face architectures: GPT-2, T5 and BERT, tiny configs with random weights, on CPU.

Each model carries its expected answer: a weight is scaled so that one known operation leaves the float16 range
(the arithmetic is in the comments), and the test first checks with a plain autocast forward that the setup
really does what it claims, then asserts where ``diagnose`` puts the origin. Every ``diagnose`` call is wrapped
in ``_untouched``: parameters and buffers byte for byte, ``.grad`` still ``None``, ``training`` flags, RNG
states, no hook left behind, and a later plain AMP step runs no ampdoctor code.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch
from helpers import ampdoctor_frames_during
from torch import nn

import ampdoctor

transformers = pytest.importorskip("transformers")

FP16_MAX = 65504.0
MATMUL_OPS = {"aten::bmm", "aten::mm", "aten::addmm", "aten::matmul", "aten::baddbmm", "aten::linear"}
SEQ = 12


# -- nothing the user owns may change -------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (``torch.equal`` is False for NaN, so compare storage instead)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8).clone()


def _hooks_left(model: nn.Module) -> list[str]:
    left = []
    for name, m in model.named_modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            if getattr(m, attr, None):
                left.append(f"{name or '<root>'}.{attr}")
    for name, p in model.named_parameters():
        if p._backward_hooks:
            left.append(f"tensor hook on {name}")
    module_globals = nn.modules.module
    for attr in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks"):
        if getattr(module_globals, attr, None):
            left.append(f"torch.nn.modules.module.{attr}")
    return left


@contextmanager
def _untouched(model: nn.Module, batch: dict[str, torch.Tensor]) -> Iterator[None]:
    """Asserts that what runs inside changes nothing the user owns and leaves nothing behind."""
    assert not _hooks_left(model), "the test itself left hooks before diagnose"
    state = {k: _bits(v) for k, v in model.state_dict(keep_vars=True).items()}
    assert all(p.grad is None for p in model.parameters())
    training = {n: m.training for n, m in model.named_modules()}
    cpu_rng = torch.get_rng_state().clone()
    py_rng = random.getstate()
    np_rng = np.random.get_state()
    yield
    after = model.state_dict(keep_vars=True)
    assert after.keys() == state.keys()
    changed = [k for k, v in after.items() if not torch.equal(_bits(v), state[k])]
    assert not changed, f"parameters or buffers changed: {changed}"
    assert [n for n, p in model.named_parameters() if p.grad is not None] == [], ".grad fields were set"
    assert {n: m.training for n, m in model.named_modules()} == training, "training flags changed"
    assert torch.equal(torch.get_rng_state(), cpu_rng), "torch CPU RNG state changed"
    assert random.getstate() == py_rng, "python RNG state changed"
    after_np = np.random.get_state()
    assert after_np[0] == np_rng[0] and np.array_equal(after_np[1], np_rng[1]) and after_np[2:] == np_rng[2:]
    assert _hooks_left(model) == [], "hooks left behind"

    def plain_step() -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(**batch)
        out.loss.float().backward()

    assert ampdoctor_frames_during(plain_step) == [], "a later plain AMP step ran ampdoctor code"
    model.zero_grad(set_to_none=True)


def _diagnose(model: nn.Module, batch: dict[str, torch.Tensor], **kwargs: Any) -> ampdoctor.Report:
    with _untouched(model, batch):
        report = ampdoctor.diagnose(model, batch, **kwargs)
    # The report must survive its own JSON round trip (what `ampdoctor diagnose --json` writes).
    again = ampdoctor.Report.from_json(report.to_json())
    assert again.verdict == report.verdict
    return report


@torch.no_grad()
def _outputs(model: nn.Module, batch: dict[str, torch.Tensor], names: list[str], dtype: torch.dtype) -> dict:
    """A plain autocast forward (no ampdoctor): the named modules' (first) outputs, and the loss."""
    modules = dict(model.named_modules())
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for name in names:

        def hook(mod: nn.Module, args: Any, out: Any, name: str = name) -> None:
            seen[name] = out[0] if isinstance(out, tuple) else out

        handles.append(modules[name].register_forward_hook(hook))
    try:
        with torch.autocast("cpu", dtype=dtype):
            seen["loss"] = model(**batch).loss
    finally:
        for h in handles:
            h.remove()
    return seen


def _finite_max(t: torch.Tensor) -> float:
    return float(t.float().abs().max())


def _call(report: ampdoctor.Report, module: str) -> Any:
    return next(c for c in report.trace.calls if c.module == module and c.call == 0)


def _assert_matmul_zoom(origin: Any, file_name: str, code_part: str) -> None:
    op = origin.op
    assert op is not None, "the op zoom found no op inside the origin"
    print("op zoom:", op.op, op.location)
    assert op.op in MATMUL_OPS, op.op
    assert op.input_dtypes[:2] == ("float16", "float16")
    assert all(m is not None and m < FP16_MAX for m in op.input_abs_max), "the op's inputs were in range"
    assert op.output_posinf_count + op.output_neginf_count > 0, "the op made an inf"
    assert op.location is not None
    assert os.path.basename(op.location.file) == file_name, op.location
    assert code_part in op.location.code, op.location


# -- GPT-2 ----------------------------------------------------------------------------------------------------


def _gpt2(overflow: bool) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager",
    )
    model = transformers.GPT2LMHeadModel(config)  # train mode, dropout 0.1: diagnose must replay the same masks
    if overflow:
        # c_attn is a Conv1D with weight (n_embd, 3 * n_embd) = [W_q | W_k | W_v]. Make W_k = W_q and scale both
        # by 1000: q = k has entries ~ 0.11 * 1000 ~ 110 (|x|max ~ 370, fine in fp16), and the diagonal scores
        # q . k = |q|^2 ~ 16 dims * 110^2 ~ 2e5 > 65504: the attention's own fp16 matmul overflows.
        with torch.no_grad():
            w = model.transformer.h[0].attn.c_attn.weight
            w[:, 32:64] = w[:, 0:32]
            w[:, 0:64] *= 1000.0
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def test_gpt2_attention_scores_overflow_inside_attention() -> None:
    model, batch = _gpt2(overflow=True)
    seen = _outputs(model, batch, ["transformer.h.0.attn.c_attn", "transformer.h.0.attn"], torch.float16)
    assert _finite_max(seen["transformer.h.0.attn.c_attn"]) < FP16_MAX / 16, "setup: c_attn must stay in range"
    assert not torch.isfinite(seen["transformer.h.0.attn"]).all(), "setup: the attention output is non-finite"

    report = _diagnose(model, batch, dtype=torch.float16)

    assert report.verdict == "overflow", report.to_text()
    assert report.run.loss_source == "output.loss"
    origin = report.forward_origin
    assert origin is not None and origin.exact
    # The GPT2Attention itself, not c_attn (finite output) nor c_proj (merely received the NaN).
    assert (origin.module, origin.call, origin.class_name) == ("transformer.h.0.attn", 0, "GPT2Attention")
    assert origin.tensor == "out[0]"
    _assert_matmul_zoom(origin, "modeling_gpt2.py", "torch.matmul(query, key.transpose(-1, -2))")
    assert origin.op.location.function == "eager_attention_forward"
    c_attn = _call(report, "transformer.h.0.attn.c_attn")
    assert all(r.stats.is_finite for r in c_attn.outputs)
    assert "transformer.h.0.attn.c_proj" in report.findings.propagation
    assert "transformer.h.0.attn.c_attn" not in report.findings.propagation
    assert report.exit_code == 1


def test_gpt2_origin_input_max_ignores_the_attention_mask() -> None:
    """The origin's "inputs finite (|x|max ...)" is the data's magnitude, not the finfo.min of the causal mask.

    GPT2Attention receives ``attention_mask`` as a keyword input: a float32 additive mask filled with
    ``torch.finfo(torch.float32).min`` (-3.4e38), an intentional fill. Reporting |x|max 3.4e38 for inputs of
    magnitude ~3 points the reader at a non-existent huge input.
    """
    model, batch = _gpt2(overflow=True)
    report = _diagnose(model, batch, dtype=torch.float16)
    origin = report.forward_origin
    assert origin is not None and origin.module == "transformer.h.0.attn"
    attn = _call(report, "transformer.h.0.attn")
    mask = next(r for r in attn.inputs if r.path == "kwargs['attention_mask']")
    assert mask.stats.min is not None and mask.stats.min <= torch.finfo(torch.float32).min  # the test's premise
    hidden = next(r for r in attn.inputs if r.path == "args[0]")
    assert origin.input_abs_max == pytest.approx(hidden.stats.abs_max)
    assert "3.403e+38" not in report.to_text()


def test_gpt2_same_model_is_healthy_in_bfloat16() -> None:
    model, batch = _gpt2(overflow=True)
    seen = _outputs(model, batch, ["transformer.h.0.attn"], torch.bfloat16)
    assert torch.isfinite(seen["transformer.h.0.attn"]).all() and torch.isfinite(seen["loss"])

    report = _diagnose(model, batch, dtype=torch.bfloat16)

    assert report.verdict == "healthy", report.to_text()
    assert report.forward_origin is None and report.backward_origin is None
    assert report.run.scale == 1.0  # bf16 needs no loss scale
    assert report.run.loss_source == "output.loss"
    assert report.findings.near_limit == ()
    assert report.exit_code == 0


def test_gpt2_healthy_in_float16_with_causal_and_padding_mask() -> None:
    model, batch = _gpt2(overflow=False)
    mask = torch.ones_like(batch["input_ids"])
    mask[1, 9:] = 0
    batch = {**batch, "attention_mask": mask}

    report = _diagnose(model, batch, dtype=torch.float16)

    assert report.verdict == "healthy", report.to_text()
    assert report.forward_origin is None and report.backward_origin is None
    assert report.findings.warnings == ()


# -- T5 -------------------------------------------------------------------------------------------------------


def _scale_to_max(weight: torch.Tensor, target: float) -> None:
    """Scale a weight so its largest magnitude is ``target`` (kept below 65504: the weight itself still casts)."""
    with torch.no_grad():
        weight.mul_(target / weight.abs().max())


T5_FF = {
    # encoder: num_layers=2, the last block's feed-forward (layer[-1] of a T5Block is T5LayerFF)
    "encoder": "encoder.block.1.layer.1.DenseReluDense.wo",
    # decoder: one block; layer[-1] is T5LayerFF after self- and cross-attention
    "decoder": "decoder.block.0.layer.2.DenseReluDense.wo",
}


@pytest.mark.parametrize("stack", sorted(T5_FF))
def test_t5_feed_forward_overflow_origin_is_wo(stack: str) -> None:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=1, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, attn_implementation="eager",
    )
    model = transformers.T5ForConditionalGeneration(config)
    model.decoder.eval()  # mixed train/eval flags: each must come back as it was
    wo_name = T5_FF[stack]
    wo = model.get_submodule(wo_name)
    # wo: Linear(d_ff=64 -> d_model=32) on relu(wi(x)) (|x|max ~ 3). Weights scaled to |w|max 30000 (fits fp16);
    # 64 terms of ~1 * ~5000 each exceed 65504, so wo's own fp16 mm makes +-inf. The residual stream is float32
    # under autocast, so T5's fp16 clamp (only for float16 hidden states) does not catch it.
    _scale_to_max(wo.weight, 30000.0)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 64, (2, SEQ), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    ids[1, 9:] = 0
    labels = torch.randint(2, 64, (2, 8), generator=gen)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    ff = wo_name.rsplit(".", 1)[0]
    seen = _outputs(model, batch, [f"{ff}.act", wo_name], torch.float16)
    assert torch.isfinite(seen[f"{ff}.act"]).all(), "setup: wo's input is finite"
    assert torch.isinf(seen[wo_name]).any(), "setup: wo's output overflows"
    assert not torch.isfinite(seen["loss"]), "setup: the loss is non-finite"

    report = _diagnose(model, batch, dtype=torch.float16)

    assert report.verdict == "overflow", report.to_text()
    assert report.run.loss_source == "output.loss"
    origin = report.forward_origin
    assert origin is not None and origin.exact
    assert (origin.module, origin.call, origin.class_name, origin.tensor) == (wo_name, 0, "Linear", "out")
    assert origin.bad.posinf_count + origin.bad.neginf_count > 0
    assert origin.input_abs_max is not None and origin.input_abs_max < 100
    _assert_matmul_zoom(origin, "modeling_t5.py", "self.wo(hidden_states)")
    assert ff in report.findings.propagation  # T5DenseActDense merely returned wo's inf
    if stack == "decoder":  # the encoder ran first and is healthy
        assert not any(label.startswith("encoder") for label in report.findings.propagation)


# -- BERT -----------------------------------------------------------------------------------------------------


def _bert(attn: str) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=3, attn_implementation=attn,
    )
    return transformers.BertForSequenceClassification(config)


def _bert_batch(mask_kind: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 64, (2, SEQ), generator=torch.Generator().manual_seed(1))
    ids[1, 8:] = 0  # padding
    keep = torch.ones(2, SEQ, dtype=torch.long)
    keep[1, 8:] = 0
    if mask_kind == "long":
        mask = keep
    elif mask_kind == "bool":
        mask = keep.bool()
    else:  # an additive 4-D float mask with -inf where padded, passed by the user
        mask = torch.zeros(2, 1, SEQ, SEQ)
        mask[1, :, :, 8:] = float("-inf")
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 2])}


@pytest.mark.parametrize(
    ("attn", "mask_kind"), [("eager", "long"), ("eager", "bool"), ("eager", "neginf_4d"), ("sdpa", "long")]
)
def test_bert_padding_mask_is_healthy(attn: str, mask_kind: str) -> None:
    model = _bert(attn)
    batch = _bert_batch(mask_kind)

    report = _diagnose(model, batch, dtype=torch.float16)

    assert report.verdict == "healthy", report.to_text()
    assert report.forward_origin is None and report.backward_origin is None
    assert report.findings.propagation == ()
    assert report.findings.warnings == ()
    assert report.findings.not_captured == ()
    assert report.exit_code == 0
    if attn == "eager":  # the premise: the attention really received a finfo.min / -inf additive mask
        self_attn = _call(report, "bert.encoder.layer.0.attention.self")
        mask = next(r for r in self_attn.inputs if r.path == "kwargs['attention_mask']")
        assert mask.stats.min is not None and mask.stats.min <= torch.finfo(torch.float32).min


def test_bert_intermediate_dense_overflow() -> None:
    model = _bert("eager")
    batch = _bert_batch("long")
    name = "bert.encoder.layer.0.intermediate.dense"
    # intermediate.dense: Linear(32 -> 64) on a LayerNorm output (|x|max ~ 3). Weights scaled to |w|max 30000
    # (fits fp16, so the autocast cast of the weight is fine); sums of 32 terms ~ 1e5 > 65504: its fp16 mm
    # overflows. The GELU after it only receives the inf.
    _scale_to_max(model.get_submodule(name).weight, 30000.0)
    seen = _outputs(model, batch, [name], torch.float16)
    assert torch.isinf(seen[name]).any(), "setup: the dense output overflows"

    report = _diagnose(model, batch, dtype=torch.float16)

    assert report.verdict == "overflow", report.to_text()
    assert report.run.loss_source == "output.loss"
    origin = report.forward_origin
    assert origin is not None and origin.exact
    assert (origin.module, origin.call, origin.class_name, origin.tensor) == (name, 0, "Linear", "out")
    _assert_matmul_zoom(origin, "modeling_bert.py", "self.dense(hidden_states)")
    assert "bert.encoder.layer.0.intermediate.intermediate_act_fn" in report.findings.propagation
