"""Prove recommendations by re-running the step with each fix applied (needs the live model)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional, Union

from torch import nn

from ..analysis import Findings, Origin, backward_origin, forward_origin
from ..analysis.margin import PathTensor, path_headroom
from ..analysis.mechanisms import Instance, Mechanism, mechanism_of
from ..numbers import fmt_scale
from ..records import (
    BATCH,
    LOSS,
    Cost,
    ModuleCall,
    ModuleInfo,
    PassTrace,
    Recommendation,
    TensorRecord,
)
from .context import VerifyContext
from .fallback import Fp32Fallback
from .overflows import describe, made, overflow_free
from .overflows import hiding as _hiding
from .recompute import Recomputed, recompute_mismatch
from .rewrites import FusedLog, ScaleFirst
from .rewrites_lines import LineRewrite, line_rewrite
from .rules import rule_of
from .rules_rewrites import Site, site_of
from .scale_check import verify_loss_scale
from .snippets import fallback_snippet, scale_literal, stored_low
from .upcast import Fp32Op
from .verify_upcast import pasted_site, verify_upcast

# How many re-runs the loop makes before it gives up (each round adds an origin's mechanism, or the instances
# still inside the margin).
MAX_FALLBACK_ROUNDS = 4
# A fallback set doing this share of the step's low-precision work (Linear/Conv FLOPs, or activation bytes) gives
# up most of AMP: still listed when it works (never withhold a working fix), with that said in its evidence.
# Parameters do not count: a fixed DFT basis is large and cheap to run.
MAX_FALLBACK_WORK_SHARE = 0.9
# Bytes per element of the low-precision formats (what a float32 copy costs extra per element).
_EXTRA_BYTES = {"float16": 2, "bfloat16": 2}
_MATMUL_CLASSES = ("Linear", "Conv1d", "Conv2d", "Conv3d", "Bilinear", "LazyLinear")

_UNMET = "the pattern was not met"
_CODE_FIXES = frozenset({"rewrite", "mask_constant", "fix_code", "fix_batch", "fix_loss", "fix_weights"})



def _origin_of(trace: PassTrace, modules: list[ModuleInfo]) -> Optional[Origin]:
    return forward_origin(trace) or backward_origin(trace, modules)


def _within(module: str, chosen: Iterable[str]) -> bool:
    return any(c == "" or module == c or module.startswith(c + ".") for c in chosen)


def _is_ancestor(module: str, chosen: Iterable[str]) -> bool:
    return any(module == "" or c.startswith(module + ".") for c in chosen if c != module)


def _flops(trace: PassTrace, modules: list[ModuleInfo]) -> dict[int, int]:
    """Estimated FLOPs of each Linear/Conv call (by index), from the weight and output shapes."""
    weights = {m.name: next((p for p in m.params if p.name.endswith("weight")), None) for m in modules}
    out: dict[int, int] = {}
    for c in trace.calls:
        weight = weights.get(c.module)
        if c.class_name not in _MATMUL_CLASSES or weight is None or not c.outputs:
            continue
        shape = weight.stats.shape
        per_output = shape[1] if c.class_name.endswith("Linear") else weight.stats.numel // max(shape[0], 1)
        out[c.index] = 2 * c.outputs[0].stats.numel * per_output
    return out


def _low_bytes(c: ModuleCall, low_dtype: str) -> int:
    return sum(r.stats.numel * _EXTRA_BYTES.get(low_dtype, 0) for r in c.outputs if r.stats.dtype == low_dtype)


def work_share(trace: PassTrace, modules: list[ModuleInfo], chosen: list[str], low_dtype: str) -> float:
    """The larger of the chosen modules' shares of the step's Linear/Conv FLOPs and of its low-precision
    activation bytes: how much of AMP a float32 fallback of them would give up."""
    flops = _flops(trace, modules)
    inside = [c for c in trace.calls if c.module != "" and _within(c.module, chosen)]
    total_flops, total_bytes = sum(flops.values()), sum(_low_bytes(c, low_dtype) for c in trace.calls if c.module)
    flop_share = sum(flops.get(c.index, 0) for c in inside) / total_flops if total_flops else 0.0
    byte_share = sum(_low_bytes(c, low_dtype) for c in inside) / total_bytes if total_bytes else 0.0
    return max(flop_share, byte_share)


def fallback_cost(trace: PassTrace, modules: list[ModuleInfo], chosen: list[str], low_dtype: str) -> Cost:
    """Extra bytes of the chosen calls' outputs in float32, and their share of Linear/Conv FLOPs."""
    extra_bytes = sum(_low_bytes(c, low_dtype) for c in trace.calls if _within(c.module, chosen))
    flops = _flops(trace, modules)
    total = sum(flops.values())
    moved = sum(flops.get(c.index, 0) for c in trace.calls if _within(c.module, chosen))
    note = "" if moved else "no Linear/Conv inside: the modules' own matmuls are not counted"
    return Cost(extra_bytes, moved / total if total else 0.0, note)


