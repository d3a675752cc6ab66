"""Gradient hooks on tensors: the one way capture hangs them (``register_grad_hook``: on a view's base when there is
one) and the cheap way for plain tensors (``hang_tensor_hook``: torch's own hook dict, no handle object)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["drop_empty_hook_dict", "drop_forward_hooks", "hang_tensor_hook", "hook_dicts_work", "register_grad_hook",
           "reserve_forward_ids", "set_forward_hooks"]

_works: Optional[bool] = None


def hook_dicts_work() -> bool:
    """Whether hooks set straight into torch's own hook dicts fire (checked once per process, on tensors and a
    module of our own). The fast registrations copy what torch 2.13's ``register_hook`` and
    ``register_forward_(pre_)hook`` do with private dicts; a torch that keeps hooks elsewhere would silently skip
    them (a gradient never recorded reads as nothing wrong), so where this check fails every hook goes through the
    public registration instead."""
    global _works
    if _works is None:
        try:
            _works = _check_hook_dicts()
        except Exception:  # any change in those internals: the public API
            _works = False
    return _works


def _check_hook_dicts() -> bool:
    fired: list[str] = []
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch(), torch.autocast("cpu", enabled=False), \
            torch.enable_grad():
        leaf = torch.ones(2, requires_grad=True)
        mid = leaf * 3.0
        def seen(tag: str) -> Callable[[torch.Tensor], None]:
            return lambda g: fired.append(f"{tag}{float(g[0]):g}")

        entries = [_hang(leaf, seen("leaf")), _hang(mid, seen("mid"))]
        module = nn.Identity()
        ids = reserve_forward_ids()
        set_forward_hooks(module, ids, lambda m, args, kwargs: fired.append("pre"),
                          lambda m, args, kwargs, out: fired.append("post"))
        torch.autograd.grad((module(mid) * 2.0).sum(), leaf)
        for hooks, hook_id in entries:
            hooks.pop(hook_id, None)
    return sorted(fired) == ["leaf6", "mid2", "post", "pre"]


def reserve_forward_ids() -> tuple[int, int]:
    """Two hook ids from torch's own counter (a pre-hook's and a hook's), for :func:`set_forward_hooks`."""
    return RemovableHandle(OrderedDict()).id, RemovableHandle(OrderedDict()).id


def set_forward_hooks(
    module: nn.Module, ids: tuple[int, int], pre: Callable[..., Any], post: Callable[..., Any]
) -> None:
    """What ``register_forward_pre_hook(pre, with_kwargs=True)`` and ``register_forward_hook(post,
    with_kwargs=True, always_call=True)`` do, under ``ids``, without a handle object per module;
    :func:`drop_forward_hooks` undoes it."""
    pre_id, post_id = ids
    module._forward_pre_hooks[pre_id] = pre
    module._forward_pre_hooks_with_kwargs[pre_id] = True
    module._forward_hooks[post_id] = post
    module._forward_hooks_with_kwargs[post_id] = True
    module._forward_hooks_always_called[post_id] = True


def register_post_hook(module: nn.Module, post: Callable[..., Any]) -> Any:
    """``module.register_forward_hook(post, with_kwargs=True, always_call=True)`` (called when the forward raises
    too); a class's own registration that takes no ``always_call`` gets the hook without it."""
    try:
        return module.register_forward_hook(post, with_kwargs=True, always_call=True)
    except TypeError:  # (raised binding the arguments: nothing registered)
        return module.register_forward_hook(post, with_kwargs=True)


def drop_forward_hooks(module: nn.Module, ids: tuple[int, int]) -> None:
    """Take out what :func:`set_forward_hooks` put in (idempotent)."""
    pre_id, post_id = ids
    module._forward_pre_hooks.pop(pre_id, None)
    module._forward_pre_hooks_with_kwargs.pop(pre_id, None)
    module._forward_hooks.pop(post_id, None)
    module._forward_hooks_with_kwargs.pop(post_id, None)
    module._forward_hooks_always_called.pop(post_id, None)


