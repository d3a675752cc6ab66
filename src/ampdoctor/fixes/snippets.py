"""Code the recommendations show: loss scales as exact Python literals, the float32 fallback call."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from ..records import ModuleInfo

_LOW = ("float16", "bfloat16")


def scale_literal(scale: float) -> str:
    """A loss scale as Python that evaluates to it exactly: 65536.0, or 2.0**40 for large powers of two."""
    exponent = math.log2(scale) if scale > 0 else math.nan
    if exponent.is_integer() and abs(exponent) > 16:
        return f"2.0**{int(exponent)}"
    return repr(float(scale))


def stored_low(modules: Sequence[ModuleInfo], names: Iterable[str]) -> str:
    """The low-precision dtype the named modules' parameters (their submodules' too) are stored in, or "" when
    none is (plain AMP keeps float32 weights)."""
    chosen = list(names)
    for info in modules:
        if any(info.name == n or info.name.startswith(n + ".") or n == "" for n in chosen):
            for p in info.params:
                if p.stats.dtype in _LOW:
                    return p.stats.dtype
    return ""


def fallback_snippet(modules: list[str], device_type: str, stored: str = "") -> str:
    """The fallback call, and how to do the same without ampdoctor. ``stored``: the low dtype the modules' weights
    are stored in ("" for float32): then casting the inputs is not enough (``mat1 and mat2 must have the same
    dtype``), the module must run on float32 copies of its parameters, which keep the gradients flowing to the
    stored ones."""
    names = ", ".join(repr(m) for m in modules)
    head = (
        "import ampdoctor\n"
        f"ampdoctor.fp32_fallback(model, [{names}])  # these run in float32; AMP stays on everywhere else\n"
    )
    if not stored:
        return head + (
            "# without ampdoctor at training time, wrap the module's forward yourself:\n"
            f"#   with torch.autocast({device_type!r}, enabled=False): out = module(*(t.float() for t in inputs))"
        )
    return head + (
        f"# without ampdoctor at training time: the weights are stored in {stored}, so run the module on float32\n"
        "# copies of them (the gradients still reach the stored ones):\n"
        "#   params = {name: p.float() for name, p in module.named_parameters()}\n"
        f"#   with torch.autocast({device_type!r}, enabled=False):\n"
        "#       out = torch.func.functional_call(module, params, tuple(t.float() for t in inputs))\n"
        f"# keep out in float32 under autocast; cast it back (out.to(torch.{stored})) only where the next module\n"
        f"# needs {stored} inputs, and only if it fits (an |out| beyond the format's max would be inf again)"
    )
