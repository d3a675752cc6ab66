"""Recommendations as small rules (pure: no torch, no live model).

A diagnosis is first placed in one :data:`Situation` (the batch, the loss, broken weights, a forward origin, a
loss-scale overflow, a backward origin, an empty loss-scale window, or none of these). Each :class:`Rule` says in
which situation it is considered, when it applies there, what it proposes, how its proposal is verified (a key
of ``fixes.verify``'s verifiers) and what it costs. :data:`RULES` is ordered: most direct remedy first. A new
remedy is a new rule, not a new branch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Optional

from ..analysis import NearLimit, Origin
from ..analysis.scale import margin_scale
from ..numbers import fmt_scale
from ..records import BATCH, LOSS, ModuleInfo, Recommendation, RunInfo
from ..thresholds import UNDERFLOW_VERDICT_SHARE
from . import rules_backward as rb
from . import rules_rewrites as rw
from .context import Context
from .rules_upcast import (
    HIDDEN_RULE,
    UPCAST_COST,
    hidden_applies,
    op_site_applies,
    propose_hidden_upcast,
    propose_op_upcast,
)
from .snippets import fallback_snippet, scale_literal, stored_low

Situation = Literal["batch", "loss", "weights", "forward", "scale", "backward", "no_window", "other"]
# How a proposal is proven by a re-run (see fixes/verify.py): the float32 fallback loop from the origin, the step
# in bfloat16, the unchanged step at the proposed loss scale; "none": a code change the re-run cannot apply.
# "rewrite": the step re-run with the rewrite's arithmetic (fixes.rewrites), which must be applied and finite.
# "upcast": the op resolved at its source line run in float32 by ampdoctor.fp32_op (fixes.verify_upcast).
VerifyKind = Literal["fallback", "bf16", "loss_scale", "rewrite", "upcast", "none"]

FILL_OPS = frozenset(
    {"aten::masked_fill", "aten::fill", "aten::full", "aten::where", "aten::new_full", "aten::scalar_tensor"}
)


def situation(ctx: Context) -> Situation:
    """The one situation a diagnosis is in (the first that holds, in this order)."""
    f, fwd = ctx.findings, ctx.fwd
    if fwd is not None and fwd.module == BATCH:
        return "batch"
    if fwd is not None and fwd.module == LOSS:
        return "loss"
    if ctx.broken_weights():
        return "weights"
    if fwd is not None:
        return "forward"
    if f.scale is not None and f.scale.largest_finite_scale is not None:
        return "scale"
    if ctx.bwd is not None:
        return "backward"
    if f.window is not None and f.window.empty and f.verdict in ("underflow", "healthy"):
        return "no_window"
    return "other"


def _always(ctx: Context) -> bool:
    return True


@dataclass(frozen=True)
class Rule:
    """One remedy: considered in ``situation``, proposed when ``applies``; ``verify`` names how a re-run proves it;
    ``cost`` says what it gives up."""

    name: str
    situation: Situation
    propose: Callable[[Context], Recommendation]
    verify: VerifyKind
    cost: str
    applies: Callable[[Context], bool] = _always
    rewrite: str = ""  # for verify "rewrite": which rewrite fixes.rewrites runs ("sigmoid", "softmax", "scale_first")
    # A proposal made on a hint (a Sigmoid module somewhere): dropped when its re-run never met the pattern.
    drop_unmet: bool = False

    def __call__(self, ctx: Context) -> Optional[Recommendation]:
        if not self.applies(ctx):
            return None
        return dataclasses.replace(self.propose(ctx), rule=self.name)


# -- the proposals -----------------------------------------------------------------------------------------


def _fix_batch(ctx: Context) -> Recommendation:
    assert ctx.fwd is not None
    return Recommendation(
        action="fix_batch",
        modules=(),
        title=f"the batch itself holds non-finite values ({ctx.fwd.tensor}): fix the data, not the model",
        snippet="assert all(torch.isfinite(t).all() for t in batch_tensors), 'bad batch'",
    )


def _fix_loss_forward(ctx: Context) -> Recommendation:
    return Recommendation(
        action="fix_loss",
        modules=(),
        title="the loss function made the non-finite value from a finite model output: compute it in "
        "float32 and keep log/div arguments away from zero",
        snippet="with torch.autocast(device_type, enabled=False):\n"
        "    loss = criterion(output.float(), targets)\n"
        "# e.g. torch.log(p.clamp_min(torch.finfo(p.dtype).tiny)) instead of torch.log(p)",
    )


def _fix_weights(ctx: Context) -> Recommendation:
    broken = ctx.broken_weights()
    return Recommendation(
        action="fix_weights",
        modules=tuple(sorted({name.rsplit(".", 1)[0] for name in broken})),
        title=f"the weights are already non-finite ({', '.join(broken[:5])}): no precision change can fix "
        "that; restore them from an earlier checkpoint and look for the first step that went bad",
        snippet="ampdoctor scan checkpoint.pt   # which tensors hold inf/NaN, and since when",
    )


def _mask_value(ctx: Context) -> Optional[float]:
    """A finite fill constant too large for the format (``masked_fill(mask, -1e9)`` in float16) becomes inf."""
    op = ctx.fwd.op if ctx.fwd is not None else None
    if op is None or op.op.split(".")[0] not in FILL_OPS:
        return None
    return next((v for v in op.scalar_args if abs(v) >= ctx.run.limits.overflow_threshold), None)


def _mask_constant(ctx: Context) -> Recommendation:
    assert ctx.fwd is not None
    limits = ctx.run.limits
    return Recommendation(
        action="mask_constant",
        modules=(ctx.fwd.module,),
        title=f"the fill constant {_mask_value(ctx):g} does not fit {limits.dtype} (max {limits.max:g}): use the "
        "dtype's own minimum",
        snippet="scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)",
    )


def origin_fallback(origin: Origin, run: RunInfo, why: str, modules: tuple[ModuleInfo, ...] = ()) -> Recommendation:
    """Run the origin module in float32; at the root (which would be the whole model), compute the op in float32."""
    if origin.module == "":
        where = ""
        line = f"the op in {origin.class_name}.forward that makes the value (no op was named: see the origin)"
        if origin.op is not None and origin.op.location is not None:
            loc = origin.op.location
            where = f" at {loc.file}:{loc.line} ({loc.code})"
            line = "the line named above"
        return Recommendation(
            action="fix_code",
            modules=(),
            title=f"<root> ({origin.class_name}): {why}{where}; a float32 fallback would cover the whole model, "
            "so compute that op in float32 (or rescale it) instead",
            snippet=f"with torch.autocast({run.device_type!r}, enabled=False):\n    y = op(x.float())  # {line}",
        )
    return Recommendation(
        action="fp32_fallback",
        modules=(origin.module,),
        title=f"run {origin.module} ({origin.class_name}) in float32: {why}",
        snippet=fallback_snippet([origin.module], run.device_type, stored_low(modules, [origin.module])),
    )


def _forward_fallback(ctx: Context) -> Recommendation:
    assert ctx.fwd is not None
    return origin_fallback(ctx.fwd, ctx.run, f"its own code made {ctx.fwd.tensor} non-finite from finite inputs",
                           ctx.modules)


def _keep_applies(ctx: Context) -> bool:
    """Hugging Face loads modules listed in ``_keep_in_fp32_modules`` in float32 when the rest is float16."""
    origin = ctx.fwd
    if not ctx.run.huggingface or origin is None or origin.module in ("", LOSS, BATCH):
        return False
    info = next((m for m in ctx.modules if m.name == origin.module), None)
    # Weights already in float32 (plain AMP): the setting changes nothing.
    return info is not None and any(p.stats.dtype == ctx.run.limits.dtype for p in info.params)


def _keep_in_fp32(ctx: Context) -> Recommendation:
    assert ctx.fwd is not None
    leaf = ctx.fwd.module.rsplit(".", 1)[-1]
    return Recommendation(
        action="keep_in_fp32",
        modules=(ctx.fwd.module,),
        title=f"its weights are stored in {ctx.run.limits.dtype}: have Hugging Face keep '{leaf}' modules in float32",
        snippet=f"{ctx.run.model_class}._keep_in_fp32_modules = ['{leaf}']"
        "  # before from_pretrained(..., torch_dtype=...)",
    )


# bfloat16 needs hardware support: said in every bfloat16 recommendation, so a T4/V100 user skips it.
BF16_HARDWARE = "on CUDA it needs compute capability 8.0 or newer (A100, H100, RTX 30xx+; T4 and V100 have none)"
BF16_TITLE = (
    f"autocast to bfloat16 where the device supports it (float32's range, no loss scaling needed; {BF16_HARDWARE})"
)


def _bf16(ctx: Context, title: str = BF16_TITLE) -> Recommendation:
    return Recommendation(
        action="bf16",
        modules=(),
        title=title,
        snippet=f"with torch.autocast({ctx.run.device_type!r}, dtype=torch.bfloat16):\n"
        "    loss = criterion(model(inputs), targets)",
    )


def _bf16_no_window(ctx: Context) -> Recommendation:
    return _bf16(ctx, "no loss scale fits float16 for this model: autocast to bfloat16 where the device supports it "
                 f"({BF16_HARDWARE})")


def _safe_scale(ctx: Context) -> Recommendation:
    scale = ctx.findings.scale
    assert scale is not None and scale.largest_finite_scale is not None
    safe = scale.largest_finite_scale
    start = margin_scale(safe, ctx.margin_bits)
    return Recommendation(
        action="loss_scale",
        modules=(),
        title=(
            f"gradients overflow at scale {fmt_scale(scale.used_scale)} but are finite at {fmt_scale(safe)}: "
            + ("GradScaler's skip-and-back-off handles this; optionally start lower"
               if scale.harmless else "GradScaler would have to back off to a scale that loses gradients")
            + (f" (start at {fmt_scale(start)}, {ctx.margin_bits:g} bit(s) below it)" if start < safe else "")
        ),
        snippet=f"scaler = torch.amp.GradScaler({ctx.run.device_type!r}, init_scale={scale_literal(start)})",
    )


def _harmful_scale(ctx: Context) -> bool:
    """A loss-scale overflow GradScaler cannot handle, made by a module of the model."""
    scale, bwd = ctx.findings.scale, ctx.bwd
    return scale is not None and not scale.harmless and bwd is not None and bwd.module != LOSS


def _scale_fallback(ctx: Context) -> Recommendation:
    assert ctx.bwd is not None
    return origin_fallback(ctx.bwd, ctx.run, "its backward makes the gradient non-finite", ctx.modules)


def _fix_loss_backward(ctx: Context) -> Recommendation:
    return Recommendation(
        action="fix_loss",
        modules=(),
        title="the gradient reaching the model is already non-finite at scale 1: the loss's gradient "
        "does not fit the model's output dtype; reduce it (mean instead of sum) or compute the loss "
        "in float32",
        snippet="loss = criterion(output.float(), targets)  # reduction='mean'",
    )


def _backward_fallback(ctx: Context) -> Recommendation:
    assert ctx.bwd is not None
    return origin_fallback(ctx.bwd, ctx.run, "its backward makes the gradient non-finite even at scale 1", ctx.modules)


def _underflows(ctx: Context) -> bool:
    """Underflow is the verdict, or would be but for a hidden overflow (which outranks it)."""
    under = ctx.findings.underflow
    if ctx.findings.verdict == "hidden_overflow":
        return under is not None and under.share >= UNDERFLOW_VERDICT_SHARE
    return ctx.findings.verdict == "underflow" and under is not None


def _raise_scale(ctx: Context) -> Recommendation:
    under, window, run = ctx.findings.underflow, ctx.findings.window, ctx.run
    assert under is not None
    bigger = margin_scale(window.max_safe, ctx.margin_bits) if window is not None and window.max_safe else (
        run.scale * 2.0**8)
    return Recommendation(
        action="loss_scale",
        modules=tuple(s.module for s in under.spots[:5]),
        title=f"{under.share:.1%} of gradient values underflow to zero at scale {fmt_scale(run.scale)}: "
        f"raise the loss scale ({under.reference})",
        snippet=f"scaler = torch.amp.GradScaler({run.device_type!r}, init_scale={scale_literal(bigger)})",
    )


def _outside_window(ctx: Context) -> bool:
    window = ctx.findings.window
    return (
        not _underflows(ctx)
        and window is not None
        and not window.contains_current
        and bool(window.max_safe)
        and bool(window.min_useful)
    )


def _into_window(ctx: Context) -> Recommendation:
    window, run = ctx.findings.window, ctx.run
    assert window is not None and window.max_safe
    return Recommendation(
        action="loss_scale",
        modules=(),
        title=f"the loss scale {fmt_scale(run.scale)} is outside the measured window "
        f"[{fmt_scale(window.min_useful)}, {fmt_scale(window.max_safe)}]",
        snippet=f"scaler = torch.amp.GradScaler({run.device_type!r}, "
        f"init_scale={scale_literal(margin_scale(window.max_safe, ctx.margin_bits))})",
    )


def _tight_output(ctx: Context) -> Optional[NearLimit]:
    return next(
        (n for n in ctx.findings.near_limit if n.tensor.startswith("out") and math.isfinite(n.headroom_bits)), None
    )


def _near_limit_fallback(ctx: Context) -> Recommendation:
    near = _tight_output(ctx)
    assert near is not None
    return Recommendation(
        action="fp32_fallback",
        modules=(near.module,),
        title=f"{near.label} is {near.headroom_bits:.2f} bit from the {ctx.run.limits.dtype} max: "
        "consider running it in float32 before it overflows",
        snippet=fallback_snippet([near.module], ctx.run.device_type, stored_low(ctx.modules, [near.module])),
    )


def _log_of(inner: str) -> Callable[[Context], bool]:
    """The origin op is ``log`` and its source line takes the log of ``inner``'s result (not the fused form)."""

    def applies(ctx: Context) -> bool:
        op = ctx.fwd.op if ctx.fwd is not None else None
        if op is None or op.op.split(".")[0] != "aten::log" or op.location is None:
            return False
        code = op.location.code.replace("logsigmoid", "").replace("log_softmax", "")
        return inner in code and "log" in code

    return applies


