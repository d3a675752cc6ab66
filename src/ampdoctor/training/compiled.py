"""``torch.compile`` under the watch: no recompiles, no graph breaks, statistics all the same.

Measured on torch 2.13: hooks added to submodules after the first compiled call never run (dynamo keeps no guard
on hooks), hooks that append to Python lists recompile every step until the recompile limit and then run
eagerly for good, and ``.item()`` in a hook breaks the graph. So, for a compiled model:

* **the root's bookkeeping runs outside the graph**: hooks on the ``torch.compile`` wrapper (``OptimizedModule``
  runs its own hooks eagerly, then the compiled module), or, for ``model.compile()``, a wrapper around the
  module's compiled call (:class:`RootTap`);
* **per-module statistics** come from hooks registered once, when the watch starts (before the first compiled
  call, so dynamo traces them in), that only do tensor work: each module's output and output-gradient
  ``aminmax`` go into a preallocated buffer (:class:`CompiledStats`), read back with the step. One Python flag
  gates them: dynamo compiles the graph once with it on and once with it off, and switches between the two
  without recompiling;
* **captures replay eagerly** (:func:`eager_calls`), and the report says that an eager replay can differ from
  the compiled step (inductor keeps fused intermediates in float32).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import nn

from .forwards import HookTap
from .readback import Decoded, Extra, Pair

# Columns of a module's row in a buffer (one buffer for outputs, one for output gradients, so the forward and
# the backward graph each write their own): the low-precision tensors' (lo, hi), the other floating tensors'
# (lo, hi), and whether each kind was seen.
_COLUMNS = 6
_LO, _HI, _RAN = (0, 2), (1, 3), (4, 5)  # index for low-precision tensors, index for the others
_EMPTY = (math.inf, -math.inf, math.inf, -math.inf, 0.0, 0.0)
LOW_DTYPES = (torch.float16, torch.bfloat16)

COMPILED_NOTE = (
    "the model is compiled (torch.compile): the capture replayed the failing step eagerly; inductor keeps fused "
    "intermediates in float32, so eager low-precision values can differ from the compiled step's (an eager "
    "overflow may not happen compiled, and the reverse)"
)
NO_STATS_NOTE = (
    "no per-module statistics came from the compiled model: it was compiled and called before the watch started "
    "(torch.compile keeps no guard on hooks added later); start the watch before the first call"
)


def optimized_wrapper(model: nn.Module) -> Optional[nn.Module]:
    """The outermost ``torch.compile`` wrapper (``OptimizedModule``) among ``model``'s wrappers, if any."""
    seen: Any = model
    while isinstance(seen, nn.Module):
        if type(seen).__name__ == "OptimizedModule" and isinstance(getattr(seen, "_orig_mod", None), nn.Module):
            return seen
        if not isinstance(seen, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            return None
        seen = seen.module
    return None


def is_compiled(model: nn.Module, root: nn.Module) -> bool:
    """``torch.compile(model)`` or ``model.compile()`` (on the root or on any submodule)."""
    return optimized_wrapper(model) is not None or any(
        m.__dict__.get("_compiled_call_impl") is not None for m in root.modules()
    )


class RootTap:
    """``pre(module, args, kwargs)`` and ``post(module, args, kwargs, output)`` around every call of the root,
    run eagerly even when the root is compiled."""

    def __init__(
        self,
        model: nn.Module,
        root: nn.Module,
        pre: Callable[[nn.Module, Any, Any], None],
        post: Callable[[nn.Module, Any, Any, Any], None],
    ) -> None:
        self.handles: list[Any] = []
        self.root = root
        self.wrapped: Optional[Callable[..., Any]] = None
        host = optimized_wrapper(model)
        compiled_call = root.__dict__.get("_compiled_call_impl")
        if host is None and compiled_call is not None:  # model.compile(): wrap the compiled call itself
            self.wrapped = compiled_call

            def call(*args: Any, **kwargs: Any) -> Any:
                pre(root, args, kwargs)
                output = compiled_call(*args, **kwargs)
                post(root, args, kwargs, output)
                return output

            self.wrapper = call
            root._compiled_call_impl = call
            return
        host = host if host is not None else root
        # hooks a copy of the model made while watched does not inherit (it would record into this watch)
        self.handles.append(HookTap(
            host, pre=lambda m, a, k: pre(root, a, k), post=lambda m, a, k, o: post(root, a, k, o), with_kwargs=True,
        ))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.wrapped is not None and self.root.__dict__.get("_compiled_call_impl") is self.wrapper:
            self.root._compiled_call_impl = self.wrapped
        self.wrapped = None


def _floating(output: Any) -> list[torch.Tensor]:
    """The floating, non-empty tensors of a module's output (tensor, tuple/list, dict), without pytree: dynamo
    traces this."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() and output.numel() > 0 else []
    items: Any = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    found: list[torch.Tensor] = []
    for item in items:
        if isinstance(item, torch.Tensor) and item.is_floating_point() and item.numel() > 0:
            found.append(item)
    return found


class CompiledStats:
    """Per-module output and output-gradient statistics written into one buffer, gated by :attr:`on`."""

    def __init__(self, root: nn.Module, names: dict[int, str]) -> None:
        self.modules = [(names.get(id(m), ""), m) for m in root.modules() if m is not root]
        device = next((p.device for p in root.parameters()), torch.device("cpu"))
        rows = max(1, len(self.modules))
        self.outputs = torch.zeros(rows, _COLUMNS, device=device)
        self.grads = torch.zeros(rows, _COLUMNS, device=device)
        self.on = False
        self.seen = False  # the last sampled step's read-back held statistics
        self.handles = [m.register_forward_hook(self._hook(i)) for i, (_, m) in enumerate(self.modules)]
        self.reset()

    def reset(self) -> None:
        """Before a sampled step: nothing seen yet."""
        with torch.no_grad():
            for buffer in (self.outputs, self.grads):
                buffer.copy_(torch.tensor(_EMPTY, device=buffer.device).expand_as(buffer))

    def remove(self) -> None:
        self.on = False
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _hook(self, index: int) -> Callable[[nn.Module, Any, Any], None]:
        outputs, grads = self.outputs, self.grads

        def record(buffer: torch.Tensor, tensors: list[torch.Tensor]) -> None:
            """One write of the module's row: (lo, hi) of each kind folded into what earlier calls left."""
            row = buffer[index]
            new = [row[c] for c in range(_COLUMNS)]
            for kind in (0, 1):  # low-precision tensors, then the others
                chosen = [t for t in tensors if (t.dtype in LOW_DTYPES) == (kind == 0)]
                if not chosen:
                    continue
                pairs = torch.stack([torch.stack(torch.aminmax(t.detach())).float() for t in chosen])
                new[_LO[kind]] = torch.minimum(row[_LO[kind]], pairs[:, 0].amin())
                new[_HI[kind]] = torch.maximum(row[_HI[kind]], pairs[:, 1].amax())
                new[_RAN[kind]] = torch.ones_like(row[_RAN[kind]])
            buffer[index].copy_(torch.stack(new))

        def on_grad(grad: torch.Tensor) -> None:
            if grad.numel() > 0:
                record(grads, [grad])

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.on:
                return
            tensors = _floating(output)
            if not tensors:
                return
            record(outputs, tensors)
            for t in tensors:
                if t.requires_grad:
                    t.register_hook(on_grad)

        return hook

    def extra(self) -> Extra:
        """Both buffers, read back with the step."""
        return Extra(torch.cat([self.outputs.reshape(-1), self.grads.reshape(-1)]), self._decode)

    def _decode(self, numbers: list[float]) -> Decoded:
        pairs: list[Pair] = []
        half = len(numbers) // 2
        for offset, kind in ((0, "out"), (half, "grad")):
            for i, (name, _) in enumerate(self.modules):
                row = numbers[offset + i * _COLUMNS : offset + (i + 1) * _COLUMNS]
                for which in (0, 1):
                    if row[_RAN[which]]:
                        pairs.append((kind, name, row[_LO[which]], row[_HI[which]], which == 0))  # type: ignore[arg-type]
        self.seen = bool(pairs)
        return Decoded(pairs=pairs)
