"""Op-level float32: run one op (the k-th call of it in each call of the named modules) in float32, and keep its
result in float32, while AMP stays on for everything else, the rest of those modules included.

Cheaper than running the whole module in float32 (:mod:`.fallback`): only that op's result is float32. The op
is named by what the code calls, as :func:`ampdoctor.capture.hidden.op_info` names it (``q @ k``,
``torch.matmul`` and ``Tensor.matmul`` are all ``"matmul"``; ``x ** 2`` is ``"pow"``; ``torch.exp`` is
``"exp"``), and by its 0-based occurrence among the calls of that op in the module's own code: ops inside child
modules do not count (they are the children's), and neither do ops inside a function the mode sees as one op
(``F.scaled_dot_product_attention``, ``F.multi_head_attention_forward``). ``ampdoctor.diagnose`` resolves the
op and the occurrence from the source line; at training time nothing looks at frames or source lines, so the
mode costs one dictionary look-up per op inside the named modules and compiles without reading the stack.

The result stays float32 on purpose: casting it back to float16 would re-create the inf the upcast avoided.
Later ops follow their inputs' dtype or autocast's policy as they would anyway.

Data-dependent branches change which call is the k-th; ``diagnose`` checks the occurrence on its re-run (each
upcast call's source line), and :attr:`Fp32Op.misses` counts module calls in which the k-th call never came.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, get_overridable_functions
from torch.utils._pytree import tree_map
from torch.utils.hooks import RemovableHandle

from ..capture.cleanup import cleaned, on_cleanup, uninterrupted
from ..capture.dtypes import upcast
from ..capture.hidden import op_info
from ..capture.model import find_module, unwrap_model
from ..capture.stats import measuring
from ..errors import InvalidInput
from .rules_upcast import FUSED_FUNCTIONS


@functools.lru_cache(maxsize=64)
def functions_of(op: str) -> frozenset[Any]:
    """Every overridable torch function the mode would see under the op name ``op`` (``"matmul"``: ``torch.matmul``,
    ``Tensor.matmul``, ``Tensor.__matmul__``, ``Tensor.__rmatmul__``)."""
    every = (f for group in get_overridable_functions().values() for f in group)
    return frozenset(f for f in every if op_info(f)[0] == op)


@dataclass
class _Frame:
    """One running call of a named module: how many calls of each op its own code made so far."""

    module: str
    depth: int = 0  # > 0 while a child module runs (its ops are not this call's)
    seen: dict[str, int] = field(default_factory=dict)


def _floating(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_floating_point()
    if isinstance(value, (list, tuple)):
        return any(_floating(v) for v in value)
    return False


def _device_type(args: Any, kwargs: Any) -> str:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
        if isinstance(value, (list, tuple)):
            found = next((v for v in value if isinstance(v, torch.Tensor)), None)
            if found is not None:
                return found.device.type
    return "cpu"


class _Mode(TorchFunctionMode):
    """The torch-function mode a :class:`_ScopedOps` is on the stack with while a named module runs."""

    def __init__(self, owner: _ScopedOps) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        owner = self.owner
        frame = owner.stack[-1] if owner.stack else None
        name = owner.counts(func) if frame is not None and not frame.depth else None
        if name is None or not (_floating(args) or _floating(tuple(kwargs.values()))):
            return func(*args, **kwargs)
        if not torch.compiler.is_compiling() and measuring():  # ampdoctor's own statistics, on its re-runs
            return func(*args, **kwargs)
        k = frame.seen.get(name, 0)  # type: ignore[union-attr]
        frame.seen[name] = k + 1  # type: ignore[union-attr]
        return owner.on_op(frame, name, k, func, args, kwargs)  # type: ignore[arg-type]


class _ScopedOps:
    """Counts, per running call of the named modules, the calls of each op its own code makes (children's aside),
    and hands each counted call to :meth:`on_op`. The mode goes on the stack in the outermost named module's
    pre-hook and comes off in its forward hook (``always_call``: also when the forward raises). The hooks return
    nothing (a returned value would replace the module's arguments or output). The handle removes every hook on
    :meth:`remove` or at the end of a ``with`` block."""

    def __init__(self, model: nn.Module, modules: Iterable[str]) -> None:
        root, _ = unwrap_model(model)
        names = [modules] if isinstance(modules, str) else list(modules)
        if not names:
            raise InvalidInput("no module names given: pass the modules the report names, e.g. ['blocks.0.attn']")
        targets: dict[str, nn.Module] = {}
        for name in names:
            module = find_module(root, name)
            if all(module is not m for m in targets.values()):  # a module named twice (shared) counts once
                targets[name] = module
        self.modules = names
        self.calls = 0  # calls of the named modules seen
        self.stack: list[_Frame] = []
        self._mode = _Mode(self)
        self._on_stack = False
        self.replaying = False  # a re-run of a call (a recompute during backward): its ops are not counted
        self._handles: list[RemovableHandle] = []
        self._undo: Optional[Callable[[], None]] = None
        self._install(targets)

    @uninterrupted
    def _install(self, targets: dict[str, nn.Module]) -> None:
        self._undo = on_cleanup(self.remove)
        named = {id(m) for m in targets.values()}
        children: dict[int, nn.Module] = {}
        for module in targets.values():
            for sub in module.modules():
                if id(sub) not in named:
                    children[id(sub)] = sub
        try:
            for name, module in targets.items():
                self._handles.append(module.register_forward_pre_hook(self._enter_call(name)))
                self._handles.append(module.register_forward_hook(self._leave_call, always_call=True))
            for sub in children.values():
                self._handles.append(sub.register_forward_pre_hook(self._enter_child))
                self._handles.append(sub.register_forward_hook(self._leave_child, always_call=True))
        except BaseException:
            self.remove()
            raise

    # -- hooks (they return None) ------------------------------------------------------------------------------
    def _enter_call(self, name: str) -> Callable[[nn.Module, Any], None]:
        def pre_hook(module: nn.Module, args: Any) -> None:
            if not self.stack and not self._on_stack:
                self._mode.__enter__()
                self._on_stack = True
            self.stack.append(_Frame(name))
            if not self.replaying:
                self.calls += 1

        return pre_hook

    def _leave_call(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.stack:
            return
        frame = self.stack.pop()
        if not self.replaying:
            self.on_call_end(frame)
        if not self.stack and self._on_stack:
            self._on_stack = False
            self._mode.__exit__(None, None, None)

    def _enter_child(self, module: nn.Module, args: Any) -> None:
        if self.stack:
            self.stack[-1].depth += 1

    def _leave_child(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack and self.stack[-1].depth > 0:
            self.stack[-1].depth -= 1

    @contextlib.contextmanager
    def replay(self, name: str) -> Iterator[None]:
        """A re-run of a call of the named module ``name`` (a recompute during backward, :mod:`.recompute`), its
        own hooks not running: the same ops are handled as in the call, and nothing is counted."""
        outer, self.replaying = self.replaying, True
        entered = not self._on_stack
        if entered:
            self._mode.__enter__()
            self._on_stack = True
        self.stack.append(_Frame(name))
        try:
            yield
        finally:
            self.stack.pop()
            if entered and self._on_stack:
                self._on_stack = False
                self._mode.__exit__(None, None, None)
            self.replaying = outer

    # -- what a subclass decides ---------------------------------------------------------------------------------
    def counts(self, func: Any) -> Optional[str]:
        """The op name under which calls of ``func`` are counted, or None when they are not (all are by default)."""
        return op_info(func)[0]

    def on_op(self, frame: _Frame, name: str, k: int, func: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        """Run the ``k``-th call of op ``name`` in ``frame``'s module call (the mode is off the stack here)."""
        return func(*args, **kwargs)

    def on_call_end(self, frame: _Frame) -> None:
        """A named module's call ended (returned or raised)."""

    @uninterrupted
    def remove(self) -> None:
        """Remove every hook (idempotent); takes the mode off the stack if a forward stopped inside a named module
        without its hooks running."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.stack.clear()
        if self._on_stack:
            self._on_stack = False
            self._mode.__exit__(None, None, None)
        if self._undo is not None:
            cleaned(self._undo)
            self._undo = None

    def __enter__(self) -> _ScopedOps:
        return self

    def __exit__(
        self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.remove()


class Fp32Op(_ScopedOps):
    """The k-th call (``occurrence``, 0-based) of ``op`` inside each call of the named modules runs with autocast
    off on float32 copies of its low-precision inputs, and its float32 result is kept. Parameters are never
    touched; gradients flow through the float32 op (its inputs' ``.float()`` is on the graph).

    ``calls``: calls of the named modules seen; ``hits``: ops run in float32; ``misses``: module calls in which the
    k-th call of ``op`` never came (a branch took another path). Expect ``hits == calls`` and ``misses == 0``.
    Use as a context manager, or keep the handle and call ``remove()``.
    """

    def __init__(self, model: nn.Module, modules: Iterable[str], op: str, occurrence: int = 0) -> None:
        if not isinstance(op, str) or not op or op.startswith("aten::"):
            raise InvalidInput(
                f"op={op!r}: name the function the code calls, as the report's snippet does ('matmul' for q @ k, "
                "'pow', 'exp'), not an aten op"
            )
        if isinstance(occurrence, bool) or not isinstance(occurrence, int) or occurrence < 0:
            raise InvalidInput(f"occurrence={occurrence!r}: a 0-based index (0 is the op's first call in the module)")
        if op in FUSED_FUNCTIONS:
            raise InvalidInput(f"op={op!r} is a fused kernel: run its module in float32 (ampdoctor.fp32_fallback) "
                               "or compute it from its parts")
        self.op = op
        self.occurrence = occurrence
        self.hits = 0
        self.misses = 0
        # Set by ampdoctor's verification only: a callable naming the running source line (it reads frames).
        self.where: Optional[Callable[[], Any]] = None
        self.sites: list[tuple[str, Any]] = []  # (module, where()) of each upcast call, when ``where`` is set
        self.peaks: dict[str, float] = {}  # largest |result| per module, when ``where`` is set
        self._family = functions_of(op)
        if not self._family:
            raise InvalidInput(f"op={op!r}: no torch function has that name ('matmul', 'bmm', 'pow', 'exp', 'mul', "
                               "'add', 'sum', 'linear', ...)")
        super().__init__(model, modules)

    def counts(self, func: Any) -> Optional[str]:
        # A set of function objects, built once: at run time no name is computed (and torch.compile traces a
        # set membership test, where it would break the graph on string work).
        return self.op if func in self._family else None

    def on_op(self, frame: _Frame, name: str, k: int, func: Any, args: tuple[Any, ...], kwargs: Any) -> Any:
        if k != self.occurrence:
            return func(*args, **kwargs)
        with torch.autocast(_device_type(args, kwargs), enabled=False):
            out = func(*tree_map(upcast, args), **tree_map(upcast, kwargs))
        if self.replaying:
            return out
        self.hits += 1
        if self.where is not None:  # ampdoctor's verification: the line, and how large the float32 result got
            self.sites.append((frame.module, self.where()))
            if isinstance(out, torch.Tensor) and out.is_floating_point() and out.numel():
                peak = float(out.detach().abs().max())
                self.peaks[frame.module] = max(self.peaks.get(frame.module, 0.0), peak)
        return out

    def on_call_end(self, frame: _Frame) -> None:
        if frame.seen.get(self.op, 0) <= self.occurrence:
            self.misses += 1

    def __enter__(self) -> Fp32Op:
        return self


def fp32_op(model: nn.Module, modules: Iterable[str], op: str, occurrence: int = 0) -> Fp32Op:
    """Run only one op in float32: the ``occurrence``-th call (0-based) of ``op`` in the own code of each of
    ``modules`` (names as in the report), keeping its result in float32; AMP stays on for everything else.
    Returns a handle with ``.remove()``, ``.calls``, ``.hits`` and ``.misses``; ``diagnose`` gives the arguments.

    >>> ampdoctor.fp32_op(model, ["blocks.0.attn", "blocks.1.attn"], "matmul", 0)  # scores = q @ k.transpose(...)
    >>> with ampdoctor.fp32_op(model, ["encoder.norm_block"], "pow", 1):
    ...     train_step()
    """
    return Fp32Op(model, modules, op, occurrence)