def _dtype_changes(before: PassTrace, after: PassTrace, chosen: list[str]) -> tuple[list[str], list[str]]:
    """Calls outside the fallback set (and not containing it) whose output dtype changed.

    Returns (changed, followed): ``changed`` had the same input dtypes as before, so something switched their
    autocast off (what verification must rule out); ``followed`` merely got the set's float32 outputs and kept
    their dtype (norms and activations follow their input under autocast), which is expected.
    """

    def dtypes(records: Sequence[TensorRecord]) -> list[str]:
        return [r.stats.dtype for r in records]

    old = {(c.module, c.call): c for c in before.calls}
    changed: list[str] = []
    followed: list[str] = []
    for c in after.calls:
        if _within(c.module, chosen) or _is_ancestor(c.module, chosen):
            continue
        was = old.get((c.module, c.call))
        if was is None or dtypes(was.outputs) == dtypes(c.outputs):
            continue
        (followed if dtypes(was.inputs) != dtypes(c.inputs) else changed).append(c.label)
    return changed, followed


def _mechanisms(ctx: VerifyContext, trace: PassTrace, chosen: list[str]) -> list[Mechanism]:
    limits = ctx.limits
    if limits is None:
        return []
    found = (mechanism_of(trace, m, limits, ctx.margin_bits, _hiding(trace, ctx.sentinel_ops)) for m in chosen)
    unique = {(m.class_name, m.pattern): m for m in found if m is not None}
    return list(unique.values())


def _group(ctx: VerifyContext, module: str, chosen: list[str]) -> list[str]:
    """``module`` and every other instance of its mechanism that needs the remedy at the diagnosed step."""
    mechs = _mechanisms(ctx, ctx.baseline, [module])
    need = [m for mech in mechs for m in mech.needing if m != module and m not in chosen]
    return [module, *need]


def _rerun(ctx: VerifyContext, chosen: list[str], check_scale: float) -> tuple[PassTrace, str]:
    """The step re-run with ``chosen`` in float32. Their calls are recomputed in the backward (:mod:`.recompute`):
    the float32 copies of their inputs and their float32 activations are not held until the backward reaches
    them. A recompute that does not repeat its call makes the re-run raise: it is run again without."""
    try:
        return _rerun_once(ctx, chosen, check_scale, recompute=True)
    except Exception as exc:
        if not recompute_mismatch(exc):
            raise
        return _rerun_once(ctx, chosen, check_scale, recompute=False)


def _rerun_once(ctx: VerifyContext, chosen: list[str], check_scale: float, recompute: bool) -> tuple[PassTrace, str]:
    with Fp32Fallback(ctx.root, chosen), Recomputed(ctx.root, chosen if recompute else []):
        last = ctx.run(check_scale)
        if last.forward_healthy() and not last.healthy() and check_scale > 1:
            # Gradients that are finite at scale 1 are a loss-scale overflow, which GradScaler handles.
            at_one = ctx.run(1.0)
            if at_one.healthy():
                note = f"; the backward overflows at scale {fmt_scale(check_scale)} but is finite at 1 (GradScaler)"
                return at_one, note
    return last, ""


