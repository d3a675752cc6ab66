"""The op-level float32 upcast (:mod:`.upcast`), resolved and proven at diagnosis time.

:func:`locate` re-runs the step watching the origin module's own code: for each op it calls (children's aside)
it notes the op's name, its occurrence (the count :class:`~.upcast.Fp32Op` uses), its source line (frames are
read here, on a diagnosis re-run, never at training time) and whether it made inf/NaN from finite inputs. The
site is the first op at the origin's source line that made the value. :func:`verify_upcast` then re-runs the step
with :class:`~.upcast.Fp32Op` on every instance of the mechanism that needs the remedy and checks that the
forward and backward are finite, that the margin holds, and that the helper hit exactly the intended ops: one per
module call, each at the intended line. A miss or a hit at another line (a data-dependent branch shifts the
occurrence) leaves it unverified, saying why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..analysis import Findings, Origin, forward_origin
from ..analysis.headroom import headroom_bits
from ..analysis.mechanisms import Mechanism, low_precision_headroom
from ..capture.dtypes import LOW_DTYPES
from ..capture.model import find_module
from ..capture.stats import INTERNAL
from ..capture.zoom import innermost_user_line
from ..numbers import fmt_scale
from ..records import BATCH, LOSS, Cost, FormatLimits, PassTrace, Recommendation, SourceLocation
from .recompute import Recomputed, recompute_mismatch
from .rules_upcast import FUSED_FUNCTIONS, HIDDEN_RULE, hidden_site, ordinal, same_site, upcast_snippet
from .upcast import Fp32Op, _Frame, _ScopedOps

if TYPE_CHECKING:
    from .context import VerifyContext

# The mechanism instances that need the remedy with the origin (fixes.verify's grouping), and a pass's mechanisms.
Group = Callable[[str], list[str]]
Mechanisms = Callable[[PassTrace, list[str]], list[Mechanism]]

_TORCH_DIR = Path(torch.__file__).resolve().parent
# Re-runs before giving up (each adds instances of the mechanism: a new origin, or one inside the margin).
MAX_ROUNDS = 3
_EXTRA_BYTES = 2  # a float32 result instead of a float16/bfloat16 one: 2 more bytes per element


@dataclass(frozen=True)
class OpSite:
    """Which call to upcast: the ``occurrence``-th call (0-based) of ``op`` in the module's own code."""

    op: str
    occurrence: int
    location: SourceLocation
    numel: int  # elements of its result (per module call)


@dataclass(frozen=True)
class _Seen:
    call: int
    name: str
    occurrence: int
    location: Optional[SourceLocation]
    made: bool  # a low-precision result with inf/NaN from finite floating inputs
    numel: int


def _all_finite(values: Any) -> bool:
    tensors = [v for v in (values if isinstance(values, (tuple, list)) else (values,)) if isinstance(v, torch.Tensor)]
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


class _Locator(_ScopedOps):
    """Notes every op the named module's own code calls (a diagnosis re-run only: it reads frames and syncs)."""

    def __init__(self, model: Any, module: str) -> None:
        self.seen: list[_Seen] = []
        self._calls_started = 0
        super().__init__(model, [module])

    def on_op(self, frame: _Frame, name: str, k: int, func: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        location = innermost_user_line()
        out = func(*args, **kwargs)
        first = next((t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)),
                     None)
        low = first is not None and first.dtype in LOW_DTYPES
        with INTERNAL:  # the checks are ampdoctor's own ops (the hidden-overflow watch passes them over)
            made = bool(low and not _all_finite(out) and _all_finite(args) and _all_finite(tuple(kwargs.values())))
        numel = first.numel() if first is not None else 0
        self.seen.append(_Seen(self.calls - 1, name, k, location, made, numel))
        return out


def _own_python_forward(module: torch.nn.Module) -> bool:
    """The module's class runs a forward written outside torch (a ``Linear``'s op belongs to its parent's line)."""
    try:
        source = inspect.getsourcefile(type(module).forward)
    except TypeError:
        return False
    return source is not None and not Path(source).resolve().is_relative_to(_TORCH_DIR)