def hang_tensor_hook(t: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> Optional[tuple[Any, int]]:
    """What ``t.register_hook(hook)`` does, for a plain tensor or parameter that requires grad, without its cost
    (a handle object, an import and checks: about 20 us against 3 on this CPU, paid for every module output and
    every parameter of a pass): the same dict torch keeps the tensor's hooks in, under an id reserved from torch's
    own counter. Returns (that dict, the id) to take the hook out again with ``pop``; None for any other tensor
    (a subclass: ask ``register_hook``)."""
    kind = type(t)
    if kind is not torch.Tensor and kind is not nn.Parameter or torch.Tensor.register_hook is not _REGISTER_HOOK:
        return None  # (a register_hook someone wrapped is honoured: it is asked)
    if not (_works or hook_dicts_work()):
        return None
    return _hang(t, hook)


def _hang(t: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> tuple[Any, int]:
    hooks = t._backward_hooks
    if hooks is None:
        hooks = t._backward_hooks = OrderedDict()
        grad_fn = t.grad_fn
        if grad_fn is not None:
            grad_fn._register_hook_dict(t)
    hook_id = RemovableHandle.next_id
    RemovableHandle.next_id = hook_id + 1
    hooks[hook_id] = hook
    return hooks, hook_id


def register_grad_hook(t: torch.Tensor, receive: Callable[[torch.Tensor], None]) -> tuple[Any, bool]:
    """Hang a gradient hook on ``t`` that calls ``receive(gradient of t)``; returns (handle, hung on the base).

    A hook on a view never fires once a later op modifies the view in place (``ReLU(inplace=True)`` after a
    ``Linear`` on 3-D input); one on the view's base does, with the base's gradient, which is mapped back onto
    the view when the view covers only part of the base. The closure holds plain values only: it lives on the
    autograd graph and must not keep activations alive. ``receive`` must return None (a hook's return value
    replaces the gradient).
    """
    base = t._base
    if base is None or not base.requires_grad:
        return _registered(t, receive), False
    target, view = base, None
    if base.numel() != t.numel():
        view = (tuple(t.size()), tuple(t.stride()), t.storage_offset() - base.storage_offset())
    target_shape = target.shape

    def hook(grad: torch.Tensor) -> None:
        g = grad
        if view is not None and grad.is_contiguous() and grad.shape == target_shape:
            g = grad.as_strided(view[0], view[1], grad.storage_offset() + view[2])
        receive(g)

    return _registered(target, hook), True


def drop_empty_hook_dict(t: torch.Tensor) -> None:
    """A leaf's hook dict left empty goes (``_backward_hooks`` None again, as before a hook was hung on it): torch
    keeps the dict when its last hook is removed, and with it a pre-hook that calls into Python for the tensor
    in every later backward (about 6 us a parameter on this CPU: a training step of a model of many small layers
    would pay it for good after one diagnosis). Only where a pass found no dict (a dict of anyone's stays)."""
    hooks = t._backward_hooks
    if hooks is not None and not hooks:
        t._backward_hooks = None


class _LeafHandle:
    """The handle of a hook that ``register_hook`` hung on a leaf without a hook dict: removing it also takes the
    dict away when it is left empty (:func:`drop_empty_hook_dict`)."""

    __slots__ = ("handle", "tensor")

    def __init__(self, handle: RemovableHandle, tensor: torch.Tensor) -> None:
        self.handle, self.tensor = handle, tensor

    def remove(self) -> None:
        self.handle.remove()
        drop_empty_hook_dict(self.tensor)


def _registered(t: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> Any:
    """``t.register_hook(hook)``'s handle; on a leaf without a hook dict, one that also takes the dict away."""
    bare = t.grad_fn is None and t._backward_hooks is None
    handle = t.register_hook(hook)
    return _LeafHandle(handle, t) if bare else handle


_REGISTER_HOOK = torch.Tensor.register_hook
