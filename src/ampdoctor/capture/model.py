"""Wrapper peeling and module naming: the one place that knows DDP's ``module.`` and compile's ``_orig_mod.``."""

from __future__ import annotations

import contextlib
import difflib
import sys
from collections.abc import Iterable, Iterator
from typing import Callable

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
    run eagerly too (:func:`_eager_stance`)."""
    put_back = _set_compiled_calls_aside(root)
    try:
        with _eager_stance():
            yield
    finally:
        put_back()


def _eager_stance() -> contextlib.AbstractContextManager[object]:
    """``torch.compiler.set_stance("force_eager")`` (torch >= 2.6) while dynamo is loaded (``torch.compile``
    loads it; ampdoctor never does for this): a compiled function inside the forward would otherwise trace
    ampdoctor's own hooks and modes, recompiling up to dynamo's limit on every pass, and hide its ops in a fused
    graph."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        return contextlib.nullcontext()
    stance: contextlib.AbstractContextManager[object] = set_stance("force_eager")
    return stance


@uninterrupted
def _set_compiled_calls_aside(root: nn.Module) -> Callable[[], None]:
    saved = [(m, m.__dict__["_compiled_call_impl"]) for m in root.modules() if "_compiled_call_impl" in m.__dict__]

    @uninterrupted
    def put_back() -> None:  # idempotent, owned by the cleanup owner before anything is set aside
        for m, call in saved:
            m.__dict__["_compiled_call_impl"] = call
        cleaned(put_back)

    on_cleanup(put_back)
    for m, _ in saved:
        del m.__dict__["_compiled_call_impl"]
    return put_back
