"""A module's outputs measured without a forward hook: an instance-level ``forward`` wrapper, so torch keeps its fast
path.

``Module._call_impl`` calls ``self.forward`` straight away only when the module has no hooks at all (and there are
no global ones); a single forward hook sends every call through its slow path (the hook dicts walked, an
``inner()`` closure, argument tuples) before the hook's own work even starts, which alone cost 8-13 % of a training
step on a deep narrow MLP. So in eager mode a measured module gets ``module.__dict__["forward"]``: a small closure
that calls the forward the module had (the class's, or the module's own instance attribute) and hands its output
to the watch. Every promise of a hook holds:

* **Restored exactly.** :meth:`ForwardTap.remove` deletes the instance attribute when the module had none, puts
  the module's own one back when it had one, and leaves alone a ``forward`` someone set over ours meanwhile (ours,
  inside it, then measures nothing once the watch is closed). Two watches' wrappers stack and leave in any order.
* **Nothing leaks into a copy.** While a tap is on, the module also gets an instance ``__getstate__`` (which
  ``copy.deepcopy``, ``copy.copy`` and ``pickle`` look up on the instance) that returns the module's own state
  without the tap's attributes, and without the watch's forward hooks (:class:`HookTap`: the root's, and those
  where a wrapper cannot go): a deep copy made while watched (EMA weights, a fixer's trial copy, ``torch.save`` of
  the whole model) runs its own forward, unwatched, and pickles. ``state_dict`` never saw them. An instance
  ``__deepcopy__`` makes the copy from the module as it is without the installs, whatever its class is by then
  (``torch.nn.utils.parametrize``'s classes copy ``__dict__`` as it is, and parametrizing a module changes its
  class), and a class that reduces itself its own way (``torch.fx``'s ``GraphModule`` pickles a copy of
  ``__dict__``) gets an instance ``__reduce_ex__`` that does the same. A wrapper the model's code keeps
  (``self.impl = self.child.forward``) is the forward it wraps to a copy and to pickle. A module whose
  ``self.forward`` is not the class's plain function (a ``property`` would bypass the wrapper), or whose class has
  its own ``__copy__`` or ``__reduce__``, is measured by a forward hook. Not covered: a class ``__copy__`` that
  copies ``__dict__`` as it is (the shallow copy shares the installs, which cannot tell which module they are read
  from).
* **The user's hooks** still run, in their order: a module that has forward hooks (the user's, FSDP2's), or runs
  under global ones, is measured by a forward hook registered after them (it sees the output they hand on, as
  before). Pre-hooks run before ``forward`` either way.
* **Where a wrapper cannot go**, hooks stay: a compiled model (its own hooks, :mod:`.compiled`), a model with a
  ``torch.compile``'d part inside, and ``nn.DataParallel`` (its replicas copy the module's ``__dict__``: they would
  call the original module's forward).
"""

from __future__ import annotations

import copy
import operator
from collections import OrderedDict
from typing import Any, Callable, Optional, Union

from torch import nn
from torch.nn.modules import module as _module_mod
from torch.utils.hooks import RemovableHandle

from ..capture.call_wrappers import swapped

# The instance attributes a tap sets (and takes away).
_FORWARD = "forward"
_GETSTATE = "__getstate__"
_DEEPCOPY = "__deepcopy__"
_REDUCE = "__reduce_ex__"  # only on a class that reduces itself its own way (torch.fx's GraphModule)
_ATTRIBUTES = (_FORWARD, _GETSTATE, _DEEPCOPY, _REDUCE)
# A module's forward hook dicts (a copy keeps none of an install's hook ids).
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks_with_kwargs")
# The attribute of a tap's functions that leads back to the tap (a second watch's tap finds the first one by it);
# only the very object the tap set counts (functools.update_wrapper copies a function's attributes to another).
_TAP_ATTRIBUTE = "_ampdoctor_forward_tap"


def _install_of(value: Any, name: str) -> Optional[_Install]:
    """The install that set ``value`` as a module's attribute ``name``, if one did."""
    install = getattr(value, _TAP_ATTRIBUTE, None)
    return install if isinstance(install, _Install) and install._ours(name) is value else None


