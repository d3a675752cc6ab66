"""One owner for everything a diagnosis (or a watch) installs, and a Ctrl-C that never cuts a restore in half.

Two rules make an interrupt at any moment leave nothing behind:

- **Registered before it takes effect.** Every install (a hook, a mode, an emulation kernel, a patched attribute,
  a swapped buffer, a copied parameter) happens inside an :func:`uninterrupted` function that also hands its
  undo to the thread's :class:`Cleanup` owner (:func:`on_cleanup`). Undos are idempotent: the code that
  installed something may undo it early (between passes), and the owner undoes whatever is still there at the
  end, in reverse order, also after an exception. The owner also puts back the thread's global torch state
  (grad mode, anomaly mode, autocast flags, dtypes, cache and nesting, the dispatch and function mode stacks,
  the cyclic garbage collector) as it found it.
- **A Ctrl-C waits while ampdoctor restores.** While an owner is open in the main thread, SIGINT goes to a
  handler that looks at the interrupted frame: inside an :func:`uninterrupted` function (installs, undos, the
  owner's own enter and exit) the interrupt is recorded and raised once that function returns; anywhere else
  (the user's forward, the loss, the backward, ampdoctor's orchestration) it goes straight to the handler that
  was there before (``KeyboardInterrupt``, or the CLI's own). The user sees their Ctrl-C once.

Only the main thread receives SIGINT; owners in other threads register undos and restore state the same way.
"""

from __future__ import annotations

import functools
import gc
import signal
import sys
import threading
import types
from typing import Any, Callable, Optional, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])
Undo = Callable[[], None]

_PROTECTED: set[types.CodeType] = set()  # code objects whose frames an interrupt must not cut
_OWNERS_IN_MAIN = [0]  # Cleanup owners open in the main thread


class _Shield:
    """The SIGINT handler while owners are open in the main thread (process state: guarded by ``lock``)."""

    lock = threading.Lock()
    users = 0
    previous: Any = None
    pending = False


# torch's own exits that a diagnosis runs around the user's state and that no owner can redo afterwards (inference
# mode is a C++ guard): while a diagnosis owns the main thread, a Ctrl-C inside them waits for the owner's exit.
_WHILE_OWNED: set[types.CodeType] = {
    torch.autograd.grad_mode.inference_mode.__enter__.__code__,
    torch.autograd.grad_mode.inference_mode.__exit__.__code__,
}


def _protected(frame: Optional[types.FrameType]) -> bool:
    owned = bool(_OWNERS_IN_MAIN[0])
    while frame is not None:
        code = frame.f_code
        if code in _PROTECTED or (owned and code in _WHILE_OWNED):
            return True
        frame = frame.f_back
    return False


def _handler(signum: int, frame: Optional[types.FrameType]) -> None:
    if _protected(frame):
        _Shield.pending = True  # raised when the protected call returns
        return
    _previous(signum, frame)


def _previous(signum: int, frame: Optional[types.FrameType]) -> None:
    previous = _Shield.previous
    if callable(previous) and previous is not _handler:
        previous(signum, frame)
    else:
        raise KeyboardInterrupt


def _deliver(caller: Optional[types.FrameType], in_flight: Optional[BaseException] = None) -> None:
    """A deferred Ctrl-C, raised once no protected frame is left on the stack (dropped when a KeyboardInterrupt
    is already on its way: the user pressed Ctrl-C once)."""
    if not _Shield.pending or _protected(caller):
        return
    _Shield.pending = False
    if isinstance(in_flight, KeyboardInterrupt):
        return
    _previous(signal.SIGINT, caller)


def uninterrupted(fn: F) -> F:
    """Run ``fn`` to its end even when Ctrl-C arrives meanwhile; the interrupt is raised when it returns."""

    def uninterrupted_call(*args: Any, **kwargs: Any) -> Any:
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            if _Shield.pending:
                _deliver(sys._getframe(1), exc)
            raise
        if _Shield.pending:
            _deliver(sys._getframe(1))
        return result

    _PROTECTED.add(uninterrupted_call.__code__)
    return functools.wraps(fn)(uninterrupted_call)  # type: ignore[return-value]


