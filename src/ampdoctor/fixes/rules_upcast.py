"""The rule "run only the origin's op in float32" (pure: no torch, no live model).

Proposed for a forward origin inside a module with a source line: cheaper than running the whole module in float32
(one op's result instead of all its activations and matmuls), after a rewrite of the code. Which call of which op
it is (``ampdoctor.fp32_op``'s arguments) is resolved on the verification re-run (:mod:`.verify_upcast`); a site that
cannot be resolved (a fused kernel, SDPA, an op in a child module or in C++) is not offered.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..records import BATCH, LOSS, Recommendation

if TYPE_CHECKING:
    from .rules import Context

# aten ops of fused kernels: what runs inside them cannot be reached by a torch-function mode.
_FUSED_PREFIXES = ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::_flash_attention",
                   "aten::_efficient_attention", "aten::_native_multi_head_attention", "aten::_fused")

UPCAST_COST = "one op's result in float32 (2x its bytes) and that op at float32 speed; the rest of the module stays " \
    "in low precision"


def op_site_applies(ctx: Context) -> bool:
    """A forward origin in a module (not the root, the loss or the batch) whose op has a source line and is not a
    fused kernel."""
    origin = ctx.fwd
    if origin is None or origin.module in ("", LOSS, BATCH) or origin.op is None or origin.op.location is None:
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
