"""The rule "run only the origin's op in float32" (pure: no torch, no live model).

Proposed for a forward origin inside a module with a source line: cheaper than running the whole module in float32
(one op's result instead of all its activations and matmuls), after a rewrite of the code. Which call of which op
it is (``ampdoctor.fp32_op``'s arguments) is resolved on the verification re-run (:mod:`.verify_upcast`); a site that
cannot be resolved (a fused kernel, SDPA, an op in a child module or in C++) is not offered.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

from ..analysis import Findings
from ..analysis.hidden import HiddenOverflow
from ..records import BATCH, LOSS, Recommendation, SourceLocation

if TYPE_CHECKING:
    from .context import Context

HIDDEN_RULE = "hidden_fp32_op"
# Torch functions that run a fused kernel (what runs inside cannot be reached): never upcast alone.
FUSED_FUNCTIONS = frozenset(
    {"scaled_dot_product_attention", "multi_head_attention_forward", "_scaled_dot_product_attention_math"}
)

# aten ops of fused kernels: what runs inside them cannot be reached by a torch-function mode.
_FUSED_PREFIXES = ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::_flash_attention",
                   "aten::_efficient_attention", "aten::_native_multi_head_attention", "aten::_fused")

UPCAST_COST = "one op's result in float32 (2x its bytes) and that op at float32 speed; the rest of the module stays " \
    "in low precision"


def op_site_applies(ctx: Context) -> bool:
    """An overflow (an inf made: float32's range helps; a NaN from 0/0 or a log of a negative it does not) at a
    forward origin in a module (not the root, the loss or the batch) whose op has a source line and is not a fused
    kernel."""
    origin = ctx.fwd
    if ctx.findings.verdict != "overflow" or origin is None or origin.module in ("", LOSS, BATCH):
        return False
    if origin.op is None or origin.op.location is None:
        return False
    return not origin.op.op.startswith(_FUSED_PREFIXES)


def propose_op_upcast(ctx: Context) -> Recommendation:
    origin = ctx.fwd
    assert origin is not None and origin.op is not None and origin.op.location is not None
    loc = origin.op.location
    return Recommendation(
        action="fp32_op",
        modules=(origin.module,),
        title=f"run only the op at {Path(loc.file).name}:{loc.line} ({loc.code}) in float32 in {origin.module}; "
        "AMP stays on for the rest of the module",
        snippet="# diagnose(..., verify=True) names the op and its occurrence:\n"
        f"# ampdoctor.fp32_op(model, [{origin.module!r}], op, occurrence)",
    )


def ordinal(k: int) -> str:
    n = k + 1
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def upcast_snippet(modules: list[str], op: str, occurrence: int, location: SourceLocation) -> str:
    names = ", ".join(repr(m) for m in modules)
    return (
        "import ampdoctor\n"
        f"ampdoctor.fp32_op(model, [{names}], {op!r}, {occurrence})"
        f"  # the {ordinal(occurrence)} {op} in each call: {location.code}\n"
        "# without ampdoctor at training time, edit that line:\n"
        f"#   with torch.autocast(device_type, enabled=False): result = <the {op}>(*(t.float() for t in inputs))"
    )


def hidden_site(findings: Findings) -> Optional[HiddenOverflow]:
    """The first hidden overflow an op-level upcast can reach: inside a module (not the loss), at a known line,
    one occurrence of the op there (a loop's several would need several sites), not a fused kernel."""
    return next(
        (h for h in findings.hidden
         if h.module not in ("", LOSS) and h.location is not None and len(h.occurrences) == 1
         and h.op not in FUSED_FUNCTIONS and h.count != 0),
        None,
    )


def same_site(findings: Findings, site: HiddenOverflow) -> list[str]:
    """The modules whose hidden overflow is at the same op, occurrence and line in the same class (a mechanism)."""
    assert site.location is not None
    key = (site.class_name, site.op, site.occurrences, site.location.file, site.location.line)
    return list(dict.fromkeys(
        h.module for h in findings.hidden
        if h.location is not None and (h.class_name, h.op, h.occurrences, h.location.file, h.location.line) == key
    ))


def hidden_applies(ctx: Context) -> bool:
    return ctx.fwd is None and hidden_site(ctx.findings) is not None


def propose_hidden_upcast(ctx: Context) -> Recommendation:
    """Pure: the hidden overflow's records name the op and its occurrence already (no re-run needed to resolve)."""
    site = hidden_site(ctx.findings)
    assert site is not None and site.location is not None
    modules = same_site(ctx.findings, site)
    where = f"{Path(site.location.file).name}:{site.location.line}"
    return Recommendation(
        action="fp32_op",
        modules=tuple(modules),
        title=f"run only the {ordinal(site.occurrences[0])} {site.op} ({where}) in float32 in {', '.join(modules)}: "
        f"it makes inf/NaN that {site.hidden_by} hides; AMP stays on for the rest of the module",
        snippet=upcast_snippet(modules, site.op, site.occurrences[0], site.location),
    )
