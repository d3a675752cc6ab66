"""Code-level remedies as rules (issue 18, item 4), read from the origin op and its source line (pure: no torch).

Each pair here is one rule of ``fixes.rules.RULES``: ``applies(ctx)`` reads the origin op's name, its Python-number
arguments and the code of its line; ``propose(ctx)`` gives the rewrite with a short snippet. The re-run that
verifies each one runs the rewrite's own arithmetic (``fixes.rewrites_lines``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ..analysis import Findings
from ..records import BATCH, LOSS, Recommendation, SourceLocation

if TYPE_CHECKING:
    from .context import Context


# What each rewrite costs (besides an edit of the code): all are cheaper than a module in float32.
SUBTRACT_MAX_COST = "an edit of the code; one amax per call, nothing in float32"
SQUARES_COST = "an edit of the code; that line's squares and sums in float32 (2x their bytes), nothing else"
EPS_COST = "an edit of the code; none at run time"
LOSS_COST = "an edit of the loss; its ops in float32 (the loss's inputs at 2x their bytes)"
BCE_COST = "an edit of the model's head and loss; none at run time (one fused op)"
MASK_COST = "an edit of the code; none at run time"


def _base(op: str) -> str:
    return op.split(".")[0]


@dataclass(frozen=True)
class Site:
    """The op a rewrite fixes: the forward origin's op, or (with no forward origin) the first hidden overflow with
    a source line (an op that made inf/NaN a later op hid)."""

    op: str  # "aten::pow"
    location: SourceLocation
    module: str
    scalar_args: tuple[float, ...]  # Python numbers passed to the op (the origin's op zoom only)
    hidden: bool


def site(ctx: Context) -> Optional[Site]:
    return site_of(ctx.findings)


def site_of(findings: Findings) -> Optional[Site]:
    fwd = findings.forward_origin
    if fwd is not None:
        if fwd.op is None or fwd.op.location is None:
            return None
        return Site(_base(fwd.op.op), fwd.op.location, fwd.module, fwd.op.scalar_args, False)
    found = next((h for h in findings.hidden if h.location is not None and h.count != 0), None)
    if found is None or found.location is None:
        return None
    return Site("aten::" + found.op, found.location, found.module, (), True)


def _origin_line(ctx: Context, ops: frozenset[str]) -> Optional[SourceLocation]:
    """The line of the op to fix when it is one of ``ops`` (None otherwise)."""
    at = site(ctx)
    return at.location if at is not None and at.op in ops else None


def _where(loc: SourceLocation) -> str:
    return f"{loc.file.rsplit('/', 1)[-1]}:{loc.line}"


def _modules(ctx: Context) -> tuple[str, ...]:
    at = site(ctx)
    assert at is not None
    return () if at.module in (LOSS, BATCH, "") else (at.module,)


def _loc(ctx: Context) -> SourceLocation:
    at = site(ctx)
    assert at is not None
    return at.location


def _hidden_note(ctx: Context) -> str:
    at = site(ctx)
    return " (a later op hides the inf today; a larger input or a sibling overflows for real)" if (
        at is not None and at.hidden) else ""


def _was(loc: SourceLocation) -> str:
    return f"# was: {loc.code.strip()}\n"


# -- exp of unbounded values ---------------------------------------------------------------------------------

_EXP_OPS = frozenset({"aten::exp"})


def exp_applies(ctx: Context) -> bool:
    """``exp`` made inf from finite inputs (e**11.1 is past float16's max) at a line that calls it."""
    loc = _origin_line(ctx, _EXP_OPS)
    op = ctx.fwd.op if ctx.fwd is not None else None
    made = op is None or op.output_posinf_count > 0 or op.output_nan_count > 0  # a hidden overflow made some
    return loc is not None and "exp" in loc.code and made


def subtract_max(ctx: Context) -> Recommendation:
    loc = _loc(ctx)
    return Recommendation(
        action="rewrite",
        modules=_modules(ctx),
        title=f"subtract the max before exp at {_where(loc)}: exp of values above 11.09 is past the "
        f"{ctx.run.limits.dtype} max{_hidden_note(ctx)}; exp(x - max) is at most 1 and a ratio of exponentials "
        "is unchanged (or use logsumexp / softmax, or clamp x)",
        snippet=_was(loc) + "e = (x - x.amax(-1, keepdim=True)).exp()  # then e / e.sum(-1, keepdim=True) as before\n"
        "# or: torch.logsumexp(x, -1), torch.softmax(x, -1), or x.clamp(max=math.log(torch.finfo(x.dtype).max))",
    )


# -- squares, norms and long sums ----------------------------------------------------------------------------

_SQUARE_OPS = frozenset({"aten::pow", "aten::square", "aten::mul", "aten::add"})
_SUM_OPS = frozenset({"aten::sum", "aten::mean", "aten::norm", "aten::linalg_vector_norm", "aten::var",
                      "aten::std", "aten::frobenius_norm"})
# ``x**2``, ``x.pow(2)``, ``torch.square(x)``, ``x * x`` (one name on both sides), a norm.
_SQUARE_CODE = re.compile(r"\*\*\s*2(?![\d.])|pow\(\s*2\s*\)|square\(|norm\(|\b(\w+)\s*\*\s*\1(?![\w.(\[])")


def squares_applies(ctx: Context) -> bool:
    """A square, a product of a value with itself, a norm or a sum/mean overflowed at a line that computes one."""
    at = site(ctx)
    if at is None or at.op not in _SQUARE_OPS | _SUM_OPS:
        return False
    return at.op in _SUM_OPS or _SQUARE_CODE.search(at.location.code) is not None


def accumulate_in_float32(ctx: Context) -> Recommendation:
    loc = _loc(ctx)
    return Recommendation(
        action="rewrite",
        modules=_modules(ctx),
        title=f"square and sum in float32 at {_where(loc)}: the squares (or their sum) pass the "
        f"{ctx.run.limits.dtype} max ({ctx.run.limits.max:g}, a value above 256 squared){_hidden_note(ctx)}; cast "
        "up before the square and keep the result in float32, or divide by a known scale first",
        snippet=_was(loc) + "y = x.float().pow(2).mean(-1, keepdim=True)  # e.g. (x - u).float().pow(2)..., "
        "re.float()**2 + im.float()**2\n# or pre-scale: s = x.abs().amax(-1, keepdim=True); "
        "y = (x / s).pow(2).mean(-1, keepdim=True) * s**2",
    )


# -- an eps below float16's resolution -----------------------------------------------------------------------

_EPS_OPS = frozenset({"aten::div", "aten::rsqrt", "aten::reciprocal", "aten::log", "aten::sqrt", "aten::pow",
                      "aten::mul"})
_NUMBER = re.compile(r"(?<![\w.])(\d+\.?\d*[eE]-\d+|0\.\d+)")


def tiny_literal(ctx: Context) -> Optional[str]:
    """A number on the origin's line (or F.normalize's default eps) below the format's smallest normal: it rounds
    to 0 (or to a subnormal whose reciprocal is past the max), so it protects no division."""
    loc = _origin_line(ctx, _EPS_OPS)
    if loc is None:
        return None
    for text in _NUMBER.findall(loc.code):
        if 0 < float(text) < ctx.run.limits.tiny:
            return text
    if "normalize(" in loc.code and "eps" not in loc.code:
        return "1e-12"  # F.normalize's default
    return None


def eps_from_finfo(ctx: Context) -> Recommendation:
    loc, eps, limits = _loc(ctx), tiny_literal(ctx), ctx.run.limits
    normalize = "normalize(" in loc.code
    return Recommendation(
        action="rewrite",
        modules=_modules(ctx),
        title=f"an eps the format can hold at {_where(loc)}: {eps} is below {limits.dtype}'s smallest normal "
        f"({limits.tiny:g}), so it rounds to 0 and the division by zero stays; derive it from torch.finfo",
        snippet=_was(loc)
        + ("y = torch.nn.functional.normalize(x, dim=-1, eps=torch.finfo(x.dtype).eps)" if normalize else
           "y = x / (std + torch.finfo(std.dtype).eps)  # or torch.sqrt(var + torch.finfo(var.dtype).eps)"),
    )


# -- a loss computed in float16 ------------------------------------------------------------------------------


def loss_in_low_precision(ctx: Context) -> bool:
    """The loss function made the non-finite value with an op that ran in the low-precision format."""
    op = ctx.fwd.op if ctx.fwd is not None else None
    return ctx.fwd is not None and ctx.fwd.module == LOSS and op is not None and op.output_dtype == ctx.run.limits.dtype


def loss_outside_autocast(ctx: Context) -> Recommendation:
    assert ctx.fwd is not None and ctx.fwd.op is not None
    op = ctx.fwd.op
    where = f" ({op.op} at {_where(op.location)})" if op.location is not None else f" ({op.op})"
    return Recommendation(
        action="fix_loss",
        modules=(),
        title=f"compute the loss outside autocast, in float32: its ops ran in {ctx.run.limits.dtype} and one "
        f"overflowed{where}",
        snippet=f"with torch.autocast({ctx.run.device_type!r}, enabled=False):\n"
        "    loss = loss_fn(output.float(), targets)",
    )


# -- Sigmoid followed by BCELoss -----------------------------------------------------------------------------

_BCE_CODE = re.compile(r"bce|binary_cross_entropy", re.IGNORECASE)


def bce_applies(ctx: Context) -> bool:
    """The gradient leaving the loss is non-finite at scale 1, and the loss is a BCE (its line says so) or the
    model has a Sigmoid module; the re-run keeps it only where a sigmoid's output really reached
    ``binary_cross_entropy`` (rule ``drop_unmet``)."""
    bwd = ctx.bwd
    if bwd is None or bwd.module != LOSS:
        return False
    loc = bwd.op.location if bwd.op is not None else None
    return (loc is not None and _BCE_CODE.search(loc.code) is not None) or any(
        m.class_name == "Sigmoid" for m in ctx.modules
    )


def bce_with_logits(ctx: Context) -> Recommendation:
    return Recommendation(
        action="fix_loss",
        modules=(),
        title="use binary_cross_entropy_with_logits on the logits instead of BCELoss after a sigmoid: the float16 "
        "sigmoid rounds to exactly 0 or 1 and BCE's gradient 1/(p(1-p)) is then past the max at any loss scale",
        snippet="criterion = torch.nn.BCEWithLogitsLoss()  # drop the model's final Sigmoid\n"
        "loss = criterion(logits, targets)  # or F.binary_cross_entropy_with_logits(logits, targets)\n"
        "probabilities = torch.sigmoid(logits)  # where you need them (inference)",
    )


# -- a mask constant scaled into the scores: ``(1.0 - mask) * -1e9`` ------------------------------------------

_SCALE_OPS = frozenset({"aten::mul"})
_LITERAL = re.compile(r"(?<![\w.])(-?\s*\d+\.?\d*(?:[eE]\+?\d+)?)(?![\w.])")


def scaled_mask_value(ctx: Context) -> Optional[float]:
    """A multiply by a Python number beyond the format's max (``(1.0 - mask) * -1e9``) makes ±inf: the op zoom's
    number, or for a hidden overflow the line's literal."""
    at = site(ctx)
    if at is None or at.op not in _SCALE_OPS:
        return None
    numbers = at.scalar_args or tuple(float(m.replace(" ", "")) for m in _LITERAL.findall(at.location.code))
    big = (v for v in numbers if abs(v) >= ctx.run.limits.overflow_threshold)
    # A mask's constant is a large negative number (or the line says mask): not any multiply past the max.
    return next((v for v in big if v < 0 or "mask" in at.location.code.lower()), None)


def scaled_mask_constant(ctx: Context) -> Recommendation:
    loc, limits = _loc(ctx), ctx.run.limits
    return Recommendation(
        action="mask_constant",
        modules=_modules(ctx),
        title=f"the mask constant {scaled_mask_value(ctx):g} at {_where(loc)} does not fit {limits.dtype} (max "
        f"{limits.max:g}): (1 - mask) times it is -inf, and a row with no key left is NaN{_hidden_note(ctx)}; use the "
        "dtype's own minimum",
        snippet=_was(loc) + "extended = (1.0 - mask) * torch.finfo(scores.dtype).min",
    )