def _inside_margin(ctx: VerifyContext, trace: PassTrace, chosen: list[str]) -> list[Instance]:
    """Instances of the fixed mechanisms still in low precision that overflow, hide one, or keep less than the
    margin in ``trace`` (the re-run with the fix)."""
    mechs = _mechanisms(ctx, trace, chosen)
    return [i for mech in mechs for i in mech.instances if i.reason and i.module not in chosen]


def verify_fallback(ctx: VerifyContext, origin: Origin, check_scale: float) -> Recommendation:
    """Run the origin's mechanism in float32, re-run; add each new origin and each instance of the mechanism still
    inside the margin; stop when the step is finite with the margin kept, or after a bound.

    The root is never a fallback (it is the whole model); any other set that works is listed with its cost, even
    when it runs most of the step's low-precision work in float32 (the evidence says how much).
    """
    chosen: list[str] = []
    scale_note = ""
    current: Optional[Origin] = origin
    tried: list[str] = []
    last: Optional[PassTrace] = None
    add: list[str] = []
    while current is not None or add:
        if current is not None:
            if current.module in (LOSS, BATCH):
                return _unverified(origin, chosen, tried, f"the origin is then {current.label}, which no float32 "
                                                       "fallback of a module can fix")
            if current.module in chosen:
                return _unverified(origin, chosen, tried, f"{current.label} stays the origin even in float32")
            if current.module == "":
                return _unverified(origin, chosen, tried, f"adding {current.label} would run the whole model in "
                                                       "float32, giving up AMP itself")
            add = _group(ctx, current.module, chosen)
        if len(tried) >= MAX_FALLBACK_ROUNDS:
            what = current.label if current is not None else ", ".join(add)
            return _unverified(origin, chosen, tried, f"the origin moved on to {what} (the bound is "
                                                   f"{MAX_FALLBACK_ROUNDS} re-runs)")
        chosen += add
        tried.append(", ".join(chosen))
        last, scale_note = _rerun(ctx, chosen, check_scale)
        current, add = None, []
        if last.healthy():
            add = [i.module for i in _inside_margin(ctx, last, chosen)]
            for module in _hidden_left(ctx, last, chosen):  # a hidden overflow left elsewhere: its mechanism joins
                add += [m for m in _group(ctx, module, chosen + add) if m not in add]
            if add and len(tried) >= MAX_FALLBACK_ROUNDS:
                break  # reported below as holding at this step, without the margin
            continue
        current = _origin_of(last, ctx.modules)
    if last is None or not last.healthy():
        return _unverified(origin, chosen, tried, "the step stayed non-finite and no origin could be placed")
    return _finished(ctx, chosen, last, check_scale, scale_note)


def _hidden_left(ctx: VerifyContext, trace: PassTrace, chosen: list[str]) -> list[str]:
    """Modules (not the loss, not the root) where an op still made inf/NaN from finite inputs in ``trace``, hidden
    or not, outside the fallback set: a remedy must cover them too."""
    found = {o.module for o in made(trace, ctx.sentinel_ops)}
    return sorted(m for m in found if m not in (LOSS, BATCH, "") and not _within(m, chosen))


def _path(ctx: VerifyContext, trace: PassTrace, chosen: list[str], inside: bool = False) -> list[PathTensor]:
    """The low-precision tensors on the fixed mechanisms' path in ``trace`` (analysis.margin), least headroom
    first: the fixed modules' and every instance's outputs and op peaks, and their consumers up to the next
    normalisation or softmax. ``inside``: the fixed modules' own calls stay low precision (a rewrite)."""
    if ctx.limits is None:
        return []
    instances = [i.module for mech in _mechanisms(ctx, trace, chosen) for i in mech.instances]
    if inside:
        return path_headroom(trace, [], [*chosen, *instances], ctx.limits)
    return path_headroom(trace, chosen, instances, ctx.limits)


def _spare_bits(ctx: VerifyContext, trace: PassTrace, chosen: list[str], inside: bool = False) -> float:
    """The smallest headroom left on the fixed mechanisms' path in the re-run (inf when nothing is measured)."""
    return min((p.headroom_bits for p in _path(ctx, trace, chosen, inside)), default=math.inf)