def reachable(ctx: VerifyContext, origin: Origin) -> str:
    """Why the origin's op cannot be upcast alone, or "" when it may be."""
    loc = origin.op.location if origin.op is not None else None
    if origin.module in ("", LOSS, BATCH) or loc is None:
        return "the origin has no module of its own or no source line"
    if not _own_python_forward(find_module(ctx.root, origin.module)):
        return f"{origin.module} ({origin.class_name}) has no forward of the user's own code"
    return ""


def locate(ctx: VerifyContext, origin: Origin, check_scale: float) -> tuple[Optional[OpSite], str]:
    """The op at the origin's source line, by name and occurrence (a re-run that watches the origin module's own
    code), or None and why it cannot be upcast alone."""
    assert origin.op is not None and origin.op.location is not None
    loc = origin.op.location
    locator = _Locator(ctx.root, origin.module)
    with locator:
        ctx.run(check_scale)
    seen = [s for s in locator.seen if s.call == origin.call]
    at_line = [s for s in seen if s.location is not None and (s.location.file, s.location.line) == (loc.file, loc.line)]
    where = f"{Path(loc.file).name}:{loc.line}"
    if not at_line:
        return None, f"no op of {origin.label}'s own code runs at {where} (it runs in a child module or a C++ op)"
    made = [s for s in at_line if s.made]
    if not made:
        return None, f"no op of {origin.label}'s own code at {where} made the inf/NaN (a fused kernel?)"
    site = made[0]
    if site.name in FUSED_FUNCTIONS:
        return None, f"{site.name} at {where} is a fused kernel: the op inside it cannot be reached"
    assert site.location is not None
    return OpSite(site.name, site.occurrence, site.location, site.numel), ""


# Torch functions whose calls may show up in the op zoom as this aten op (``q @ k`` of 3-D tensors is aten::bmm).
_ATEN_FAMILY = {
    "bmm": ("matmul", "bmm", "einsum"),
    "mm": ("matmul", "mm", "einsum"),
    "baddbmm": ("baddbmm", "matmul"),
    "pow": ("pow", "square"),
    "mul": ("mul", "square"),
}


def from_survey(ctx: VerifyContext, origin: Origin) -> Optional[OpSite]:
    """The site as the survey's hidden-overflow watch numbered it (same count as :class:`~.upcast.Fp32Op`): the
    one op of the origin call it flagged under a name of the origin op's family; None when not exactly one."""
    op = origin.op
    if op is None or op.location is None:
        return None
    aten = op.op.split("::")[-1].split(".")[0]
    family = _ATEN_FAMILY.get(aten, (aten,))
    flagged = [o for o in ctx.baseline.op_overflows
               if o.module == origin.module and o.call == origin.call and o.op in family]
    if len(flagged) != 1 or flagged[0].op in FUSED_FUNCTIONS:
        return None
    return OpSite(flagged[0].op, flagged[0].occurrence, op.location, flagged[0].numel)


_PASTED = re.compile(r"ampdoctor\.fp32_op\(model, \[[^\]]*\], '(?P<op>\w+)', (?P<k>\d+)\)")


def pasted_site(snippet: str) -> Optional[tuple[str, int]]:
    """(op, occurrence) of the call :func:`upcast_snippet` wrote (verify_steps trains with what the user pastes)."""
    found = _PASTED.search(snippet)
    return (found["op"], int(found["k"])) if found is not None else None


def _run(ctx: VerifyContext, helper: Fp32Op, scale: float) -> PassTrace:
    helper.calls = helper.hits = helper.misses = 0
    helper.sites.clear()
    helper.peaks.clear()
    return ctx.run(scale)


def _misplaced(helper: Fp32Op, site: OpSite) -> list[str]:
    """Upcast calls at another line than the site's: '<module> at <file:line>'."""
    out = []
    for module, loc in helper.sites:
        if loc is None or (loc.file, loc.line) != (site.location.file, site.location.line):
            out.append(f"{module} at " + (f"{Path(loc.file).name}:{loc.line}" if loc is not None else "no line"))
    return out