def wrappers_fit(model: nn.Module, root: nn.Module) -> bool:
    """Instance ``forward`` wrappers are safe on ``root``'s modules: no ``nn.DataParallel`` around or inside, no
    ``torch.compile``'d module anywhere (the caller already sent a compiled root to :mod:`.compiled`)."""
    for m in (*model.modules(), *root.modules()):
        if isinstance(m, nn.DataParallel) or type(m).__name__ == "OptimizedModule":
            return False
        if m.__dict__.get("_compiled_call_impl") is not None:
            return False
    return True


def has_forward_hooks(module: nn.Module) -> bool:
    """Forward hooks that run after ``forward`` (the module's own, or global ones): a wrapper would measure the
    output before they change it, so such a module keeps a hook."""
    return bool(module._forward_hooks or _module_mod._global_forward_hooks)


class _Install:
    """What one watch put on one module (a forward wrapper, or hooks), with the instance ``__getstate__`` that keeps
    it out of a copy. ``remove()`` puts back what the module had; it is idempotent. Installs of several watches
    stack and leave in any order; the last one out restores what the module had."""

    def __init__(self, module: nn.Module) -> None:
        d = module.__dict__
        self.module = module
        self.had = {name: (name in d, d.get(name)) for name in _ATTRIBUTES}  # what the module had, per attribute
        self.dead = False
        self.wrapper: Optional[Callable[..., Any]] = None
        self.handles: list[RemovableHandle] = []

        def __getstate__() -> Any:
            had, own = self._beneath(_GETSTATE, every=True)
            return self._clean(own() if had else type(module).__getstate__(module))  # type: ignore[misc]

        setattr(__getstate__, _TAP_ATTRIBUTE, self)
        self.guard = __getstate__

        def __deepcopy__(memo: dict[int, Any]) -> Any:
            # whatever the module's class is by then (parametrize's deepcopy copies __dict__ as it is, past
            # __getstate__; parametrizing a module changes its class); no __deepcopy__ of ours in the clean
            # module: copy.deepcopy does as without one
            return self._as_without_installs(_DEEPCOPY, memo, lambda: copy.deepcopy(module, memo))

        setattr(__deepcopy__, _TAP_ATTRIBUTE, self)
        self.copier = __deepcopy__
        self.reducer: Optional[Callable[..., Any]] = None
        cls = type(module)
        if _REDUCE in d or cls.__reduce_ex__ is not object.__reduce_ex__ or cls.__reduce__ is not object.__reduce__:

            def __reduce_ex__(protocol: Any) -> Any:
                # pickle (and a copy) of a class that reduces itself past __getstate__ (GraphModule pickles a copy
                # of __dict__)
                reduce = type(module).__reduce_ex__
                return self._as_without_installs(_REDUCE, protocol, lambda: reduce(module, protocol))

            setattr(__reduce_ex__, _TAP_ATTRIBUTE, self)
            self.reducer = __reduce_ex__
            d[_REDUCE] = __reduce_ex__
        d[_GETSTATE] = __getstate__
        d[_DEEPCOPY] = __deepcopy__

    def _as_without_installs(self, name: str, arg: Any, default: Callable[[], Any]) -> Any:
        """The module's own ``name`` (what it had beneath every install) called with ``arg``, else ``default()``,
        on the module as it would be without any install (its ``__dict__`` swapped clean meanwhile)."""
        had, own = self._beneath(name, every=True)
        d = self.module.__dict__
        with swapped(d, self._clean(d)):
            return own(arg) if had else default()

    def _ours(self, name: str) -> Optional[Callable[..., Any]]:
        if name == _FORWARD:
            return self.wrapper
        return self.guard if name == _GETSTATE else self.copier if name == _DEEPCOPY else self.reducer

    def _beneath(self, name: str, every: bool) -> tuple[bool, Any]:
        """What the module had under this install's attribute ``name``, past the installs beneath it that left
        already (``every``: past all of them, for a copy)."""
        had, own = self.had[name]
        while had:
            below = _install_of(own, name)
            if below is None or not (every or below.dead):
                break
            had, own = below.had[name]
        return had, own

    def _stack(self) -> list[_Install]:
        """This install and every one beneath it (by their guards)."""
        found, at = [], self
        while True:
            found.append(at)
            had, own = at.had[_GETSTATE]
            below = _install_of(own, _GETSTATE) if had else None
            if below is None:
                return found
            at = below

    def _clean(self, state: Any) -> Any:
        """The module's state as it would be without any install (a dict, or ``(dict, slots)``): no wrapper, no
        guard, none of the installs' hooks."""
        d = state[0] if isinstance(state, tuple) and state and isinstance(state[0], dict) else state
        if not isinstance(d, dict):
            return state
        d = dict(d)
        for name in _ATTRIBUTES:
            install = _install_of(d.get(name), name)
            if install is not None:
                had, own = install._beneath(name, every=True)
                if had:
                    d[name] = own
                else:
                    del d[name]
        ids = {handle.id for install in self._stack() for handle in install.handles}
        if ids:
            for name in _HOOK_DICTS:
                hooks = d.get(name)
                if isinstance(hooks, dict) and not ids.isdisjoint(hooks):
                    d[name] = OrderedDict((k, v) for k, v in hooks.items() if k not in ids)
        return (d, *state[1:]) if isinstance(state, tuple) else d

    def remove(self) -> None:
        if self.dead:
            return
        self.dead = True
        for handle in self.handles:
            handle.remove()
        d = self.module.__dict__
        for name in _ATTRIBUTES:
            ours = self._ours(name)
            if ours is None or d.get(name) is not ours:
                continue  # someone set their own over ours since (another watch's install included): theirs stays
            had, own = self._beneath(name, every=False)
            if had:
                d[name] = own
            else:
                del d[name]