def uninterrupted_enter(enter: F) -> F:
    """An ``__enter__`` (or a start that a ``with`` follows) run as :func:`uninterrupted`; a Ctrl-C that arrived
    meanwhile leaves again (``__exit__``) before it is raised: a ``with`` statement calls no ``__exit__`` for an
    ``__enter__`` that raised, so raising it with things installed would leave them installed for good."""

    def uninterrupted_enter_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            result = enter(self, *args, **kwargs)
        except BaseException as exc:
            if _Shield.pending:
                _deliver(sys._getframe(1), exc)
            raise
        if _Shield.pending and not _protected(sys._getframe(1)):
            try:
                type(self).__exit__(self, None, None, None)
            finally:
                _deliver(sys._getframe(1))
        return result

    _PROTECTED.add(uninterrupted_enter_call.__code__)
    return functools.wraps(enter)(uninterrupted_enter_call)  # type: ignore[return-value]


def protect_frames_of(*functions: Callable[..., Any]) -> None:
    """Mark the frames of these functions (generator context managers: their set-up and tear-down parts) as
    not to be cut; a Ctrl-C there is raised by the next :func:`uninterrupted` call or the owner's exit."""
    for fn in functions:
        code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
        if code is not None:
            _PROTECTED.add(code)


def shield_sigint() -> bool:
    """Hold a Ctrl-C that arrives inside an :func:`uninterrupted` call until it returns (main thread only; the
    SIGINT handler in place is kept and called). True when this call holds the shield: give it back with
    :func:`unshield_sigint`."""
    if threading.current_thread() is not threading.main_thread():
        return False
    with _Shield.lock:
        if _Shield.users:
            _Shield.users += 1
            return True
        current = signal.getsignal(signal.SIGINT)
        if not callable(current):  # SIG_DFL / SIG_IGN / None (not set from Python): nothing to defer
            return False
        _Shield.previous = current
        _Shield.pending = False
        signal.signal(signal.SIGINT, _handler)
        _Shield.users = 1
        return True


def unshield_sigint() -> bool:
    """Give the shield back; the last holder puts the previous SIGINT handler back (unless something replaced
    ours meanwhile). True when a held Ctrl-C is still to be raised (by the caller, once its work is done)."""
    with _Shield.lock:
        _Shield.users -= 1
        if _Shield.users:
            return False
        pending, _Shield.pending = _Shield.pending, False
        if signal.getsignal(signal.SIGINT) is _handler:
            signal.signal(signal.SIGINT, _Shield.previous)
        _Shield.previous = None
        return pending


def raise_held_interrupt() -> None:
    """The user's Ctrl-C, held while ampdoctor put things back: raised now, through their own handler."""
    _previous(signal.SIGINT, sys._getframe(1))


# -- the thread's global torch state ---------------------------------------------------------------------------
_DEVICES = ("cpu", "cuda")


def _autocast_nesting() -> int:
    depth = torch.autocast_decrement_nesting() + 1
    torch.autocast_increment_nesting()
    return depth


def _dispatch_depth() -> int:
    return int(torch._C._len_torch_dispatch_stack())


def _function_depth() -> int:
    return int(torch._C._len_torch_function_stack())


# The cyclic garbage collector is process-wide: diagnoses running at once in several threads share one pause of
# it, the caller's setting taken by the first and put back by the last (each putting back what it saw would leave
# it off: the second to start saw the first's pause).
_GC_LOCK = threading.Lock()
_gc_pauses = 0
_gc_before = True


def pause_gc() -> Callable[[], None]:
    """Turn the cyclic collector off until the returned (idempotent) resume is called."""
    global _gc_pauses, _gc_before
    with _GC_LOCK:
        if _gc_pauses == 0:
            _gc_before = gc.isenabled()
        _gc_pauses += 1
        gc.disable()
    resumed = False

    def resume() -> None:
        global _gc_pauses
        nonlocal resumed
        with _GC_LOCK:
            if resumed:
                return
            resumed = True
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_before:
                gc.enable()

    return resume


def _gc_setting() -> bool:
    """The caller's collector setting: the one before the pauses while any runs."""
    with _GC_LOCK:
        return _gc_before if _gc_pauses else gc.isenabled()