_FUSED = {
    "sigmoid": ("F.logsigmoid(x)", "log(sigmoid(x))", "sigmoid(x) rounds to 0 in float16 below x = -17"),
    "softmax": ("torch.log_softmax(x, dim)", "log(softmax(x, dim))", "small probabilities round to 0"),
}


def _fused_log(inner: str) -> Callable[[Context], Recommendation]:
    def propose(ctx: Context) -> Recommendation:
        assert ctx.fwd is not None and ctx.fwd.op is not None and ctx.fwd.op.location is not None
        fused, plain, why = _FUSED[inner]
        loc = ctx.fwd.op.location
        where = f"{loc.file.rsplit('/', 1)[-1]}:{loc.line}"
        return Recommendation(
            action="rewrite",
            modules=() if ctx.fwd.module in (LOSS, BATCH) else (ctx.fwd.module,),
            title=f"compute {plain} as {fused} at {where}: {why}, and log(0) is -inf; the fused form stays "
            "finite and needs no float32",
            snippet=f"# was: {loc.code.strip()}\n"
            + ("y = torch.nn.functional.logsigmoid(x)" if inner == "sigmoid" else "y = torch.log_softmax(x, dim)"),
        )

    return propose


_MATMUL_OPS = frozenset({"aten::matmul", "aten::bmm", "aten::mm", "aten::baddbmm"})


