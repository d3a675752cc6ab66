"""What each aten op does with its arguments, as far as the op zoom needs to know (tables, no state).

Which ops only allocate, which overwrite their target, which copy element by element, which ignore an input
(``beta=0``), which use only part of an input (``torch.where``, ``masked_fill``), and which write only part of
their target (``index_put_``, ``scatter_``). The schema says which arguments an op writes; these tables say
the rest. Used by :mod:`.zoom_flow`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

# Ops that hand out memory without writing it.
ALLOCATION_OPS = frozenset(
    {
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::empty_permuted",
        "aten::new_empty",
        "aten::new_empty_strided",
    }
)
# In-place ops whose result does not depend on the old contents of ``self``.
OVERWRITE_OPS = frozenset(
    {
        "aten::copy_",
        "aten::fill_",
        "aten::zero_",
        "aten::normal_",
        "aten::uniform_",
        "aten::random_",
        "aten::bernoulli_",
        "aten::exponential_",
        "aten::geometric_",
        "aten::log_normal_",
        "aten::cauchy_",
    }
)
# Ops whose output element i is input element i (converted): garbage maps element by element.
COPY_OPS = frozenset({"aten::_to_copy", "aten::clone", "aten::copy_", "aten::lift_fresh_copy", "aten::detach_copy"})
# ``beta * self + alpha * (...)``: with beta == 0, ``self`` is ignored (NaN and inf in it are not propagated).
BETA_OPS = frozenset(
    {
        "aten::addmm",
        "aten::addmm_",
        "aten::_addmm_activation",
        "aten::baddbmm",
        "aten::baddbmm_",
        "aten::addbmm",
        "aten::addbmm_",
        "aten::addmv",
        "aten::addmv_",
        "aten::addr",
        "aten::addr_",
    }
)
# Resizing an empty tensor (an ``out=`` tensor of size 0) allocates it.
RESIZE_OPS = frozenset({"aten::resize_", "aten::resize_as_"})


def _index_put(g: torch.Tensor, a: dict[str, Any]) -> torch.Tensor:
    if a.get("accumulate"):
        return g  # adds to what is there: nothing newly written
    false = torch.zeros((), dtype=torch.bool, device=g.device)
    return torch.ops.aten.index_put.default(g, a["indices"], false)


# Ops that write some elements of ``self`` and keep the rest: (self's garbage, arguments) -> the result's.
PARTIAL_WRITES: dict[str, Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]] = {
    "aten::masked_fill": lambda g, a: g & ~a["mask"].to(g.device),
    "aten::masked_scatter": lambda g, a: g & ~a["mask"].to(g.device),
    "aten::index_put": _index_put,
    "aten::_index_put_impl": _index_put,
    "aten::index_copy": lambda g, a: g.index_fill(a["dim"], a["index"], False),
    "aten::index_fill": lambda g, a: g.index_fill(a["dim"], a["index"], False),
    "aten::scatter": lambda g, a: g if a.get("reduce") is not None else g.scatter(a["dim"], a["index"], False),
}


@dataclass(frozen=True)
class Roles:
    """What an op's schema says about its arguments (cached per op)."""

    name: str  # "aten::baddbmm"
    arguments: tuple[tuple[str, bool, bool], ...]  # (name, written, keyword-only) per schema argument
    is_view: bool
    pointwise: bool  # element i of the output comes from element i of each (broadcast) input


@functools.lru_cache(maxsize=4096)
def roles_of(func: Any) -> Roles:
    schema = func._schema
    arguments = tuple(
        (a.name, a.alias_info is not None and bool(a.alias_info.is_write), bool(a.kwarg_only))
        for a in schema.arguments
    )
    # ``transpose_``, ``squeeze_`` ... change the view, not the values
    tags = getattr(func, "tags", ())
    is_view = bool(getattr(func, "is_view", False)) or torch.Tag.inplace_view in tags
    pointwise = torch.Tag.pointwise in tags or str(schema.name) in COPY_OPS
    return Roles(str(schema.name), arguments, is_view, pointwise)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in one argument (``Tensor``, ``Tensor[]``, ``Tensor?[]``)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def scalar_is_nonfinite(v: Any) -> bool:
    """A Python NaN/inf passed to an op (``masked_fill(-inf)``): an intentional value, made by nobody."""
    return isinstance(v, float) and not math.isfinite(v)


def regions(name: str, every: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Which elements of an input the op actually uses, by argument name, for ops that select; an argument
    not in the answer is used whole."""
    if name == "aten::where":
        cond = every.get("condition")
        if isinstance(cond, torch.Tensor):
            return {"self": cond, "other": ~cond}
    if name in ("aten::masked_fill", "aten::masked_fill_"):
        mask = every.get("mask")
        if isinstance(mask, torch.Tensor):
            return {"self": ~mask, "value": mask.any()}
    return {}


def leaves(out: Any) -> list[torch.Tensor]:
    """The tensors an op returned (ops return a tensor, or tuples and lists of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        found: list[torch.Tensor] = []
        for v in out:
            found.extend(leaves(v))
        return found
    return []
