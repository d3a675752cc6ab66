"""A pass's module calls seen through an instance ``forward`` instead of forward hooks, where that is the same thing.

``Module._call_impl`` calls ``self.forward`` straight away when a module has no hooks and there are no global ones;
one forward hook sends every call through its slow path (the hook dicts walked, an ``inner()`` closure, argument
tuples), which was most of the survey's cost on models of many small modules (the do-nothing step of a 10,000-module
model: 2.2-2.5 plain steps with a pre- and a post-hook per module, 1.4-1.8 with a wrapper). So a module that has no
hooks of its own, no instance ``forward`` or ``__getstate__`` and the standard call path gets, for the pass:

* ``module.__dict__["forward"]``: the pass's wrapper for its class, bound to it (one method object per module, one
  function per class), which runs the pre-hook, the class's ``forward`` and the post-hook as torch would run them.
  ``inspect.signature(module.forward)`` still reads the class's ``forward`` (``__wrapped__``).
* ``module.__dict__["__getstate__"]``: the module's state without either attribute, so a copy or pickle made
  during the pass (``copy.deepcopy`` of a layer inside a forward) runs its own forward, unwrapped.

Every other module keeps forward hooks: the user's hooks (or FSDP's) then run in the same order as before around
ours, and backward hooks see the arguments they always saw. A model with an ``nn.DataParallel`` or a compiled part
inside, or global module hooks, gets hooks everywhere. :meth:`PassForwards.remove` takes out exactly what it put in
(idempotent), leaving a ``forward`` someone set over ours meanwhile.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn.modules import module as _module_globals

_FORWARD = "forward"
_GETSTATE = "__getstate__"
_MODULE_CALL = nn.Module.__call__
_CALL_IMPL = nn.Module._call_impl
# The attribute of a pass's wrapper function that names its PassForwards.
_OWNER = "_ampdoctor_pass_forwards"

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
                            lambda m, args, kwargs, out: seen.append(f"post{out is args[0]}"))
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


def _plain_state(module: nn.Module) -> Any:
    """``module.__getstate__()`` while a pass wraps it: its state as it would be without the pass."""
    state = type(module).__getstate__(module)
    d = state[0] if isinstance(state, tuple) and state and isinstance(state[0], dict) else state
    if not isinstance(d, dict):
        return state
    d = {k: v for k, v in d.items() if not (k in (_FORWARD, _GETSTATE) and _is_ours(v))}
    return (d, *state[1:]) if isinstance(state, tuple) else d


def _is_ours(value: Any) -> bool:
    func = getattr(value, "__func__", None) if type(value) is types.MethodType else None
    return func is _plain_state or getattr(func, _OWNER, None) is not None


class PassForwards:
    """The instance ``forward`` wrappers of one pass: ``pre(module, args, kwargs)`` before the module's ``forward``,
    ``post(module, args, kwargs, output)`` after it returned (not when it raised: as forward hooks)."""

    def __init__(self, pre: Hook, post: Hook) -> None:
        self.pre, self.post = pre, post
        self.modules: list[nn.Module] = []
        self._by_class: dict[type, Callable[..., Any]] = {}

    @staticmethod
    def fits(module: nn.Module) -> bool:
        """Whether a wrapper sees exactly what a pre- and a post-hook would on this module (the caller also keeps
        hooks on a class with its own hook registration: it is asked, as before)."""
        d = module.__dict__
        if (d.get("_forward_hooks") or d.get("_forward_pre_hooks") or d.get("_backward_hooks")
                or d.get("_backward_pre_hooks") or _FORWARD in d or _GETSTATE in d or "_call_impl" in d):
            return False
        cls = type(module)
        return cls.__call__ is _MODULE_CALL and cls._call_impl is _CALL_IMPL and not isinstance(
            module, torch.jit.ScriptModule)

    def wrap(self, module: nn.Module) -> None:
        """Put the wrapper on ``module`` (the caller checked :meth:`fits`; inside an uninterrupted install)."""
        cls = type(module)
        wrapper = self._by_class.get(cls)
        if wrapper is None:
            wrapper = self._by_class[cls] = self._wrapper(cls.forward)
        self.modules.append(module)  # first: an interrupted install is still undone by remove()
        d = module.__dict__
        d[_FORWARD] = types.MethodType(wrapper, module)
        d[_GETSTATE] = types.MethodType(_plain_state, module)

    def _wrapper(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        pre, post = self.pre, self.post

        def forward_seen_by_the_pass(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            pre(module, args, kwargs)
            output = forward(module, *args, **kwargs)
            post(module, args, kwargs, output)
            return output

        forward_seen_by_the_pass.__wrapped__ = forward  # type: ignore[attr-defined]
        setattr(forward_seen_by_the_pass, _OWNER, True)  # a mark, not the owner: no cycle
        return forward_seen_by_the_pass

    def remove(self) -> None:
        """Idempotent: each module's two attributes go, unless someone set their own over ours meanwhile."""
        owned = set(map(id, self._by_class.values()))
        for module in self.modules:
            d = module.__dict__
            forward: Optional[Any] = d.get(_FORWARD)
            if type(forward) is types.MethodType and id(forward.__func__) in owned:
                del d[_FORWARD]
            getstate = d.get(_GETSTATE)
            if type(getstate) is types.MethodType and getstate.__func__ is _plain_state:
                del d[_GETSTATE]
        self.modules.clear()