def _scores_line(ctx: Context) -> bool:
    """The origin op is a matmul of something with a transposed operand (attention scores) at a known line."""
    op = ctx.fwd.op if ctx.fwd is not None else None
    if op is None or op.op.split(".")[0] not in _MATMUL_OPS or op.location is None:
        return False
    code = op.location.code
    return ("@" in code or "matmul(" in code or "bmm(" in code) and any(
        t in code for t in ("transpose(", ".T", ".mT", "permute(")
    )


def _scale_first(ctx: Context) -> Recommendation:
    assert ctx.fwd is not None and ctx.fwd.op is not None and ctx.fwd.op.location is not None
    loc = ctx.fwd.op.location
    where = f"{loc.file.rsplit('/', 1)[-1]}:{loc.line}"
    return Recommendation(
        action="rewrite",
        modules=(ctx.fwd.module,) if ctx.fwd.module else (),
        title=f"scale before the product at {where}: the scores overflow {ctx.run.limits.dtype} before the "
        "1/sqrt(d) scaling; scale q first (or q and k by d**-0.25), or use F.scaled_dot_product_attention",
        snippet=f"# was: {loc.code.strip()}  (then / math.sqrt(d))\n"
        "scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # and drop the later division\n"
        "# or: out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)",
    )


# -- the rules, most direct remedy first -------------------------------------------------------------------

