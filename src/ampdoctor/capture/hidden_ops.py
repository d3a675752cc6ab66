"""What the hidden-overflow watch (:mod:`.hidden`) knows about each op it sees: its name as the code called it,
what it does with its inputs' values (views, selections and fills, arithmetic, casts, everything else makes
values), and the constants that make a selection or an elementwise op an overflow rather than a sentinel."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ..records import FormatLimits
from .stats import format_limits

LOW_DTYPES = (torch.float16, torch.bfloat16)
_OVERFLOW_AT = {dtype: format_limits(dtype).overflow_threshold for dtype in LOW_DTYPES}
DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
LOW_NAMES = frozenset(DTYPE_NAMES.values())

# What an op does with its inputs' values.
SKIP = 0  # allocates memory it does not write (``empty``): nothing to follow
VIEW = 1  # rearranges or aliases one input's values (or casts them up): its output is that input's, not measured
SELECT = 2  # picks or fills values (``where``, ``masked_fill``, ``cat``, ``clamp``): measured, never makes a value
MAKE = 3  # computes new values: measured; makes a value when its output is non-finite and its inputs were finite
ARITH = 4  # elementwise arithmetic (add, sub, mul, div): MAKE, and classified per element (mask arithmetic)
CAST = 5  # a dtype conversion: MAKE when it lowers a wider format to the low one (70000.0 -> inf), else VIEW
INPUT = 6  # a tensor the watch did not see made (the batch, a buffer, a mask built outside): measured once

_VIEW_OPS = frozenset(
    {
        "view", "view_as", "reshape", "reshape_as", "transpose", "t", "permute", "contiguous", "clone", "detach",
        "expand", "expand_as", "squeeze", "unsqueeze", "flatten", "unflatten", "getitem", "narrow", "split",
        "split_with_sizes", "tensor_split", "chunk", "unbind", "movedim", "moveaxis", "swapaxes", "swapdims",
        "select", "as_strided", "repeat", "repeat_interleave", "tile", "roll", "flip", "unfold", "diagonal",
        "T", "mT", "H", "mH", "data", "real", "imag", "_base", "grad", "requires_grad", "broadcast_to",
        "broadcast_tensors", "atleast_1d", "atleast_2d", "atleast_3d", "view_as_real", "view_as_complex",
        "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "take_along_dim", "identity",
    }
)
# Not views: dropout scales what it keeps by 1/(1-p) in training (64992 / 0.9 -> inf in float16), so it is MAKE.
_SELECT_OPS = frozenset(
    {
        "masked_fill", "where", "cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack",
        "index_select", "gather", "scatter", "index_put", "index_fill", "index_copy",
        "masked_select", "masked_scatter", "fill", "full", "full_like", "zeros", "zeros_like", "ones", "ones_like",
        "new_full", "new_zeros", "new_ones", "new_tensor", "tensor", "as_tensor", "triu", "tril", "pad", "setitem",
        "copy", "zero", "clamp", "clip", "clamp_min", "clamp_max", "nan_to_num", "maximum", "minimum", "fmax",
        "fmin", "max", "min", "amax", "amin", "relu", "relu6", "hardtanh", "threshold", "abs", "neg", "sign",
        "sort", "topk", "kthvalue", "median", "nanmedian", "mode", "cummax", "cummin", "max_pool1d",
        "max_pool2d", "max_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
        "embedding", "one_hot", "arange", "linspace", "eye", "rand", "randn", "rand_like", "randn_like",
        "randint", "randint_like", "normal", "uniform", "bernoulli", "zero_", "diag_embed", "block_diag",
    }
)
# Ops that read only the shape, dtype or device of their tensor arguments (``zeros_like(x)``): not consumers.
SHAPE_ONLY_OPS = frozenset(
    {
        "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like", "new_full", "new_zeros",
        "new_ones", "new_tensor", "full", "zeros", "ones", "arange",
    }
)
_ARITH_OPS = frozenset({"add", "sub", "subtract", "mul", "multiply", "div", "divide", "true_divide", "rsub"})
_CAST_OPS = frozenset({"to", "half", "bfloat16", "float", "double", "type", "type_as"})
_ALLOCATION_OPS = frozenset({"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided"})
# Python operators as the ops they run.
_DUNDERS = {
    "__add__": "add", "__radd__": "add", "__iadd__": "add_", "__sub__": "sub", "__rsub__": "rsub",
    "__isub__": "sub_", "__mul__": "mul", "__rmul__": "mul", "__imul__": "mul_", "__truediv__": "div",
    "__rtruediv__": "div", "__itruediv__": "div_", "__div__": "div", "__rdiv__": "div", "__idiv__": "div_",
    "__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow", "__rpow__": "pow", "__ipow__": "pow_",
    "__neg__": "neg", "__abs__": "abs", "__getitem__": "getitem", "__setitem__": "setitem",
    "__floordiv__": "floor_divide", "__rfloordiv__": "floor_divide", "__mod__": "remainder",
    "__rmod__": "remainder",
}
# Selections that can write a constant into their output (a Python number, or a 0-d tensor); ``masked_fill``, ``fill_``
# and ``full`` raise on a constant the format cannot hold, these round it to inf silently.
FILL_SELECTS = frozenset(
    {"where", "setitem", "index_put", "tensor", "as_tensor", "scalar_tensor", "new_tensor"}
)
# Ops whose output may be an intentional mask (``-inf`` or ``finfo.min`` where a key is not attended): an operand
# of arithmetic made by one of these (or an input the watch did not see made) gets its -inf set aside per element.
MASK_FILLS = frozenset(
    {"masked_fill", "where", "full", "full_like", "new_full", "fill", "triu", "tril", "setitem", "index_fill",
     "index_put", "masked_scatter", "tensor", "as_tensor", "scalar_tensor", "new_tensor", "cat", "stack"}
)
# Elementwise ops besides arithmetic whose output element depends on the same element of their operand (so a
# mask's -inf there is passed on, and an inf elsewhere is made): measured where the operand is finite too.
ELEMENTWISE = frozenset(
    {"exp", "exp2", "expm1", "pow", "square", "float_power", "log", "log2", "log10", "log1p", "reciprocal", "rsqrt",
     "sqrt", "sinh", "cosh", "tan", "softplus", "gelu", "silu", "mish", "elu", "selu", "celu", "leaky_relu",
     "sigmoid", "tanh", "erf", "erfinv", "lgamma", "digamma", "logit", "xlogy", "addcmul", "addcdiv", "lerp"}
)
# How many numbers of a list argument (``torch.tensor([0.0, -1e9])``) are looked at.
_MAX_LISTED = 64

# func -> (op name, what the code called, category, in place); learned once per function, per process.
_INFO: dict[Any, tuple[str, str, int, bool]] = {}


def op_info(func: Any) -> tuple[str, str, int, bool]:
    """(op name, the function as the code called it, category, in place) of a function the mode sees."""
    found = _INFO.get(func)
    if found is not None:
        return found
    raw = getattr(func, "__name__", None) or str(func)
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        # ``torch.ops.aten.mul.Scalar(x, s)``: the same op as ``x * s`` (its arithmetic classified the same way)
        name = func._opname if isinstance(func, torch._ops.OpOverload) else raw
        inplace = name.endswith("_") and not name.startswith("_")
        base = name[:-1] if inplace else name
        info = (base, f"torch.ops.{func.__module__.rsplit('.', 1)[-1]}.{raw}", _category(base), inplace)
        if len(_INFO) < 4096:
            _INFO[func] = info
        return info
    if raw == "__get__":  # an attribute: ``x.T``, ``x.data``
        name = getattr(getattr(func, "__self__", None), "__name__", "attribute")
    else:
        name = _DUNDERS.get(raw, raw)
    inplace = name.endswith("_") and not name.startswith("_")
    base = name[:-1] if inplace else name
    category = VIEW if raw == "__get__" else _category(base)
    module = getattr(func, "__module__", None) or ""
    qualname = getattr(func, "__qualname__", None) or raw
    if qualname.startswith(("TensorBase.", "Tensor.", "_TensorBase.")) or raw == "__get__":
        called = f"Tensor.{raw if raw != '__get__' else name}"
    elif module in ("torch.nn.functional", "torch._C._nn"):
        called = f"F.{raw}"
    elif module.startswith("torch") or not module:
        called = f"torch.{raw}"
    else:
        called = f"{module}.{raw}"
    info = (base, called, category, inplace)
    if len(_INFO) < 4096:
        _INFO[func] = info
    return info


def _category(base: str) -> int:
    if base in _ALLOCATION_OPS:
        return SKIP
    if base in _VIEW_OPS:
        return VIEW
    if base in _CAST_OPS:
        return CAST
    if base in _SELECT_OPS:
        return SELECT
    if base in _ARITH_OPS:
        return ARITH
    return MAKE


def resolved(category: int, tensors: list[torch.Tensor], args: Any) -> int:
    """A cast makes values when it lowers a wider format (or a wide integer) to the low one (70000.0 -> inf); else
    it passes on."""
    if category != CAST:
        return category
    return MAKE if tensors[0].dtype in LOW_DTYPES and _wider_input(args) else VIEW


# Selections that write another tensor's values into a low-precision one: where that tensor is wider (or a wide
# integer), they cast it down (a float32 70000.0 copied into a float16 KV cache is inf). Its position and keyword.
_COPIED_FROM = {"copy": (1, "src"), "setitem": (2, "value"), "index_put": (2, "values"), "index_copy": (3, "source"),
                "masked_scatter": (2, "source"), "scatter": (3, "src")}
# Selections that sum what they place under some arguments (``index_put(..., accumulate=True)``, ``scatter(...,
# reduce="add")``): arithmetic then, which can overflow. The argument's position and keyword.
_ACCUMULATES = {"index_put": (3, "accumulate"), "scatter": (4, "reduce")}


def selection_makes(name: str, dtype: torch.dtype, args: Any, kwargs: Any) -> bool:
    """A selection that makes values in a low-precision output: it writes a finite constant the format cannot hold
    (:func:`oversized_fill`), casts a wider tensor down into it, or sums what it places."""
    if name in FILL_SELECTS and oversized_fill(dtype, args, kwargs):
        return True
    if dtype not in LOW_DTYPES:
        return False
    if copied_from(name, args, kwargs) is not None:
        return True
    summed = _ACCUMULATES.get(name)
    return summed is not None and bool(_argument(args, kwargs, *summed))


def copied_from(name: str, args: Any, kwargs: Any) -> Optional[torch.Tensor]:
    """The wider tensor (or wide integer one) a selection copies into its low-precision output, if any."""
    copied = _COPIED_FROM.get(name)
    source = _argument(args, kwargs, *copied) if copied is not None else None
    return source if _wider_input((source,)) else None


def _argument(args: Any, kwargs: Any, position: int, keyword: str) -> Any:
    return args[position] if len(args) > position else (kwargs or {}).get(keyword)


def oversized_fill(dtype: torch.dtype, args: Any, kwargs: Any) -> bool:
    """A selection or fill into a low-precision tensor with a finite constant the format cannot hold (``-1e9`` in
    float16 rounds to ``-inf``): a Python number, or a wider 0-d tensor on the CPU (read without any device sync)."""
    threshold = _OVERFLOW_AT.get(dtype)
    if threshold is None:
        return False
    for a in _numbers(args, kwargs):
        if isinstance(a, float):
            value = a
        elif (
            isinstance(a, torch.Tensor) and a.dim() == 0 and a.device.type == "cpu" and a.is_floating_point()
            and a.dtype not in LOW_DTYPES
        ):
            value = a.item()
        else:
            continue
        if math.isfinite(value) and abs(value) >= threshold:
            return True
    return False


def _numbers(args: Any, kwargs: Any) -> list[Any]:
    """The arguments, with a list or tuple of numbers (a ``torch.tensor`` literal) flattened, up to a bound."""
    found: list[Any] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            todo = list(a)
            while todo and len(found) < _MAX_LISTED:
                v = todo.pop()
                if isinstance(v, (list, tuple)):
                    todo.extend(v)
                else:
                    found.append(v)
        else:
            found.append(a)
    return found


def makes_with_scalar(value: float, limits: FormatLimits) -> bool:
    """Elementwise arithmetic with a Python scalar can make values: unless the scalar is an intentional non-finite
    value (``x + float("-inf")``) or a finite one at the format's max (``finfo.min`` mask arithmetic). A finite
    constant the format cannot hold (``* -1e9`` in float16: beyond 65520 it rounds to -inf) is no sentinel: it is
    the overflow, made from finite values."""
    if not math.isfinite(value):
        return False
    return not limits.max <= abs(value) < limits.overflow_threshold


def counted_op(func: Any, args: Any, out: Any) -> Optional[str]:
    """The op name under which the watch numbers this call (``OpOverflow.occurrence`` counts, per innermost
    module call, the calls this returns the same name for), or None when it does not number it: no floating
    output, memory allocation, views, reshapes, copies and casts up. For code that must find the same op again
    (an op-level float32 upcast of the k-th ``matmul`` of a module call)."""
    name, _, category, _ = op_info(func)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    tensors = [t for t in outs if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors or category == SKIP or resolved(category, tensors, args) == VIEW:
        return None
    return name


# Integer formats whose values can exceed float16's range (position ids or counts cast with ``.half()``).
_WIDE_INTS = (torch.int32, torch.int64)


def _wider_input(args: Any) -> bool:
    """A tensor argument wider than the low formats: floating (``x.half()`` of a float32 x lowers it) or a wide
    integer (``(positions * 1000).half()`` is inf from 65520 up)."""
    return any(
        isinstance(a, torch.Tensor)
        and ((a.is_floating_point() and a.dtype not in LOW_DTYPES) or a.dtype in _WIDE_INTS)
        for a in args[:1]
    )