def _attempt(ctx: VerifyContext, site: OpSite, chosen: list[str], check_scale: float
             ) -> tuple[PassTrace, str, tuple[int, int, int, list[str]], dict[str, float]]:
    """One re-run with the op upcast in ``chosen``: the trace, a note, (calls, hits, misses, misplaced), and the
    largest |result| of the op per module.

    The chosen modules' calls are recomputed in the backward (:mod:`.recompute`): the float32 results the upcast
    keeps, and those of the ops after it, are held one call at a time instead of all until the backward, so the
    re-run needs no more memory than the plain step. A call whose re-run does not repeat it (a data-dependent
    path) makes the re-run raise: it is run again without recomputing."""
    try:
        return _attempt_once(ctx, site, chosen, check_scale, recompute=True)
    except Exception as exc:
        if not recompute_mismatch(exc):
            raise
        return _attempt_once(ctx, site, chosen, check_scale, recompute=False)


def _attempt_once(ctx: VerifyContext, site: OpSite, chosen: list[str], check_scale: float, recompute: bool
                  ) -> tuple[PassTrace, str, tuple[int, int, int, list[str]], dict[str, float]]:
    note = ""
    with Fp32Op(ctx.root, chosen, site.op, site.occurrence) as helper:
        helper.where = innermost_user_line
        held = Recomputed(ctx.root, chosen, helper.replay) if recompute else contextlib.nullcontext()
        with held:
            last = _run(ctx, helper, check_scale)
            if last.forward_healthy() and not last.healthy() and check_scale > 1:
                at_one = _run(ctx, helper, 1.0)
                if at_one.healthy():
                    last = at_one
                    note = f"; the backward overflows at scale {fmt_scale(check_scale)} but is finite at 1 (GradScaler)"
        return last, note, (helper.calls, helper.hits, helper.misses, _misplaced(helper, site)), dict(helper.peaks)


def _misplaced_modules(counts: tuple[int, int, int, list[str]]) -> list[str]:
    return [m.split(" at ", 1)[0] for m in counts[3]]


def _needs(peak: Optional[float], limits: FormatLimits, margin_bits: float) -> bool:
    """A float32 result this large would overflow the low format, or keep less than the margin in it."""
    if peak is None:
        return True  # not measured: keep it
    bits = headroom_bits(peak, limits)
    return bits is None or bits < margin_bits


def _hidden(ctx: VerifyContext, findings: Findings, group: Group) -> Optional[tuple[OpSite, str, set[str]]]:
    """The site of the first reachable hidden overflow, its module, and the instances that need the upcast."""
    found = hidden_site(findings)
    if found is None or found.location is None or not _own_python_forward(find_module(ctx.root, found.module)):
        return None
    k = found.occurrences[0]
    numel = next((o.numel for o in ctx.baseline.op_overflows
                  if (o.module, o.call, o.op, o.occurrence) == (found.module, found.call, found.op, k)), 0)
    return OpSite(found.op, k, found.location, numel), found.module, {*same_site(findings, found), *group(found.module)}


