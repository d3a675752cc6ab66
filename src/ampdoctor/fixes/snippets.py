"""Code the recommendations show: loss scales as exact Python literals, the float32 fallback call."""

from __future__ import annotations

import math


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