_FALLBACK_COST = "the module's activations in float32 (2x their bytes) and its matmuls at float32 speed"
_BF16_COST = "none on hardware with bfloat16 (CUDA compute capability 8.0 or newer); 3 fewer mantissa bits"
_SCALE_COST = "none: one argument of GradScaler"
_CODE_COST = "an edit of the user's code"

RULES: tuple[Rule, ...] = (
    Rule("fix_batch", "batch", _fix_batch, "none", "none: the data is wrong"),
    Rule("loss_logsigmoid", "loss", _fused_log("sigmoid"), "rewrite", _CODE_COST, _log_of("sigmoid"), "sigmoid"),
    Rule("loss_log_softmax", "loss", _fused_log("softmax"), "rewrite", _CODE_COST, _log_of("softmax"), "softmax"),
    Rule("loss_fp32", "loss", rw.loss_outside_autocast, "rewrite", rw.LOSS_COST, rw.loss_in_low_precision, "loss_fp32"),
    Rule("fix_loss", "loss", _fix_loss_forward, "none", _CODE_COST),
    Rule("fix_weights", "weights", _fix_weights, "none", "a restore from an earlier checkpoint"),
    Rule("logsigmoid", "forward", _fused_log("sigmoid"), "rewrite", _CODE_COST, _log_of("sigmoid"), "sigmoid"),
    Rule("log_softmax", "forward", _fused_log("softmax"), "rewrite", _CODE_COST, _log_of("softmax"), "softmax"),
    Rule("scale_first", "forward", _scale_first, "rewrite", _CODE_COST, _scores_line, "scale_first"),
    Rule("subtract_max", "forward", rw.subtract_max, "rewrite", rw.SUBTRACT_MAX_COST, rw.exp_applies, "subtract_max"),
    Rule("squares_fp32", "forward", rw.accumulate_in_float32, "rewrite", rw.SQUARES_COST, rw.squares_applies,
         "squares_fp32"),
    Rule("finfo_eps", "forward", rw.eps_from_finfo, "rewrite", rw.EPS_COST,
         lambda ctx: rw.tiny_literal(ctx) is not None, "finfo_eps"),
    Rule("scaled_mask_constant", "forward", rw.scaled_mask_constant, "rewrite", rw.MASK_COST,
         lambda ctx: rw.scaled_mask_value(ctx) is not None, "mask_constant"),
    Rule("mask_constant", "forward", _mask_constant, "none", _CODE_COST,
         applies=lambda ctx: _mask_value(ctx) is not None),
    Rule("fp32_op", "forward", propose_op_upcast, "upcast", UPCAST_COST, op_site_applies),
    Rule("forward_fallback", "forward", _forward_fallback, "fallback", _FALLBACK_COST),
    Rule("keep_in_fp32", "forward", _keep_in_fp32, "none", _FALLBACK_COST, applies=_keep_applies),
    Rule("forward_bf16", "forward", _bf16, "bf16", _BF16_COST,
         applies=lambda ctx: ctx.float16 and ctx.findings.verdict == "overflow"),
    Rule("safe_scale", "scale", _safe_scale, "loss_scale", _SCALE_COST),
    Rule(HIDDEN_RULE, "scale", propose_hidden_upcast, "upcast", UPCAST_COST, hidden_applies),
    Rule("scale_fallback", "scale", _scale_fallback, "fallback", _FALLBACK_COST, applies=_harmful_scale),
    Rule("scale_bf16", "scale", _bf16, "bf16", _BF16_COST, applies=lambda ctx: ctx.float16 and _harmful_scale(ctx)),
    Rule("bce_with_logits", "backward", rw.bce_with_logits, "rewrite", rw.BCE_COST, rw.bce_applies, "bce_logits",
         drop_unmet=True),
    Rule("safe_branch", "backward", rb.safe_branch, "none", _CODE_COST, applies=rb.reads_saved),
    Rule("keep_off_pole", "backward", rb.keep_off_pole, "none", _CODE_COST, applies=rb.at_pole),
    Rule("loss_gradient", "backward", _fix_loss_backward, "none", _CODE_COST,  # (a loss too large for the dtype)
         applies=lambda ctx: ctx.bwd is not None and ctx.bwd.module == LOSS and not rb.any_applies(ctx)),
    Rule("backward_fallback", "backward", _backward_fallback, "fallback", _FALLBACK_COST,
         applies=lambda ctx: ctx.bwd is not None and ctx.bwd.module != LOSS),
    Rule("backward_bf16", "backward", _bf16, "bf16", _BF16_COST, applies=lambda ctx: ctx.float16),
    Rule("no_window_bf16", "no_window", _bf16_no_window, "bf16", _BF16_COST, applies=lambda ctx: ctx.float16),
    # The same rewrites for a hidden overflow (no forward origin: an op made inf that a later op hid).
    Rule("hidden_subtract_max", "other", rw.subtract_max, "rewrite", rw.SUBTRACT_MAX_COST, rw.exp_applies,
         "subtract_max"),
    Rule("hidden_squares_fp32", "other", rw.accumulate_in_float32, "rewrite", rw.SQUARES_COST, rw.squares_applies,
         "squares_fp32"),
    Rule("hidden_finfo_eps", "other", rw.eps_from_finfo, "rewrite", rw.EPS_COST,
         lambda ctx: rw.tiny_literal(ctx) is not None, "finfo_eps"),
    Rule("hidden_mask_constant", "other", rw.scaled_mask_constant, "rewrite", rw.MASK_COST,
         lambda ctx: rw.scaled_mask_value(ctx) is not None, "mask_constant"),
    # A rewrite first; where none applies, only the op in float32 (no code edit).
    Rule(HIDDEN_RULE + "_other", "other", propose_hidden_upcast, "upcast", UPCAST_COST, hidden_applies),
    Rule("raise_scale", "other", _raise_scale, "loss_scale", _SCALE_COST, applies=_underflows),
    Rule("underflow_bf16", "other", _bf16, "bf16", _BF16_COST, applies=lambda ctx: ctx.float16 and _underflows(ctx)),
    Rule("into_window", "other", _into_window, "loss_scale", _SCALE_COST, applies=_outside_window),
    Rule("near_limit_fallback", "other", _near_limit_fallback, "none", _FALLBACK_COST,
         applies=lambda ctx: _tight_output(ctx) is not None),
)
RULES_BY_NAME = {rule.name: rule for rule in RULES}


def rule_of(rec: Recommendation) -> Optional[Rule]:
    """The rule that proposed a recommendation (None for one built elsewhere, or loaded from an older report)."""
    return RULES_BY_NAME.get(rec.rule)
