"""Code fixes for a backward origin that no change of precision can fix (pure: no torch): the node read a NaN
its forward saved and discarded (``torch.where``'s untaken branch: rule ``safe_branch``), or made a NaN at a pole
of its own formula (``SqrtBackward0`` at 0: rule ``keep_off_pole``). Neither is verified by a re-run: each says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..records import BATCH, LOSS, Recommendation

if TYPE_CHECKING:
    from .context import Context


def reads_saved(ctx: Context) -> bool:
    """The backward origin's node passed on a non-finite value its forward saved (``OpFinding.from_saved``)."""
    return ctx.bwd is not None and ctx.bwd.op is not None and ctx.bwd.op.from_saved


def _where(ctx: Context) -> tuple[tuple[str, ...], str]:
    """The module to fix (none for the loss) and " at file:line" of the forward line that created the node."""
    assert ctx.bwd is not None and ctx.bwd.op is not None
    loc = ctx.bwd.op.location
    at = f" at {loc.file.rsplit('/', 1)[-1]}:{loc.line}" if loc is not None else ""
    return (() if ctx.bwd.module in (LOSS, BATCH, "") else (ctx.bwd.module,)), at


def safe_branch(ctx: Context) -> Recommendation:
    assert ctx.bwd is not None and ctx.bwd.op is not None
    op = ctx.bwd.op
    modules, at = _where(ctx)
    return Recommendation(
        action="fix_code",
        modules=modules,
        title=f"{op.node or op.op} reads a NaN/inf that its forward{at} computed and then discarded: a branch "
        "torch.where did not take (or a value masked away) still gets a gradient, 0 x NaN = NaN, in any precision; "
        "give that branch safe inputs before the op instead of masking its result",
        snippet="y = torch.where(ok, x, torch.sqrt(torch.where(ok, 1.0, x - 1)))  # the untaken branch sees a safe 1",
    )


# Backward nodes whose derivative is infinite at a point the forward can reach exactly (the NaN is 0 x inf there, in
# any precision): what keeps the forward's input away from it. Keyed by autograd node name.
POLE_NODES: dict[str, tuple[str, str]] = {
    "SqrtBackward0": ("sqrt has an infinite derivative at 0 (a distance between equal points, the norm of a zero "
                      "vector written as sqrt of a sum of squares)", "torch.sqrt(x.clamp_min(1e-12))"),
    "RsqrtBackward0": ("rsqrt has an infinite derivative at 0", "torch.rsqrt(x.clamp_min(1e-12))"),
    "PowBackward0": ("x ** p with 0 < p < 1 has an infinite derivative at 0", "x.clamp_min(1e-12) ** p"),
    "AcosBackward0": ("acos has an infinite derivative at -1 and 1 (the cosine of equal vectors)",
                      "torch.acos(x.clamp(-1 + 1e-6, 1 - 1e-6))"),
    "AsinBackward0": ("asin has an infinite derivative at -1 and 1", "torch.asin(x.clamp(-1 + 1e-6, 1 - 1e-6))"),
    "LogBackward0": ("log has an infinite derivative at 0", "torch.log(x.clamp_min(1e-12))"),
    "Atan2Backward0": ("atan2(0, 0) has no derivative", "torch.atan2(y, x + 1e-12)"),
}


def at_pole(ctx: Context) -> bool:
    """A NaN made by one of ``POLE_NODES`` in the backward (not a value passed on from the forward)."""
    op = ctx.bwd.op if ctx.bwd is not None else None
    return op is not None and not op.from_saved and op.node in POLE_NODES and ctx.findings.verdict == "nan"


def keep_off_pole(ctx: Context) -> Recommendation:
    assert ctx.bwd is not None and ctx.bwd.op is not None and ctx.bwd.op.node is not None
    op, loc = ctx.bwd.op, ctx.bwd.op.location
    why, fix = POLE_NODES[ctx.bwd.op.node]
    modules, at = _where(ctx)
    return Recommendation(
        action="fix_code",
        modules=modules,
        title=f"{op.node} made the NaN from finite values: {why}; its input reaches that point exactly (the op "
        f"created{at}): keep it away from there (where it is 0 only because a small value underflowed in low "
        "precision, a float32 fallback below fixes it too)",
        snippet=f"{fix}  # instead of the unguarded op" + (f" in: {loc.code.strip()}" if loc is not None else ""),
    )


def any_applies(ctx: Context) -> bool:
    """One of these code fixes names the cause (then the loss's gradient is no overflow of the output dtype)."""
    return reads_saved(ctx) or at_pole(ctx)
