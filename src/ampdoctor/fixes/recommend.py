"""Turn findings into recommendations (pure: no torch, no live model)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from ..analysis import Findings, Origin
from ..records import BATCH, LOSS, ModuleInfo, Recommendation, RunInfo


def scale_literal(scale: float) -> str:
    """A loss scale as Python that evaluates to it exactly: 65536.0, or 2.0**40 for large powers of two."""
    exponent = math.log2(scale) if scale > 0 else math.nan
    if exponent.is_integer() and abs(exponent) > 16:
        return f"2.0**{int(exponent)}"
    return repr(float(scale))


def fallback_snippet(modules: list[str], device_type: str) -> str:
    names = ", ".join(repr(m) for m in modules)
    return (
        "import ampdoctor\n"
        f"ampdoctor.fp32_fallback(model, [{names}])  # these run in float32; AMP stays on everywhere else\n"
        "# without ampdoctor at training time, wrap the module's forward yourself:\n"
        f"#   with torch.autocast({device_type!r}, enabled=False): out = module(*(t.float() for t in inputs))"
    )


FILL_OPS = frozenset(
    {"aten::masked_fill", "aten::fill", "aten::full", "aten::where", "aten::new_full", "aten::scalar_tensor"}
)


def _fallback(origin: Origin, run: RunInfo, why: str) -> Recommendation:
    if origin.module == "":
        where = ""
        if origin.op is not None and origin.op.location is not None:
            loc = origin.op.location
            where = f" at {loc.file}:{loc.line} ({loc.code})"
        return Recommendation(
            action="fix_code",
            modules=(),
            title=f"<root> ({origin.class_name}): {why}{where}; a float32 fallback would cover the whole model, "
            "so compute that op in float32 (or rescale it) instead",
            snippet=f"with torch.autocast({run.device_type!r}, enabled=False):\n"
            "    y = op(x.float())  # the line named above",
        )
    return Recommendation(
        action="fp32_fallback",
        modules=(origin.module,),
        title=f"run {origin.module} ({origin.class_name}) in float32: {why}",
        snippet=fallback_snippet([origin.module], run.device_type),
    )


def _mask_constant(origin: Origin, run: RunInfo) -> Optional[Recommendation]:
    """A finite fill constant too large for the format (``masked_fill(mask, -1e9)`` in float16) becomes inf."""
    op = origin.op
    if op is None or op.op.split(".")[0] not in FILL_OPS:
        return None
    if not any(abs(v) >= run.limits.overflow_threshold for v in op.scalar_args):
        return None
    constant = next(v for v in op.scalar_args if abs(v) >= run.limits.overflow_threshold)
    return Recommendation(
        action="mask_constant",
        modules=(origin.module,),
        title=f"the fill constant {constant:g} does not fit {run.limits.dtype} (max {run.limits.max:g}): use the "
        "dtype's own minimum",
        snippet="scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)",
    )


def _keep_in_fp32(origin: Origin, run: RunInfo, modules: list[ModuleInfo]) -> Optional[Recommendation]:
    """Hugging Face loads modules listed in ``_keep_in_fp32_modules`` in float32 when the rest is float16."""
    if not run.huggingface or origin.module in ("", LOSS, BATCH):
        return None
    info = next((m for m in modules if m.name == origin.module), None)
    if info is None or not any(p.stats.dtype == run.limits.dtype for p in info.params):
        return None  # its weights are float32 already (plain AMP): the setting changes nothing
    leaf = origin.module.rsplit(".", 1)[-1]
    return Recommendation(
        action="keep_in_fp32",
        modules=(origin.module,),
        title=f"its weights are stored in {run.limits.dtype}: have Hugging Face keep '{leaf}' modules in float32",
        snippet=f"{run.model_class}._keep_in_fp32_modules = ['{leaf}']  # before from_pretrained(..., torch_dtype=...)",
    )


def _bf16(run: RunInfo) -> Optional[Recommendation]:
    if run.limits.dtype != "float16":
        return None
    return Recommendation(
        action="bf16",
        modules=(),
        title="autocast to bfloat16 where the device supports it (float32's range, no loss scaling needed)",
        snippet=f"with torch.autocast({run.device_type!r}, dtype=torch.bfloat16):\n"
        "    loss = criterion(model(inputs), targets)",
    )


def _nonfinite_weights(origin: Optional[Origin], modules: list[ModuleInfo]) -> list[str]:
    """Parameters of the origin module that already hold inf/NaN."""
    if origin is None:
        return []
    return [p.name for m in modules if m.name == origin.module for p in m.params if not p.stats.is_finite]


def recommend(findings: Findings, run: RunInfo, modules: Optional[list[ModuleInfo]] = None) -> list[Recommendation]:
    """The remedies that apply to the findings, most direct first (unverified: ``verify`` re-runs them)."""
    modules = modules or []
    recs: list[Recommendation] = []
    fwd, bwd = findings.forward_origin, findings.backward_origin
    if fwd is not None and fwd.module == BATCH:
        recs.append(
            Recommendation(
                action="fix_batch",
                modules=(),
                title=f"the batch itself holds non-finite values ({fwd.tensor}): fix the data, not the model",
                snippet="assert all(torch.isfinite(t).all() for t in batch_tensors), 'bad batch'",
            )
        )
        return recs
    if fwd is not None and fwd.module == LOSS:
        recs.append(
            Recommendation(
                action="fix_loss",
                modules=(),
                title="the loss function made the non-finite value from a finite model output: compute it in "
                "float32 and keep log/div arguments away from zero",
                snippet="with torch.autocast(device_type, enabled=False):\n"
                "    loss = criterion(output.float(), targets)\n"
                "# e.g. torch.log(p.clamp_min(torch.finfo(p.dtype).tiny)) instead of torch.log(p)",
            )
        )
        return recs
    broken = _nonfinite_weights(fwd or bwd, modules)
    if broken:
        recs.append(
            Recommendation(
                action="fix_weights",
                modules=tuple(sorted({name.rsplit(".", 1)[0] for name in broken})),
                title=f"the weights are already non-finite ({', '.join(broken[:5])}): no precision change can fix "
                "that; restore them from an earlier checkpoint and look for the first step that went bad",
                snippet="ampdoctor scan checkpoint.pt   # which tensors hold inf/NaN, and since when",
            )
        )
        return recs
    if fwd is not None:
        mask = _mask_constant(fwd, run)
        if mask is not None:
            recs.append(mask)
        recs.append(_fallback(fwd, run, f"its own code made {fwd.tensor} non-finite from finite inputs"))
        keep = _keep_in_fp32(fwd, run, modules)
        if keep is not None:
            recs.append(keep)
        bf16 = _bf16(run)
        if bf16 is not None and findings.verdict == "overflow":
            recs.append(bf16)
        return recs
    scale = findings.scale
    if scale is not None and scale.largest_finite_scale is not None:
        safe = scale.largest_finite_scale
        harmless = scale.harmless
        recs.append(
            Recommendation(
                action="loss_scale",
                modules=(),
                title=(
                    f"gradients overflow at scale {scale.used_scale:g} but are finite at {safe:g}: "
                    + ("GradScaler's skip-and-back-off handles this; optionally start lower"
                       if harmless else "GradScaler would have to back off to a scale that loses gradients")
                ),
                snippet=f"scaler = torch.amp.GradScaler({run.device_type!r}, init_scale={scale_literal(safe)})",
            )
        )
        if not harmless and bwd is not None and bwd.module != LOSS:
            recs.append(_fallback(bwd, run, "its backward makes the gradient non-finite"))
            bf16 = _bf16(run)
            if bf16 is not None:
                recs.append(bf16)
        return recs
    if bwd is not None:
        if bwd.module == LOSS:
            recs.append(
                Recommendation(
                    action="fix_loss",
                    modules=(),
                    title="the gradient reaching the model is already non-finite at scale 1: the loss's gradient "
                    "does not fit the model's output dtype; reduce it (mean instead of sum) or compute the loss "
                    "in float32",
                    snippet="loss = criterion(output.float(), targets)  # reduction='mean'",
                )
            )
        else:
            recs.append(_fallback(bwd, run, "its backward makes the gradient non-finite even at scale 1"))
        bf16 = _bf16(run)
        if bf16 is not None:
            recs.append(bf16)
        return recs
    under = findings.underflow
    window = findings.window
    if window is not None and window.empty and findings.verdict in ("underflow", "healthy"):
        bf16 = _bf16(run)
        if bf16 is not None:
            title = "no loss scale fits float16 for this model: autocast to bfloat16 where the device supports it"
            recs.append(dataclasses.replace(bf16, title=title))
        return recs
    if findings.verdict == "underflow" and under is not None:
        bigger = window.max_safe if window is not None and window.max_safe else run.scale * 2.0**8
        recs.append(
            Recommendation(
                action="loss_scale",
                modules=tuple(s.module for s in under.spots[:5]),
                title=f"{under.share:.1%} of gradient values underflow to zero at scale {run.scale:g}: "
                f"raise the loss scale ({under.reference})",
                snippet=f"scaler = torch.amp.GradScaler({run.device_type!r}, init_scale={scale_literal(bigger)})",
            )
        )
        bf16 = _bf16(run)
        if bf16 is not None:
            recs.append(bf16)
    elif window is not None and not window.contains_current and window.max_safe and window.min_useful:
        recs.append(
            Recommendation(
                action="loss_scale",
                modules=(),
                title=f"the loss scale {run.scale:g} is outside the measured window "
                f"[{window.min_useful:g}, {window.max_safe:g}]",
                snippet=f"scaler = torch.amp.GradScaler({run.device_type!r}, "
                f"init_scale={scale_literal(window.max_safe)})",
            )
        )
    for near in findings.near_limit:
        if near.tensor.startswith("out") and math.isfinite(near.headroom_bits):
            recs.append(
                Recommendation(
                    action="fp32_fallback",
                    modules=(near.module,),
                    title=f"{near.label} is {near.headroom_bits:.2f} bit from the {run.limits.dtype} max: "
                    "consider running it in float32 before it overflows",
                    snippet=fallback_snippet([near.module], run.device_type),
                )
            )
            break
    return recs
