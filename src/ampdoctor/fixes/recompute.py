"""Verification re-runs that hold less: each call of the named modules keeps none of the tensors autograd saves
inside it; the backward's first use of one re-runs that call (same inputs, random draws, autocast state and op
upcast) and takes the tensors from the re-run.

An op-level float32 upcast (:mod:`.upcast`) keeps its result in float32, and the ops after it follow: proving it
on the whole step would hold the step's largest tensors (an attention's scores) at twice their size until the
backward reaches them, over the memory a plain step needs. Recomputed, the re-run holds the upcast modules'
tensors one call at a time. The values are the same: the re-run repeats the call exactly, and a re-run that saves
another number of tensors, or a tensor of another shape or dtype, than the first (a data-dependent path), or whose
inputs were written in place meanwhile, raises :class:`RecomputeMismatch` instead of handing back a wrong tensor.

This is non-reentrant activation checkpointing (``torch.utils.checkpoint``) reduced to what a diagnosis needs,
without the compiler machinery that ``torch.utils.checkpoint`` imports on its first call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from ..capture.model import find_module, unwrap_model
from ..capture.state import RngState
from ..capture.walk import iter_tensors
from ..errors import raised_from
from .patching import ForwardPatch

# Autocast flags a call runs under, re-set for its re-run (CPU and CUDA: the emulated CUDA policy sets both).
_AUTOCAST_DEVICES = ("cpu", "cuda")
Replay = Callable[[str], contextlib.AbstractContextManager[Any]]


class RecomputeMismatch(RuntimeError):
    """A re-run of a call did not save what its first run saved (or its inputs changed since)."""


def recompute_mismatch(exc: BaseException) -> bool:
    """``exc`` is, or was raised from, a :class:`RecomputeMismatch` (a re-run pass wraps what the backward raised)."""
    return raised_from(exc, RecomputeMismatch)


def hooks_allowed() -> bool:
    """Saved-tensor hooks may be installed here (a wrapper such as FSDP can disable them)."""
    allowed = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    return True if allowed is None else bool(allowed())


def _autocast_state() -> tuple[tuple[str, bool, torch.dtype], ...]:
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES)


@contextlib.contextmanager
def _autocast_as(state: tuple[tuple[str, bool, torch.dtype], ...]) -> Iterator[None]:
    """The autocast flags and dtypes of ``state`` for the block (a region of its own: its own cast cache)."""
    before = _autocast_state()
    torch.autocast_increment_nesting()
    try:
        for device, enabled, dtype in state:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        yield
    finally:
        for device, enabled, dtype in before:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()


class _Call:
    """One call whose saved tensors are dropped: their shapes and dtypes in saving order, and how to re-run it."""

    __slots__ = ("metas", "rerun", "inputs", "made")

    def __init__(self, rerun: Callable[[Callable[[torch.Tensor], Any]], None], inputs: list[torch.Tensor]) -> None:
        self.metas: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        self.rerun = rerun
        self.inputs = [(t, t._version) for t in inputs]
        self.made: dict[int, torch.Tensor] = {}

    def pack(self, t: torch.Tensor) -> int:
        self.metas.append((t.shape, t.dtype, t.device))
        return len(self.metas) - 1

    def unpack(self, index: int) -> torch.Tensor:
        found = self.made.pop(index, None)
        if found is None:  # first use in this backward (or a second backward through the graph): re-run
            self._remake()
            found = self.made.pop(index)
        return found

    def _remake(self) -> None:
        changed = [tuple(t.shape) for t, version in self.inputs if t._version != version]
        if changed:
            raise RecomputeMismatch(f"an input of a recomputed call was written in place after the call {changed}")
        made: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> int:
            made.append(t.detach() if t.requires_grad else t)
            return len(made) - 1

        self.rerun(keep)
        metas = [(t.shape, t.dtype, t.device) for t in made]
        if metas != self.metas:
            raise RecomputeMismatch(
                f"the re-run of a call saved {len(metas)} tensor(s) where its first run saved {len(self.metas)}, "
                "or of other shapes or dtypes (a data-dependent path)"
            )
        self.made = dict(enumerate(made))


class Recomputed(ForwardPatch):
    """For the block: every call of the named modules (the outermost of them; a named module inside another is
    recomputed with it) keeps no tensor for the backward; the backward re-runs the call when it needs them.

    ``replay(name)``: the context a re-run of ``name``'s call runs in, besides the call's autocast state and random
    streams (an :class:`~.upcast.Fp32Op`'s :meth:`~.upcast._ScopedOps.replay`, so the same op is upcast again).
    ``forward`` attributes are put back exactly as they were (as :class:`~.fallback.Fp32Fallback` does).
    """

    def __init__(self, model: nn.Module, modules: Iterable[str], replay: Optional[Replay] = None) -> None:
        root, _ = unwrap_model(model)
        names = [modules] if isinstance(modules, str) else list(modules)
        outer = [n for n in names if not any(o != n and (o == "" or n.startswith(o + ".")) for o in names)]
        super().__init__()
        self._replay = replay
        self.calls = 0  # calls run with their saved tensors dropped
        self.reruns = 0  # re-runs the backward asked for
        self._patch([(name, find_module(root, name)) for name in dict.fromkeys(outer)])

    def _wrap(self, name: Any, module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        def recomputed_forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled() or not hooks_allowed():
                return forward(*args, **kwargs)  # nothing saved, or saved-tensor hooks refused here: as it is
            autocast, rng = _autocast_state(), RngState.capture()

            def rerun(keep: Callable[[torch.Tensor], Any]) -> None:
                self.reruns += 1
                now = RngState.capture()
                rng.restore()
                try:
                    with contextlib.ExitStack() as stack:
                        stack.enter_context(torch.enable_grad())
                        stack.enter_context(_autocast_as(autocast))
                        if self._replay is not None:
                            stack.enter_context(self._replay(name))
                        stack.enter_context(saved_tensors_hooks(keep, _unused))
                        forward(*args, **kwargs)
                finally:
                    now.restore()

            inputs = [t for _, t in iter_tensors((args, kwargs), "")]
            call = _Call(rerun, inputs)
            self.calls += 1
            with saved_tensors_hooks(call.pack, call.unpack):
                return forward(*args, **kwargs)

        recomputed_forward.__wrapped__ = forward  # type: ignore[attr-defined]
        return recomputed_forward

def _unused(index: int) -> torch.Tensor:  # a re-run's own graph is never run backward
    raise RecomputeMismatch("a re-run's own graph was run backward")
