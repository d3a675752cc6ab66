"""Wrapper peeling and module naming: the one place that knows DDP's ``module.`` and compile's ``_orig_mod.``."""

from __future__ import annotations

import contextlib
import difflib
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Callable, Optional

import torch
from torch import nn

from ..errors import InvalidInput
from .cleanup import cleaned, on_cleanup, uninterrupted

# Prefixes wrappers add to parameter and module names: DDP / DataParallel, torch.compile.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def unwrap_model(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """The module whose ``named_modules()`` names a report uses: DDP/DataParallel and ``torch.compile`` peeled.

    Returns the module and one note per wrapper peeled.
    """
    if not isinstance(model, nn.Module):
        raise InvalidInput(f"model must be a torch.nn.Module, got {type(model).__name__}")
    notes = []
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            notes.append(f"{type(model).__name__} wrapper: its .module was diagnosed on this process alone")
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and isinstance(getattr(model, "_orig_mod", None), nn.Module):
            notes.append("torch.compile'd model: diagnosed eagerly through its original module")
            original = model._orig_mod
            assert isinstance(original, nn.Module)
            model = original
        else:
            return model, notes


def strip_wrapper_prefixes(key: str, known: Iterable[str] = ()) -> str:
    """A saved key without the prefixes wrappers add; a key the model knows as it is (a model may own a
    submodule really called ``module``) is kept."""
    known = known if isinstance(known, (set, frozenset, dict)) else set(known)
    while key not in known and key.startswith(WRAPPER_PREFIXES):
        key = key.split(".", 1)[1]
    return key


def find_module(root: nn.Module, name: str) -> nn.Module:
    """The submodule a report names (``""`` is the root), or an error that suggests close names."""
    try:
        found: nn.Module = root.get_submodule(name) if name else root
        return found
    except AttributeError:
        names = [n for n, _ in root.named_modules()]
        close = difflib.get_close_matches(name, names, n=3)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise InvalidInput(f"no module named {name!r} in {type(root).__name__}{hint}") from None


@contextlib.contextmanager
def eager_calls(root: nn.Module) -> Iterator[None]:
    """Every module of ``root`` runs eagerly inside (a capture's hooks must see every call): the compiled calls
    of ``model.compile()`` are set aside and put back, and functions the forward calls through ``torch.compile``
    run eagerly too (:func:`_enter_eager_stance`)."""
    put_back = _set_compiled_calls_aside(root)
    try:
        yield
    finally:
        put_back()


# torch's compiler stance is one for the process: diagnoses in several threads share one "force_eager", set by the
# first to enter and put back (to what it was before) by the last to leave, whatever order they leave in.
_stance_lock = threading.Lock()
_stance_users = 0
_stance_before: Optional[contextlib.AbstractContextManager[object]] = None


def _enter_eager_stance() -> Optional[Callable[[], None]]:
    """``torch.compiler.set_stance("force_eager")`` (torch >= 2.6) while dynamo is loaded (``torch.compile``
    loads it; ampdoctor never does for this): a compiled function inside the forward would otherwise trace
    ampdoctor's own hooks and modes, recompiling up to dynamo's limit on every pass, and hide its ops in a fused
    graph. Returns the (idempotent) leave, or None when there is nothing to set."""
    global _stance_users, _stance_before
    set_stance = getattr(torch.compiler, "set_stance", None) if "torch._dynamo" in sys.modules else None
    if set_stance is None:
        return None
    with _stance_lock:
        if _stance_users == 0:
            _stance_before = set_stance("force_eager")  # set now; leaving it puts back the stance before
        _stance_users += 1
    left = False

    def leave() -> None:
        global _stance_users, _stance_before
        nonlocal left
        with _stance_lock:
            if left:
                return
            left = True
            _stance_users -= 1
            if _stance_users == 0 and _stance_before is not None:
                _stance_before.__exit__(None, None, None)
                _stance_before = None

    return leave


@uninterrupted
def _set_compiled_calls_aside(root: nn.Module) -> Callable[[], None]:
    saved = [(m, m.__dict__["_compiled_call_impl"]) for m in root.modules() if "_compiled_call_impl" in m.__dict__]
    stance: list[Callable[[], None]] = []

    @uninterrupted
    def put_back() -> None:  # idempotent, owned by the cleanup owner before anything is set aside
        for m, call in saved:
            m.__dict__["_compiled_call_impl"] = call
        for leave in stance:
            leave()
        cleaned(put_back)

    on_cleanup(put_back)
    leave = _enter_eager_stance()
    if leave is not None:
        stance.append(leave)
    for m, _ in saved:
        del m.__dict__["_compiled_call_impl"]
    return put_back
