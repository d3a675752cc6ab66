"""A pass's module calls seen through an instance ``forward`` instead of forward hooks, where that is the same thing.

``Module._call_impl`` calls ``self.forward`` straight away when a module has no hooks and there are no global ones;
one forward hook sends every call through its slow path (the hook dicts walked, an ``inner()`` closure, argument
tuples), which was most of the survey's cost on models of many small modules (the do-nothing step of a 10,000-module
model: 2.2-2.5 plain steps with a pre- and a post-hook per module, 1.4-1.8 with a wrapper). So a module that has no
hooks of its own, no instance ``forward`` or ``__getstate__``, the standard call path and attribute lookup, and
a plain function as its class's ``forward`` gets, for the pass:

* ``module.__dict__["forward"]``: the pass's wrapper for its class, bound to it (one method object per module, one
  function per class), which runs the pre-hook, the class's ``forward`` and the post-hook as torch would run them.
  ``inspect.signature(module.forward)`` still reads the class's ``forward`` (``__wrapped__``).
* ``module.__dict__["__getstate__"]``: the module's state without either attribute, so a copy or pickle made
  during the pass (``copy.deepcopy`` of a layer inside a forward) runs its own forward, unwrapped; and
  ``module.__dict__["__deepcopy__"]``, which makes a deep copy with the pass's attributes taken out (a class's own
  ``__deepcopy__``, ``torch.nn.utils.parametrize``'s, copies ``__dict__`` as it is).

A bound wrapper that the model's own code keeps (``self._impl = self.child.forward`` on the first call) outlives
the pass: once the pass is over it records nothing and holds nothing of it, and calls the forward of a later
pass's wrapper on the same module where there is one (so that pass sees the call), else the class's ``forward``.

Every other module keeps forward hooks: the user's hooks (or FSDP's) then run in the same order as before around
ours, and backward hooks see the arguments they always saw. So does a module whose ``self.forward`` is not the
class's plain function bound (a ``staticmethod``, ``classmethod``, ``property`` or ``singledispatchmethod``
forward: the wrapper would call it otherwise than torch does, or be bypassed), and one whose class copies itself
by a ``__copy__``, ``__reduce__`` or ``__reduce_ex__`` of its own (a copy that bypasses ``__getstate__`` would share
the wrapper). A model with an ``nn.DataParallel`` or a compiled part inside, or global module hooks, gets hooks
everywhere. :meth:`PassForwards.remove` takes out exactly what it put in (idempotent), leaving a ``forward``
someone set over ours meanwhile.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import types
import weakref
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn.modules import module as _module_globals

_FORWARD = "forward"
_GETSTATE = "__getstate__"
_DEEPCOPY = "__deepcopy__"
_ATTRIBUTES = (_FORWARD, _GETSTATE, _DEEPCOPY)
_MODULE_CALL = nn.Module.__call__
_CALL_IMPL = nn.Module._call_impl
# The attribute of a pass's wrapper function that marks it as one: the pass's list of live hooks (empty once the
# pass removed its wrappers).
_OWNER = "_ampdoctor_pass_forwards"
# How a class copies itself when it does not define these: through ``__getstate__``, which an instance can override.
_COPY_DEFAULTS = {"__copy__": None, "__reduce__": object.__reduce__, "__reduce_ex__": object.__reduce_ex__}

Hook = Callable[..., Any]


_works: Optional[bool] = None  # wrappers_work(), once per process


def wrappers_work() -> bool:
    """Whether torch calls an instance ``forward`` wrapper as this module expects (checked once per process on a
    module of our own): a torch whose call path looked ``forward`` up elsewhere would run the module unseen (a call
    never recorded reads as nothing wrong), so where this check fails every module gets hooks."""
    global _works
    if _works is None:
        try:
            _works = _check_wrappers()
        except Exception:
            _works = False
    return _works


def _check_wrappers() -> bool:
    seen: list[str] = []
    module = nn.Identity()
    forwards = PassForwards(lambda m, args, kwargs: seen.append("pre"),
                            lambda m, args, kwargs, out: seen.append(f"post{out is args[0]}"),
                            lambda m, args, kwargs: seen.append("raised"))
    try:
        forwards.wrap(module)
        x = torch.zeros(1)
        returned = module(x)
    finally:
        forwards.remove()
    return seen == ["pre", "postTrue"] and returned is x and "forward" not in module.__dict__


def wrappers_fit(modules: list[nn.Module]) -> bool:
    """Instance ``forward`` wrappers behave as hooks on these modules: no global module hooks (a wrapper would run
    inside them, not after), no ``nn.DataParallel`` (its replicas copy a module's ``__dict__``: they would call the
    original module's forward) and no compiled part (dynamo would trace the wrapper)."""
    if (_module_globals._global_forward_hooks or _module_globals._global_forward_pre_hooks
            or _module_globals._global_backward_hooks or _module_globals._global_backward_pre_hooks):
        return False
    if not (_works or wrappers_work()):
        return False
    for module in modules:
        if isinstance(module, nn.DataParallel) or type(module).__name__ == "OptimizedModule":
            return False
        if module.__dict__.get("_compiled_call_impl") is not None:
            return False
    return True


def class_forward(cls: type) -> Optional[types.FunctionType]:
    """The plain function that ``self.forward`` of a ``cls`` instance without a ``forward`` of its own binds, where
    an instance ``forward`` would take its place and the function can be called as ``forward(module, *args)``:
    else None (a ``staticmethod``, ``classmethod``, ``property``, ``singledispatchmethod`` or other object as the
    class's ``forward``, or an attribute lookup of the class's own)."""
    if cls.__getattribute__ is not nn.Module.__getattribute__:
        return None
    forward = inspect.getattr_static(cls, _FORWARD, None)
    return forward if isinstance(forward, types.FunctionType) else None


def copies_through_getstate(cls: type) -> bool:
    """``copy.copy``, ``pickle`` and the default ``copy.deepcopy`` of a ``cls`` instance read its state through
    ``__getstate__`` (which an instance attribute overrides): the class does not copy itself its own way (a
    ``__deepcopy__`` of its own is fine: an instance ``__deepcopy__`` overrides it)."""
    return all(getattr(cls, name, None) is default for name, default in _COPY_DEFAULTS.items())


_WRAPPABLE: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def wrappable_class(cls: type) -> bool:
    """An instance ``forward`` wrapper on a ``cls`` module is called where torch calls ``self.forward`` and can call
    the class's ``forward`` as ``forward(module, ...)`` (:func:`class_forward`), and a copy of the module can be
    made without it (:func:`copies_through_getstate`). Asked once per class (a watch asks at every sampled step)."""
    fit = _WRAPPABLE.get(cls)
    if fit is None:
        fit = _WRAPPABLE[cls] = class_forward(cls) is not None and copies_through_getstate(cls)
    return fit


@contextlib.contextmanager
def swapped(d: dict[str, Any], clean: dict[str, Any]) -> Iterator[None]:
    """``d`` (a module's ``__dict__``) holds ``clean``'s entries instead of its own while the block runs (a class's
    ``__deepcopy__`` copying it as it is); only the entries that differ are touched, and they are put back."""
    changed = [k for k in d if k not in clean or clean[k] is not d[k]] + [k for k in clean if k not in d]
    saved = {k: d[k] for k in changed if k in d}
    try:
        for k in changed:
            if k in clean:
                d[k] = clean[k]
            else:
                del d[k]
        yield
    finally:
        for k in changed:
            if k in saved:
                d[k] = saved[k]
            else:
                d.pop(k, None)


def _plain_state(module: nn.Module) -> Any:
    """``module.__getstate__()`` while a pass wraps it: its state as it would be without the pass."""
    state = type(module).__getstate__(module)
    d = state[0] if isinstance(state, tuple) and state and isinstance(state[0], dict) else state
    if not isinstance(d, dict):
        return state
    d = _without_ours(d)
    return (d, *state[1:]) if isinstance(state, tuple) else d


def _plain_deepcopy(module: nn.Module, memo: dict[int, Any]) -> Any:
    """``copy.deepcopy(module)`` while a pass wraps it: made with the pass's attributes out of the module's
    ``__dict__`` (no ``__deepcopy__`` of ours in there: copy.deepcopy does as without one, by the class's own
    ``__deepcopy__`` where the class has one by then, parametrize's copying ``__dict__`` as it is)."""
    with swapped(module.__dict__, _without_ours(module.__dict__)):
        return copy.deepcopy(module, memo)


def _without_ours(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if not (k in _ATTRIBUTES and _is_ours(v))}


def _is_ours(value: Any) -> bool:
    func = getattr(value, "__func__", None) if type(value) is types.MethodType else None
    return func is _plain_state or func is _plain_deepcopy or _live_of(func) is not None


def _live_of(func: Any) -> Optional[list[Hook]]:
    """The live list of a pass's wrapper function; None for anything else (functools.update_wrapper copies the
    wrapper's mark onto another callable: only the wrapper's own code counts)."""
    if type(func) is types.FunctionType and func.__code__ is _WRAPPER_CODE:
        return getattr(func, _OWNER, None)  # type: ignore[no-any-return]
    return None


class PassForwards:
    """The instance ``forward`` wrappers of one pass: ``pre(module, args, kwargs)`` before the module's ``forward``,
    ``post(module, args, kwargs, output)`` after it returned, ``raised(module, args, kwargs)`` when it raised (a
    call the model's own code may catch: a fallback), as forward hooks with ``always_call`` would."""

    def __init__(self, pre: Hook, post: Hook, raised: Hook) -> None:
        self._live: list[Hook] = [pre, post, raised]  # emptied by remove(): every wrapper of the pass is spent then
        self.modules: list[nn.Module] = []
        # Per class: its wrapper, or None where a wrapper does not fit the class (fits() asks once per class).
        self._by_class: dict[type, Optional[Callable[..., Any]]] = {}

    def fits(self, module: nn.Module) -> bool:
        """Whether a wrapper sees exactly what a pre- and a post-hook would on this module (the caller also keeps
        hooks on a class with its own hook registration: it is asked, as before)."""
        d = module.__dict__
        if (d.get("_forward_hooks") or d.get("_forward_pre_hooks") or d.get("_backward_hooks")
                or d.get("_backward_pre_hooks") or _FORWARD in d or _GETSTATE in d or _DEEPCOPY in d
                or "_call_impl" in d):
            return False
        return self._class_wrapper(type(module)) is not None

    def _class_wrapper(self, cls: type) -> Optional[Callable[..., Any]]:
        """The wrapper of ``cls``'s modules, made once per class; None where a wrapper does not fit the class."""
        if cls not in self._by_class:
            forward = class_forward(cls) if wrappable_class(cls) else None
            fit = (forward is not None and cls.__call__ is _MODULE_CALL and not issubclass(cls, torch.jit.ScriptModule)
                   and cls._call_impl is _CALL_IMPL)  # type: ignore[attr-defined]
            self._by_class[cls] = self._wrapper(forward) if fit and forward is not None else None
        return self._by_class[cls]

    def wrap(self, module: nn.Module) -> None:
        """Put the wrapper on ``module`` (the caller checked :meth:`fits`; inside an uninterrupted install)."""
        cls = type(module)
        wrapper = self._class_wrapper(cls)
        if wrapper is None:
            raise ValueError(f"a {cls.__name__} module cannot take a pass's forward wrapper (PassForwards.fits)")
        self.modules.append(module)  # first: an interrupted install is still undone by remove()
        d = module.__dict__
        d[_FORWARD] = types.MethodType(wrapper, module)  # type: ignore[arg-type]
        d[_GETSTATE] = types.MethodType(_plain_state, module)
        d[_DEEPCOPY] = types.MethodType(_plain_deepcopy, module)  # (a class can change mid-pass: parametrize)

    def _wrapper(self, forward: types.FunctionType) -> Callable[..., Any]:
        live = self._live

        def forward_seen_by_the_pass(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if not live:
                return _spent(module, forward, live, args, kwargs)
            pre, post, raised = live
            pre(module, args, kwargs)
            try:
                output = forward(module, *args, **kwargs)
            except BaseException:
                raised(module, args, kwargs)
                raise
            post(module, args, kwargs, output)
            return output

        forward_seen_by_the_pass.__wrapped__ = forward  # type: ignore[attr-defined]
        # A kept bound wrapper pickles as getattr(module, __name__): the module's own forward when loaded.
        forward_seen_by_the_pass.__name__ = _FORWARD
        # The mark is the live list, not the owner: no cycle through PassForwards (and a spent list holds nothing).
        setattr(forward_seen_by_the_pass, _OWNER, live)
        return forward_seen_by_the_pass

    def remove(self) -> None:
        """Idempotent: the pass's wrappers are spent (:func:`_spent`) and each module's attributes go, unless
        someone set their own over ours meanwhile."""
        live = self._live
        live.clear()
        for module in self.modules:
            d = module.__dict__
            forward = d.get(_FORWARD)
            if type(forward) is types.MethodType and _live_of(forward.__func__) is live:
                del d[_FORWARD]
            for name in (_GETSTATE, _DEEPCOPY):
                if _is_ours(d.get(name)):
                    del d[name]
        self.modules.clear()


def _spent(
    module: nn.Module, forward: types.FunctionType, live: list[Hook], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A call of a wrapper whose pass is over (the model kept it): the live wrapper of another pass on the same
    module where there is one, so that pass sees the call; else the class's ``forward``, as without any pass."""
    current = module.__dict__.get(_FORWARD)
    if type(current) is types.MethodType and current.__self__ is module:
        mark = _live_of(current.__func__)
        if mark and mark is not live:
            return current(*args, **kwargs)
    return forward(module, *args, **kwargs)


# The code of every pass's wrapper (what tells a wrapper from a callable that copied its attributes).
_WRAPPER_CODE = PassForwards(_spent, _spent, _spent)._wrapper(_spent).__code__  # type: ignore[arg-type]  # (read only)