class TorchState:
    """The thread-local torch state a pass changes, captured once and put back exactly (and the collector's
    setting, which the last pause puts back while any runs)."""

    def __init__(self) -> None:
        self.grad = torch.is_grad_enabled()
        self.anomaly = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
        self.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _DEVICES]
        self.cache = torch.is_autocast_cache_enabled()
        self.nesting = _autocast_nesting()
        self.dispatch = _dispatch_depth()
        self.function = _function_depth()
        self.gc = _gc_setting()

    def changed(self) -> list[str]:
        """What differs now (empty when everything is as captured)."""
        now = TorchState()
        return [name for name in ("grad", "anomaly", "autocast", "cache", "nesting", "dispatch", "function", "gc")
                if getattr(now, name) != getattr(self, name)]

    def restore(self) -> None:
        from torch.utils._python_dispatch import _pop_mode

        while _dispatch_depth() > self.dispatch:  # modes pushed since (their own exits did not run)
            _pop_mode()
        while _function_depth() > self.function:
            torch._C._pop_torch_function_stack()
        nesting = _autocast_nesting()
        while nesting > self.nesting:
            nesting = torch.autocast_decrement_nesting()
            if nesting == 0:
                torch.clear_autocast_cache()
        while nesting < self.nesting:
            nesting = torch.autocast_increment_nesting()
        for device, enabled, dtype in self.autocast:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(self.cache)
        torch.set_anomaly_enabled(*self.anomaly)
        torch.set_grad_enabled(self.grad)
        with _GC_LOCK:
            if _gc_pauses:  # another diagnosis (or an outer one) still holds it off: its last resume decides
                return
            if self.gc:
                gc.enable()
            else:
                gc.disable()


# -- the owner --------------------------------------------------------------------------------------------------
class _Owners(threading.local):
    def __init__(self) -> None:
        self.stack: list[Cleanup] = []


_OWNERS = _Owners()


class Cleanup:
    """The one owner of what a diagnosis or a watch installs: ``with Cleanup(): ...``.

    On exit (normal, exception or Ctrl-C) it runs every registered undo still pending, newest first, each to its
    end; puts the thread's torch state back; and, in the main thread, gives SIGINT back to its previous handler,
    then raises a Ctrl-C that arrived meanwhile (once). An undo that raises does not stop the others; the first
    such error is raised afterwards (unless another exception is already on its way).
    """

    def __init__(self) -> None:
        self._undo: list[Undo] = []
        self._state: Optional[TorchState] = None
        self._shielded = False
        self._open = False

    @uninterrupted_enter
    def __enter__(self) -> Cleanup:
        if self._open:
            raise RuntimeError("a Cleanup owner is not reentrant")
        self._state = TorchState()
        _OWNERS.stack.append(self)
        self._open = True
        self._shielded = shield_sigint()
        if self._shielded:
            _OWNERS_IN_MAIN[0] += 1
        return self

    def add(self, undo: Undo) -> Undo:
        self._undo.append(undo)
        return undo

    def discard(self, undo: Undo) -> None:
        for i in range(len(self._undo) - 1, -1, -1):
            if self._undo[i] is undo:
                del self._undo[i]
                return

    @uninterrupted
    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        if not self._open:
            return
        if isinstance(exc, KeyboardInterrupt):
            _Shield.pending = False  # the user's Ctrl-C is already on its way: once is enough
        errors: list[BaseException] = []
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except Exception as error:  # keep undoing the rest
                errors.append(error)
        if self._state is not None:
            try:
                self._state.restore()
            except Exception as error:
                errors.append(error)
        if self in _OWNERS.stack:
            _OWNERS.stack.remove(self)
        self._open = False
        pending = False
        if self._shielded:
            self._shielded = False
            _OWNERS_IN_MAIN[0] -= 1
            pending = unshield_sigint()
        if pending and not isinstance(exc, KeyboardInterrupt):
            _previous(signal.SIGINT, sys._getframe(1))  # the user's Ctrl-C, now that everything is back
        if errors and exc is None:
            raise errors[0]


def current_owner() -> Optional[Cleanup]:
    """The innermost open owner of this thread, if any."""
    stack = _OWNERS.stack
    return stack[-1] if stack else None


@uninterrupted
def on_cleanup(undo: Undo) -> Undo:
    """Give ``undo`` (idempotent) to this thread's owner, to run at its exit unless :func:`cleaned` says it ran;
    without an owner (a capture used on its own) nothing is registered. Returns ``undo``."""
    owner = current_owner()
    if owner is not None:
        owner.add(undo)
    return undo


@uninterrupted
def cleaned(undo: Undo) -> None:
    """``undo`` ran to its end: the owner need not keep it (nor what it references)."""
    for owner in reversed(_OWNERS.stack):
        owner.discard(undo)


def owns_cleanup(fn: F) -> F:
    """``fn`` runs inside its own :class:`Cleanup` owner: whatever it installs is gone when it returns or raises,
    also when Ctrl-C interrupts it at any moment."""

    @functools.wraps(fn)
    def owned(*args: Any, **kwargs: Any) -> Any:
        with Cleanup():
            return fn(*args, **kwargs)

    return owned  # type: ignore[return-value]