def _margin_note(ctx: VerifyContext, tight: list[PathTensor]) -> str:
    return f"; inside the {ctx.margin_bits:g}-bit margin on its path: " + ", ".join(p.describe() for p in tight[:4])


def _hidden_note(ctx: VerifyContext, trace: PassTrace) -> str:
    return describe(made(trace, ctx.sentinel_ops))


def _finished(ctx: VerifyContext, chosen: list[str], last: PassTrace, check_scale: float, scale_note: str
              ) -> Recommendation:
    changed, followed = _dtype_changes(ctx.baseline, last, chosen)
    kept = sum(
        1
        for c in last.calls
        if not _within(c.module, chosen) and any(r.stats.dtype == ctx.low_dtype for r in c.outputs)
    )
    evidence = (
        f"re-ran the step at scale {fmt_scale(check_scale)} with {', '.join(chosen)} in float32: forward"
        + (" and backward" if last.backward_ran else "")
        + f" finite; {kept} other call(s) still produced {ctx.low_dtype}{scale_note}"
    )
    for mech in _mechanisms(ctx, ctx.baseline, chosen):
        if len(mech.instances) > 1:
            evidence += f"; {mech.sentence(chosen)}"
    if followed:
        evidence += f"; {len(followed)} call(s) after it ran on its float32 output ({', '.join(followed[:3])})"
    if changed:
        evidence += f"; but {len(changed)} call(s) outside the set changed dtype: {', '.join(changed[:5])}"
    share = work_share(ctx.baseline, ctx.modules, chosen, ctx.low_dtype)
    if share >= MAX_FALLBACK_WORK_SHARE:
        evidence += f"; it runs {share:.0%} of the step's low-precision work in float32 (little of AMP is left)"
    tight = _inside_margin(ctx, last, chosen)
    on_path = [p for p in _path(ctx, last, chosen) if p.headroom_bits < ctx.margin_bits]
    title = f"run {', '.join(chosen)} in float32; AMP stays on everywhere else"
    if tight or on_path:
        spare = _spare_bits(ctx, last, chosen)
        title += f" (holds at this step, with {spare:.2f} bits to spare)"
        if tight:
            evidence += f"; inside the {ctx.margin_bits:g}-bit margin: " + ", ".join(
                f"{i.module} ({i.reason})" for i in tight[:4]
            )
        if on_path:
            evidence += _margin_note(ctx, on_path)
    evidence += _hidden_note(ctx, last)
    return Recommendation(
        action="fp32_fallback",
        modules=tuple(chosen),
        title=title,
        snippet=fallback_snippet(chosen, ctx.device_type, stored_low(ctx.modules, chosen)),
        verified=not changed and not tight and not on_path and overflow_free(last, ctx.sentinel_ops),
        evidence=evidence,
        cost=fallback_cost(ctx.baseline, ctx.modules, chosen, ctx.low_dtype),
    )


def _unverified(origin: Origin, chosen: list[str], tried: list[str], why: str) -> Recommendation:
    modules = chosen or ([origin.module] if origin.module not in (LOSS, BATCH, "") else [])
    attempts = "; ".join(f"[{t}]" for t in tried)
    evidence = (f"re-ran the step with each of these sets in float32: {attempts}; " if tried else "") + why
    return Recommendation(
        action="fp32_fallback",
        modules=tuple(modules),
        title="no float32 fallback set made the step finite" if tried else "no float32 fallback applies here",
        snippet="# no verified fallback; see the origin and op above",
        verified=False,
        evidence=evidence,
    )


