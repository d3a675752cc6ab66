"""The watch's per-tensor hot path: no allocation per measured tensor, one host read per step.

* **Slabs**: every (lo, hi) pair of a step is written by ``torch.aminmax(t, out=(lo, hi))`` straight into a row of
  a buffer preallocated per (device, dtype), through 0-d views made once when the buffer grows. The buffers are
  reused step after step, so a step with statistics on every module allocates no tensor per module and the
  read-back is one ``cat`` of a few buffers (not a ``stack`` of hundreds of 0-d tensors). A step's collector
  claims the slabs at its first pair; a step that was never read is simply overwritten.
* **Gradient hooks** on a module output that is not a view and has no hook yet go into the tensor's own hook dict,
  the one ``Tensor.register_hook`` makes (``t._backward_hooks = OrderedDict({OWN_KEY: receive})`` and
  ``grad_fn._register_hook_dict(t)``, both in C: no Python frame, no handle), a tenth of a
  ``register_prehook``'s cost; it is the tensor hook ``register_hook`` would add (the sum over every use, and the
  value as it was when an in-place op changes the tensor later). The step's dicts lose our key when it closes (a
  hook the user added to the same dict meanwhile stays). Other outputs hang on their autograd node
  (``grad_fn.register_prehook``, the same gradient); views (a hook on a view never fires once the view is
  modified in place) and leaves keep :func:`~ampdoctor.capture.hooks.register_grad_hook`.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
from torch.utils.hooks import RemovableHandle

from ..capture.hooks import register_grad_hook

# Rows added to a slab at a time (a slab grows during the first steps, then stays).
CHUNK_ROWS = 256
# The key of the watch's hook in a tensor's own hook dict (RemovableHandle ids count up from 0: never this one).
OWN_KEY = -1


class _Slab:
    """Rows of (lo, hi) in one dtype on one device, with their 0-d views (each row's pair made once, as the
    ``out=`` argument of ``aminmax``)."""

    __slots__ = ("device", "dtype", "chunks", "flats", "rows", "ats")

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.chunks: list[torch.Tensor] = []
        self.flats: list[torch.Tensor] = []  # per chunk: its flat view (lo, hi, lo, hi ...), made once
        self.rows: list[tuple[torch.Tensor, torch.Tensor]] = []  # per row: its (lo, hi) views
        self.ats = array("q")  # per used row: the index its lo takes among the step's numbers (a C array: the
        # read-back makes it an index tensor without a Python loop)

    def grow(self) -> None:
        chunk = torch.empty(CHUNK_ROWS, 2, dtype=self.dtype, device=self.device)
        self.chunks.append(chunk)
        self.flats.append(chunk.view(-1))
        self.rows += [row.unbind(0) for row in chunk.unbind(0)]  # type: ignore[misc]

    def block(self) -> torch.Tensor:
        """The used rows, flat: lo, hi, lo, hi ... (one slice of a flat view made once; a cat past one chunk)."""
        rows = len(self.ats)
        full, rest = divmod(rows, CHUNK_ROWS)
        parts = self.flats[:full] + ([self.flats[full][: 2 * rest]] if rest else [])
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class Slabs:
    """One watch's slabs, reused by the collector of every step (see the module docstring). ``last`` is the slab
    of the last pair (models mostly run in one dtype on one device: the hot path finds it without a lookup)."""

    __slots__ = ("_by_key", "owner", "last")

    def __init__(self) -> None:
        self._by_key: dict[tuple[torch.device, torch.dtype], _Slab] = {}
        self.owner: Optional[object] = None
        self.last = _Slab(torch.device("meta"), torch.float64)  # matches no measured tensor: the first finds its own

    def find(self, owner: object, t: torch.Tensor) -> _Slab:
        """The slab of ``t``'s device and dtype, claimed for ``owner`` (a new step's first pair: the previous
        step's rows were read, or are dropped)."""
        if owner is not self.owner:
            self.owner = owner
            for each in self._by_key.values():
                del each.ats[:]
        key = (t.device, t.dtype)
        slab = self._by_key.get(key)
        if slab is None:
            slab = self._by_key[key] = _Slab(*key)
        self.last = slab
        return slab

    def blocks(self, owner: object) -> list[tuple[torch.Tensor, array[int]]]:
        """The owner's rows: per slab in use, its flat values and the index of each row's lo."""
        if owner is not self.owner:
            return []
        return [(slab.block(), slab.ats) for slab in self._by_key.values() if slab.ats]


def hang_grad_hook(
    t: torch.Tensor, receive: Callable[[torch.Tensor], None],
    first: Optional[Callable[[tuple[Optional[torch.Tensor], ...]], None]] = None,
) -> Any:
    """A gradient hook on ``t`` that calls ``receive(gradient of t)``; returns its handle. On the autograd node
    that made ``t`` when ``t`` is no view (cheap), else as :func:`~ampdoctor.capture.hooks.register_grad_hook`.
    ``first``: a node pre-hook like ``NodeHook(receive, 0)``, made once by the caller (a node's first output is
    the common case: no object per call)."""
    node = t.grad_fn
    if node is None or t._base is not None:
        return register_grad_hook(t, receive)[0]
    nr = t.output_nr
    return node.register_prehook(first if nr == 0 and first is not None else NodeHook(receive, nr))


class NodeHook:
    """A node pre-hook that hands output ``nr``'s gradient (when there is one) to ``receive``; returns None (the
    gradients go on unchanged)."""

    __slots__ = ("receive", "nr")

    def __init__(self, receive: Callable[[torch.Tensor], None], nr: int) -> None:
        self.receive, self.nr = receive, nr

    def __call__(self, grads: tuple[Optional[torch.Tensor], ...]) -> None:
        g = grads[self.nr] if self.nr < len(grads) else None
        if g is not None:
            self.receive(g)


def _plain_handles() -> bool:
    """torch's RemovableHandle is what :func:`remove_handles` reads (a weak reference to its hooks dict, an id,
    no extra dicts); checked once, on a handle of our own."""
    hooks: OrderedDict[int, Any] = OrderedDict()  # what torch keeps hooks in (a plain dict has no weak reference)
    try:
        handle = RemovableHandle(hooks)
        hooks[handle.id] = None
        ref = handle.hooks_dict_ref
        plain = ref() is hooks and handle.extra_dict_ref == ()
        handle.remove()
        return plain and not hooks
    except Exception:
        return False


_PLAIN_HANDLES = _plain_handles()


def remove_handles(handles: list[Any]) -> None:
    """``handle.remove()`` for each of a step's gradient-hook handles (hundreds with statistics every step): a
    node hook's plain handle is removed inline (what ``RemovableHandle.remove`` does, without the call); a tensor's
    own hook dict (see the module docstring) loses our key."""
    for handle in handles:
        if type(handle) is OrderedDict:
            handle.pop(OWN_KEY, None)
        elif _PLAIN_HANDLES and type(handle) is RemovableHandle and not handle.extra_dict_ref:
            hooks = handle.hooks_dict_ref()
            if hooks is not None:
                hooks.pop(handle.id, None)
        else:
            handle.remove()