def verify_upcast(ctx: VerifyContext, rec: Recommendation, findings: Findings, origin: Optional[Origin],
                  check_scale: float, group: Group, mechanisms: Mechanisms) -> Optional[Recommendation]:
    """Resolve the site, run it in float32 in every instance that needs it, and prove it (None: not offered).

    The origin's op (rule ``fp32_op``) is resolved from the survey's numbering or the op zoom's line; a hidden
    overflow's (rule ``hidden_fp32_op``) is named by its records."""
    surveyed = False
    if rec.rule.startswith(HIDDEN_RULE):
        hidden = _hidden(ctx, findings, group)
        if hidden is None:
            return None
        site, anchor, needed = hidden
    else:
        if origin is None or reachable(ctx, origin):
            return None  # not offered: the rewrite or the module fallback is
        found = from_survey(ctx, origin)
        surveyed = found is not None
        if found is None:
            found, _ = locate(ctx, origin, check_scale)
        if found is None:
            return None
        site, anchor, needed = found, origin.module, set(group(origin.module))
    order = {m.name: i for i, m in enumerate(ctx.modules)}
    members = {i.module for mech in mechanisms(ctx.baseline, [anchor]) for i in mech.instances}
    limits = ctx.limits
    # First round: the instances that need it, and those that only carried the origin's inf/NaN at the diagnosed
    # step (whether they need it shows once the origin is fixed): one re-run instead of one per instance.
    unknown = {m for m in members if limits is not None and not low_precision_headroom(ctx.baseline, m, limits)[0]}
    upcoming: Optional[list[str]] = sorted(needed | unknown)
    chosen: list[str] = []
    tried: list[str] = []
    pruned = False
    best: Optional[tuple[list[str], PassTrace, str, tuple[int, int, int, list[str]]]] = None
    while upcoming is not None and len(tried) < MAX_ROUNDS:
        chosen = sorted(set(upcoming), key=lambda m: order.get(m, len(order)))
        tried.append(", ".join(chosen))
        last, note, counts, peaks = _attempt(ctx, site, chosen, check_scale)
        if surveyed and origin is not None and anchor in _misplaced_modules(counts):
            # The survey's numbering missed the line in the origin itself: number the ops at the zoom's line.
            relocated, _ = locate(ctx, origin, check_scale)
            if relocated is None:
                return None
            site, surveyed, tried = relocated, False, []
            continue
        upcoming = None
        if last.healthy():
            best = (chosen, last, note, counts)
            joining = [i.module for mech in mechanisms(last, chosen) for i in mech.instances
                       if i.reason and i.module not in chosen]
            if joining:  # instances of the mechanism still inside the margin join
                upcoming = [*chosen, *joining]
            elif not pruned and limits is not None:
                # Carriers whose float32 result would have kept the margin in the low format did not need it.
                keep = [m for m in chosen if m in needed or _needs(peaks.get(m), limits, ctx.margin_bits)]
                if len(keep) < len(chosen):
                    pruned, upcoming = True, keep
        else:  # a new origin in another instance of the mechanism joins
            new = forward_origin(last)
            if new is not None and new.module in members and new.module not in chosen:
                upcoming = [*chosen, *group(new.module)]
    if best is not None and not last.healthy():
        chosen, last, note, counts = best  # the smaller set did not hold: the one that did is the answer
    calls, hits, misses, misplaced = counts
    where = f"{Path(site.location.file).name}:{site.location.line}"
    what = f"the {ordinal(site.occurrence)} {site.op} ({where})"
    finite = last.healthy()
    evidence = (
        (f"tried the op in float32 in [{']; then in ['.join(tried)}]; " if len(tried) > 1 else "")
        + f"re-ran the step at scale {fmt_scale(check_scale)} with {what} of {', '.join(chosen)} in float32: "
        f"{calls} module call(s), {hits} op(s) upcast; "
        + ("forward" + (" and backward" if last.backward_ran else "") + " finite" if finite else "still non-finite")
        + note
    )
    exact = hits == calls and not misses and not misplaced
    if misses:
        evidence += f"; missed: in {misses} of {calls} call(s) there was no {ordinal(site.occurrence)} {site.op}"
    if misplaced:
        evidence += (f"; missed: the {ordinal(site.occurrence)} {site.op} ran elsewhere in {len(misplaced)} call(s) "
                     f"({', '.join(misplaced[:3])}), a data-dependent branch shifts the occurrence")
    for mech in mechanisms(ctx.baseline, chosen):
        if len(mech.instances) > 1:
            evidence += f"; {mech.sentence(chosen)}"
    left = [i for mech in mechanisms(last, chosen) for i in mech.instances if i.reason] if finite else []
    hiding = [i.module for i in left if i.reason == "hides an overflow"]
    tight = [i for i in left if i.reason != "hides an overflow"]
    title = f"run only {what} in float32 in {', '.join(chosen)}; AMP stays on for the rest of the module"
    if hiding:
        evidence += f"; an op still makes inf/NaN that a later op hides in {', '.join(hiding[:4])}"
    if tight:
        spare = min((i.headroom_bits for i in tight), default=math.inf)
        title += f" (holds at this step, with {spare:.2f} bits to spare)"
        evidence += f"; inside the {ctx.margin_bits:g}-bit margin: " + ", ".join(
            f"{i.module} ({i.reason})" for i in tight[:4])
    cost = Cost(site.numel * _EXTRA_BYTES * max(calls, len(chosen)), 0.0,
                f"one op's result in float32 per call ({site.numel} elements); the modules' Linear layers stay in "
                f"{ctx.low_dtype}")
    return dataclasses.replace(
        rec, modules=tuple(chosen), title=title,
        snippet=upcast_snippet(chosen, site.op, site.occurrence, site.location),
        verified=finite and exact and not tight and not hiding, evidence=evidence, cost=cost,
    )