def verify_recommendations(
    ctx: VerifyContext, findings: Findings, recs: list[Recommendation], check_scale: float
) -> list[Recommendation]:
    """Replace each verifiable recommendation by its re-run result. The order of ``recs`` (most direct remedy
    first) is kept, except that a remedy whose re-run failed moves to the end."""
    origin = findings.forward_origin or (
        findings.backward_origin if findings.verdict != "scale_overflow" or _needs_fix(findings) else None
    )
    out: list[Recommendation] = []
    for rec in recs:
        try:
            result = _verify_one(ctx, findings, rec, origin, check_scale)
            if result is None:
                continue  # not offered: the re-run showed the op cannot be upcast alone (fixes.verify_upcast)
            rule = rule_of(rec)
            if rule is not None and rule.drop_unmet and _UNMET in result.evidence:
                continue  # proposed on a hint that the re-run did not confirm: no false suggestion
            out.append(dataclasses.replace(result, rule=rec.rule))
        except Exception as exc:  # a re-run that cannot run (float16-only kernel, out of memory): say so
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
            # Never offered as if it worked: the snippet would raise the same error in the user's training.
            out.append(dataclasses.replace(
                rec,
                title=f"not offered: {rec.title} (its verification re-run raised)",
                snippet=f"# not offered: re-running the step with this remedy raised {reason}",
                verified=False,
                evidence=f"the verification re-run failed ({reason})",
            ))
    # A fix of the code that made the value (a mask constant, the loss, the batch) stays first; the alternatives
    # (fallback, loss scale, bfloat16, keep_in_fp32) follow by what the re-runs proved: verified, untested, failed.
    return sorted(out, key=lambda r: (r.action not in _CODE_FIXES, 0 if r.verified else (2 if r.evidence else 1)))


def _verify_one(
    ctx: VerifyContext, findings: Findings, rec: Recommendation, origin: Optional[Origin], check_scale: float
) -> Optional[Recommendation]:
    rule = rule_of(rec)
    kind = rule.verify if rule is not None else None
    if kind == "upcast":
        return verify_upcast(ctx, rec, findings, origin, check_scale, lambda module: _group(ctx, module, []),
                             lambda trace, chosen: _mechanisms(ctx, trace, chosen))
    if kind == "fallback" and origin is not None and rec.modules == (origin.module,):
        return verify_fallback(ctx, origin, check_scale)
    if kind == "rewrite" and rule is not None and rule.rewrite in ("sigmoid", "softmax"):
        return _verify_rewrite(ctx, rec, FusedLog(rule.rewrite), check_scale)  # type: ignore[arg-type]
    loc = origin.op.location if origin is not None and origin.op is not None else None
    if kind == "rewrite" and rule is not None and rule.rewrite == "scale_first" and loc is not None:
        return _verify_rewrite(ctx, rec, ScaleFirst(loc.file, loc.line), check_scale)
    at = site_of(findings)
    where = (at.location.file, at.location.line) if at is not None else None
    line_mode = line_rewrite(rule.rewrite, where) if kind == "rewrite" and rule is not None else None
    if line_mode is not None:
        return _verify_rewrite(ctx, rec, line_mode, check_scale, at)
    if kind == "bf16" and ctx.run_other_dtype is not None:
        other = ctx.run_other_dtype(1.0)
        ok = overflow_free(other, ctx.sentinel_ops)
        outcome = "forward and backward finite" if ok else "still non-finite"
        if other.healthy() and not ok:
            outcome = "finite" + _hidden_note(ctx, other)
        return dataclasses.replace(rec, verified=ok, evidence=f"re-ran the step in bfloat16 (unscaled): {outcome}")
    if kind == "loss_scale":
        return verify_loss_scale(ctx.run_unchanged or ctx.run, findings, rec, ctx.modules, ctx.limits,
                                 ctx.margin_bits, lambda trace: made(trace, ctx.sentinel_ops))
    return rec