class ForwardTap(_Install):
    """``measure(output)`` after every call of ``module``, by an instance ``forward`` wrapper (see the module
    docstring)."""

    def __init__(self, module: nn.Module, measure: Callable[[Any], None]) -> None:
        super().__init__(module)
        # the module's own instance forward, else its class's, bound
        self.wrapper = _Forward(self, module.forward, measure)
        module.__dict__[_FORWARD] = self.wrapper

    def remove(self) -> None:
        super().remove()
        if isinstance(self.wrapper, _Forward):
            self.wrapper.measure = _measure_nothing  # a kept wrapper holds no watch


def _measure_nothing(output: Any) -> None:
    return None


class _Forward:
    """A tap's ``forward``: the module's forward, then ``measure`` of its output while the tap is on. The model's
    code may keep it (``self.impl = self.child.forward``): then it is what it wraps to a copy and to pickle (a
    deep copy of the model holds the copy's own forward, as it would without the watch)."""

    __slots__ = (_TAP_ATTRIBUTE, "inner", "measure", "__wrapped__", "__name__")

    def __init__(self, tap: _Install, inner: Callable[..., Any], measure: Callable[[Any], None]) -> None:
        setattr(self, _TAP_ATTRIBUTE, tap)
        self.inner = inner
        self.measure = measure
        self.__wrapped__ = inner  # inspect.signature sees the module's forward
        self.__name__ = getattr(inner, "__name__", _FORWARD)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        output = self.inner(*args, **kwargs)
        self.measure(output)  # nothing once the tap is removed (ForwardTap.remove)
        return output

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self.inner, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # loaded as the forward it wraps, with nothing of ampdoctor's in the pickle (a standard-library getter)
        return operator.itemgetter(0), ((self.inner,),)


class HookTap(_Install):
    """Forward hooks (``pre`` and/or ``post``, as ``register_forward_(pre_)hook`` takes them) that a copy of the
    module does not inherit."""

    def __init__(
        self, module: nn.Module, pre: Optional[Callable[..., Any]] = None, post: Optional[Callable[..., Any]] = None,
        with_kwargs: bool = False, always_call: bool = False,
    ) -> None:
        super().__init__(module)
        if pre is not None:
            self.handles.append(module.register_forward_pre_hook(pre, with_kwargs=with_kwargs))
        if post is not None:
            self.handles.append(module.register_forward_hook(post, with_kwargs=with_kwargs, always_call=always_call))


Tap = Union[ForwardTap, HookTap]