def _verify_rewrite(
    ctx: VerifyContext,
    rec: Recommendation,
    mode: Union[FusedLog, ScaleFirst, LineRewrite],
    check_scale: float,
    at: Optional[Site] = None,
) -> Recommendation:
    """Re-run the step with the rewrite's own arithmetic (fixes.rewrites): verified when it was applied at least
    once, everywhere the pattern ran, and the step came out finite."""
    with mode:
        last = ctx.run(check_scale)
        per_run = mode.applied
        note = ""
        if last.forward_healthy() and not last.healthy() and check_scale > 1:
            at_one = ctx.run(1.0)
            if at_one.healthy():
                last, note = at_one, f"; the backward overflows at scale {_scale_text(check_scale)} but is finite at 1"
    missed = mode.missed if isinstance(mode, (ScaleFirst, LineRewrite)) else 0
    if not mode.applied or missed:
        return dataclasses.replace(rec, evidence=f"re-ran the step with the rewrite: {_UNMET} "
                                                 f"({mode.applied} time(s) applied, {missed} not), so nothing "
                                                 "was proven")
    left = _still_overflowing(last, at)
    ok = last.healthy() and not left
    if left:
        note += f"; {left[0]} at that line still makes inf/NaN"
    spare = math.log2(ctx.limits.max / mode.peak) if ctx.limits is not None and mode.peak > 0 else math.inf
    evidence = (
        f"re-ran the step at scale {_scale_text(check_scale)} computing the rewritten arithmetic "
        f"({per_run} time(s) per step): " + ("forward" + (" and backward" if last.backward_ran else "") + " finite"
                                          if ok else "still non-finite") + note
    )
    if ok and math.isfinite(spare):
        evidence += f"; its results keep {spare:.2f} bits below the {ctx.low_dtype} max"
    hidden = _hidden_note(ctx, last) if ok else ""
    evidence += hidden
    # The rewritten modules stay in low precision: their outputs, op peaks and consumers keep the margin too.
    tight = [p for p in _path(ctx, last, list(rec.modules), inside=True) if p.headroom_bits < ctx.margin_bits]
    if ok and tight:
        evidence += _margin_note(ctx, tight)
        spare = min(spare, tight[0].headroom_bits)
    if ok and spare < ctx.margin_bits:
        title = f"{rec.title} (holds at this step, with {spare:.2f} bits to spare)"
        return dataclasses.replace(rec, title=title, verified=False, evidence=evidence + (
            f", inside the {ctx.margin_bits:g}-bit margin"))
    return dataclasses.replace(rec, verified=ok and not hidden, evidence=evidence)


def _still_overflowing(trace: PassTrace, at: Optional[Site]) -> list[str]:
    """The re-run's op overflows at the rewritten site (a hidden overflow the rewrite left): at its line, or, for
    an op only flagged by the survey (no line), the same op in the same module."""
    if at is None:
        return []
    where, op = (at.location.file, at.location.line), at.op.split("::")[-1]
    return [
        f"{o.op} (hidden by {o.hidden_by or 'a later op'})" for o in trace.op_overflows
        if o.count != 0 and ((o.location.file, o.location.line) == where if o.location is not None
                             else (o.module, o.op) == (at.module, op))
    ]


def _scale_text(scale: float) -> str:
    """65536, or 2.0**40 for a large power of two (no six-digit mantissa in any rendering)."""
    literal = scale_literal(scale)
    return literal if "**" in literal else f"{fmt_scale(scale)}"


def _needs_fix(findings: Findings) -> bool:
    return findings.scale is not None and not findings.scale.harmless


def remedy_for(rec: Recommendation, origin: Optional[Origin]) -> Optional[Callable[[nn.Module], Any]]:
    """How to apply a recommendation to a copy of the model for training steps (None: not applicable)."""
    rule = rule_of(rec)
    if rec.action == "fp32_fallback" and rec.modules:
        return lambda model: Fp32Fallback(model, rec.modules)
    site = pasted_site(rec.snippet) if rec.action == "fp32_op" and rec.modules else None
    if site is not None:
        return lambda model: Fp32Op(model, rec.modules, *site)
    if rule is None or rule.verify != "rewrite":
        return None
    if rule.rewrite in ("sigmoid", "softmax"):
        return lambda model: FusedLog(rule.rewrite)  # type: ignore[arg-type]
    loc = origin.op.location if origin is not None and origin.op is not None else None
    if rule.rewrite == "scale_first" and loc is not None:
        return lambda model: ScaleFirst(loc.file, loc.line)
    if line_rewrite(rule.rewrite, _line(origin)) is not None:
        return lambda model: line_rewrite(rule.rewrite, _line(origin))
    return None


def _line(origin: Optional[Origin]) -> Optional[tuple[str, int]]:
    """The origin op's source line (None when the op or its line is unknown)."""
    loc = origin.op.location if origin is not None and origin.op is not None else None
    return (loc.file, loc.line) if loc is not None else None
