"""The user's state: the one snapshot / rewind / restore of RNG streams, buffers and training flags.

Every re-run of a diagnosis, a watch capture, a bundle and its replay use :class:`RngState` for the random
streams (torch CPU, every initialised CUDA device, Python, numpy), so re-runs draw the same dropout masks.
"""

from __future__ import annotations

import array
import bisect
import contextlib
import random
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .cleanup import cleaned, on_cleanup, uninterrupted
from .exclusive import claim_modules
from .fingerprints import fingerprints as fingerprints
from .fingerprints import packed
from .module_entries import Entries, HookDicts


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@dataclass(frozen=True)
class RngState:
    """Every random stream a forward may draw from, captured at one moment."""

    cpu: torch.Tensor
    cuda: Optional[tuple[torch.Tensor, ...]]  # one per device; None when CUDA is not initialised
    python: Any
    numpy: Any

    @classmethod
    def capture(cls) -> RngState:
        return cls(
            cpu=torch.get_rng_state(),
            cuda=tuple(torch.cuda.get_rng_state_all()) if _cuda_ready() else None,
            python=random.getstate(),
            numpy=np.random.get_state(),
        )

    @uninterrupted
    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None and _cuda_ready():
            # A state saved on a machine with more GPUs (a failure bundle): the devices this one has.
            torch.cuda.set_rng_state_all(list(self.cuda)[: torch.cuda.device_count()])
        random.setstate(self.python)
        np.random.set_state(self.numpy)

    # -- a plain form that torch.load(weights_only=True) reads (failure bundles) ------------------------------
    def to_plain(self) -> dict[str, Any]:
        version, state, gauss = self.python
        kind, keys, pos, has_gauss, cached = self.numpy
        return {
            "torch_cpu": self.cpu.clone(),
            "torch_cuda": [s.clone() for s in self.cuda] if self.cuda is not None else [],
            "python": {"version": int(version), "state": [int(v) for v in state], "gauss": gauss},
            "numpy": {
                "kind": str(kind),
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
        }

    @classmethod
    def from_plain(cls, data: Any) -> Optional[RngState]:
        """The state written by :meth:`to_plain`; None when ``data`` does not hold one. Missing streams are
        taken from the current state (an older bundle saved only the torch CPU stream)."""
        if not isinstance(data, dict) or not isinstance(data.get("torch_cpu"), torch.Tensor):
            return None
        now = cls.capture()
        cuda = data.get("torch_cuda")
        python, numpy_state = now.python, now.numpy
        py = data.get("python")
        if isinstance(py, dict) and "state" in py:
            python = (int(py["version"]), tuple(int(v) for v in py["state"]), py.get("gauss"))
        npd = data.get("numpy")
        if isinstance(npd, dict) and isinstance(npd.get("keys"), torch.Tensor):
            keys = npd["keys"].numpy().astype(np.uint32)
            numpy_state = (
                str(npd["kind"]), keys, int(npd["pos"]), int(npd["has_gauss"]), float(npd["cached_gaussian"])
            )
        return cls(
            cpu=data["torch_cpu"],
            cuda=tuple(cuda) if isinstance(cuda, (list, tuple)) and cuda else None,
            python=python,
            numpy=numpy_state,
        )


# Dunder methods that write their first operand in place (``w += 1``, ``w[0] = 1``).
_INPLACE_DUNDERS = frozenset(
    f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift",
                            "rshift", "matmul")
) | {"__setitem__", "__set__"}


# torch.nn.functional calls that write their weight in place inside (a TorchFunctionMode sees only the outer
# call): (position of the weight, position of max_norm) of F.embedding and F.embedding_bag.
_FUNCTIONAL_WRITERS = {F.embedding: (1, 3), F.embedding_bag: (1, 4)}


def written_tensor(func: Any, args: Any, kwargs: Any) -> Optional[torch.Tensor]:
    """The tensor a torch function writes in place (``x.clamp_()``, ``torch.embedding_renorm_(w, ...)``,
    ``w[i] = v``, ``out=``, ``F.embedding(..., max_norm=...)``), or None."""
    out = kwargs.get("out") if kwargs else None
    if isinstance(out, torch.Tensor):
        return out
    writer = _FUNCTIONAL_WRITERS.get(func)
    if writer is not None:
        weight_at, max_norm_at = writer
        weight = args[weight_at] if len(args) > weight_at else kwargs.get("weight")
        max_norm = args[max_norm_at] if len(args) > max_norm_at else kwargs.get("max_norm")
        return weight if max_norm is not None and isinstance(weight, torch.Tensor) else None
    inplace = _INPLACE.get(func)
    if inplace is None:
        inplace = _writes_first(func)
        with contextlib.suppress(TypeError):  # an unhashable callable: decided again next time
            if len(_INPLACE) > 4096:
                _INPLACE.clear()
            _INPLACE[func] = inplace
    if inplace and args and isinstance(args[0], torch.Tensor):
        return args[0]
    return None


# Whether a function writes its first operand, by function (asked for every op of every pass: decided once each).
_INPLACE: dict[Any, bool] = {}


def _writes_first(func: Any) -> bool:
    name = getattr(func, "__name__", "").split(".")[0]  # torch.ops.aten.mul_.Tensor is named "mul_.Tensor"
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("_"))


def _version(t: torch.Tensor) -> int:
    """The version counter (-1 for an inference tensor: it has none, and a forward cannot write it in place)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _storage_key(t: torch.Tensor) -> Optional[int]:
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without a storage (meta, some subclasses)
        return None
    return ptr or None


class _WriteGuard(TorchFunctionMode):
    """Copy-on-write for parameters: the first in-place write to a parameter's storage during a pass keeps a
    copy of the parameter first (a TorchFunctionMode costs little per op, unlike a dispatch mode)."""

    def __init__(self, guard: StateGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.guard.check_write(func, args, kwargs)
        return func(*args, **kwargs)


class StateGuard:
    """Keeps everything a pass could change of the user's model as it was.

    - RNG streams: rewound before every pass and at the end (re-runs draw the same dropout masks).
    - Buffers: every pass runs on fresh working copies (BatchNorm statistics, lazily filled caches, buffers a
      forward adds); the user's own buffer tensors are put back at the end, never written, so their version
      counters do not move and a backward the user built before ``diagnose`` still runs.
    - Parameters: copy-on-write. A forward that writes a parameter in place (``nn.Embedding(max_norm=...)``,
      ``weight.clamp_()``, writes through ``.data``) has it copied just before the write and restored after
      the pass, with its version counter set back (a private torch API; without it the report says so).
      Fingerprints before and after catch writes that no Python-level op made (C++ extensions): those are
      named in the notes as not restored.
    - ``training`` flags.
    """

    def __init__(
        self,
        model: nn.Module,
        params: list[tuple[str, nn.Parameter]],
        rng: Optional[RngState] = None,
        modules: Optional[list[nn.Module]] = None,
    ) -> None:
        self.modules = list(model.modules()) if modules is None else modules  # ``modules``: when walked already
        self.root = model
        # One diagnosis per model at a time (another thread's waits here); released by restore().
        self._release = claim_modules(self.modules, f"this {type(model).__name__}")
        self.rng = rng or RngState.capture()
        # torch.Generators the modules hold (``self.gen = torch.Generator()``): their streams are the model's
        # state too, rewound like the global ones (else each pass draws anew, and the user's next step too).
        held = {id(v): v for m in self.modules for v in m.__dict__.values() if type(v) is torch.Generator}
        self.generators = [(g, g.get_state()) for g in held.values()]
        # What each module held, kept compactly (a model of ten thousand modules would otherwise keep a tuple or
        # a dict per module per kind: megabytes, for the whole diagnosis; see module_entries):
        # - its buffers by name (None entries included), by object: a forward that fills a lazy cache
        #   (register_buffer("cache", None), then set in forward) or adds a buffer is undone too;
        # - its parameter objects by name: a forward that assigns a new nn.Parameter (or adds one) is undone too;
        # - its children, class and training flag: a forward that parametrizes a child (parametrize swaps the
        #   class and adds a ModuleDict) is undone too (its parameters are, by the parameter entries). Not a
        #   removed parametrization: parametrize deletes the property from the class object itself.
        self.buffer_entries = Entries(self.modules, "_buffers")
        self.param_entries = Entries(self.modules, "_parameters")
        self.child_entries = Entries(self.modules, "_modules")
        self.classes = [type(m) for m in self.modules]
        self.flags = bytearray(m.training for m in self.modules)
        self.originals = {id(b): b for b in self.buffer_entries.objects if b is not None}
        self.hooks = HookDicts(self.modules)
        self.params = params
        self.versions = [_version(p) for _, p in params]  # (in the order of params: looked up only after a write)
        self.grads = [p.grad for _, p in params]  # (set aside below, once restore() is owned)
        # Parameters by storage (copy-on-write): sorted storage keys, and the index in params of the first
        # parameter on each (a lookup per in-place write of the forward, by bisection).
        keyed = sorted((key, i) for i, (_, p) in enumerate(params) if (key := _storage_key(p)) is not None)
        firsts = [pair for j, pair in enumerate(keyed) if j == 0 or keyed[j - 1][0] != pair[0]]
        self.storage_keys = array.array("Q", [key for key, _ in firsts])
        self.storage_params = array.array("q", [i for _, i in firsts])
        self.saved: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        self.notes: list[str] = []
        try:
            self._fingerprints = packed(fingerprints(self._watched()))
        except BaseException:
            self._release()  # nothing was changed yet: the model is not left claimed either
            raise
        # The diagnosis's cleanup owner puts everything back even when Ctrl-C cuts the diagnosis short.
        self._undo: Optional[Callable[[], None]] = on_cleanup(self.restore)
        # .grad fields set aside for the whole diagnosis and put back by restore(): a backward the model's own code
        # runs (a forward or loss_fn calling .backward()) accumulates into fresh tensors, never into the user's,
        # and leaves nothing where there was None.
        for (_, p), grad in zip(params, self.grads):
            if grad is not None:
                p.grad = None

    def _watched(self) -> list[torch.Tensor]:
        return [p for _, p in self.params] + list(self.originals.values())

    # -- parameters -----------------------------------------------------------------------------------------
    @uninterrupted
    def before_write(self, target: torch.Tensor) -> None:
        key = _storage_key(target)
        if key is None:
            return
        keys = self.storage_keys
        at = bisect.bisect_left(keys, key)
        if at == len(keys) or keys[at] != key:
            return
        param = self.params[self.storage_params[at]][1]
        if id(param) not in self.saved:
            self.saved[id(param)] = (param, param.detach().clone())

    def check_write(self, func: Any, args: Any, kwargs: Any) -> None:
        """Before the torch function ``func`` runs: copy the parameter it is about to write in place, if any. What
        the copy-on-write mode does per op; a pass with another torch-function mode of its own (the hidden-overflow
        watch) calls it from there instead, so that each op crosses one Python mode, not two."""
        target = written_tensor(func, args, kwargs)
        if target is not None:
            self.before_write(target)

    def guard_writes(self) -> _WriteGuard:
        """The context a pass's forward runs in: parameters written in place are copied first."""
        return _WriteGuard(self)

    def _restore_params(self) -> None:
        if not self.saved:
            return
        setter = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)
        with torch.no_grad():
            for param, copy in self.saved.values():
                param.copy_(copy)
        index = {id(p): i for i, (_, p) in enumerate(self.params)}
        written = [index[id(p)] for p, _ in self.saved.values()]
        if setter is not None:
            setter(tuple(self.params[i][1] for i in written), tuple(self.versions[i] for i in written))
        else:
            note = (
                "the forward wrote parameters in place; ampdoctor restored their values, but this torch has no "
                "way to set their version counters back: a backward built before diagnose may refuse to run"
            )
            if note not in self.notes:
                self.notes.append(note)
        written_names = ", ".join(self.params[i][0] for i in written)
        note = f"the forward writes parameters in place ({written_names}); each pass ran on their original values"
        if note not in self.notes:
            self.notes.append(note)

    # -- passes ---------------------------------------------------------------------------------------------
    @uninterrupted
    def rewind(self) -> None:
        """Before each pass: the same RNG draws, the original parameters, fresh copies of the buffers."""
        self.rng.restore()
        for generator, state in self.generators:
            generator.set_state(state)
        self._put_structure()
        self._put_parameters()
        self._restore_params()
        copies = {key: b.detach().clone() for key, b in self.originals.items()}
        self._put_buffers(copies)
        self._put_training()

    @uninterrupted
    def restore(self) -> None:
        """At the end: the user's own buffer tensors, parameters, flags and RNG, exactly as they were. Idempotent;
        runs to its end even when Ctrl-C arrives meanwhile."""
        self.rng.restore()
        for generator, state in self.generators:
            generator.set_state(state)
        self._put_structure()
        self._put_parameters()
        self._restore_params()
        self._put_buffers(self.originals)
        self._put_training()
        for (_, p), grad in zip(self.params, self.grads):
            if p.grad is not grad:
                p.grad = grad
        self._put_hooks()
        after = packed(fingerprints(self._watched()))
        before = self._fingerprints
        changed = self._names([i // 2 for i in range(0, len(after), 2) if after[i : i + 2] != before[i : i + 2]])
        if changed:
            self.notes.append(
                f"{', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''} changed during the diagnosis by "
                "code ampdoctor could not intercept (no Python-level op wrote it): NOT restored"
            )
        if self._undo is not None:
            cleaned(self._undo)
            self._undo = None
        self._release()

    def _names(self, indices: list[int]) -> list[str]:
        """The names of watched tensors (parameters, then the distinct buffers), by their index in _watched()."""
        if not indices:
            return []
        buffers = {id(b): f"buffer {name}" for name, b in self.root.named_buffers(remove_duplicate=False)}
        watched = self._watched()
        count = len(self.params)
        return [self.params[i][0] if i < count else buffers.get(id(watched[i]), "a buffer") for i in indices]

    def _put_hooks(self) -> None:
        """The module hooks as they were, at the end only: between passes a remedy's re-run holds hooks of its own
        (a float32 fallback), which this would take out."""
        note = ("the forward changes module hooks (a hook that removes itself when it fires, one the forward "
                "registers): the model keeps the hooks it had")
        if self.hooks.put_back(self.modules) and note not in self.notes:
            self.notes.append(note)

    def _put_training(self) -> None:
        # Set only where a forward changed it (nn.Module.__setattr__ is a long way for ten thousand modules).
        for module, flag in zip(self.modules, self.flags):
            if module.training != flag:
                module.training = bool(flag)

    def _put_structure(self) -> None:
        changed = False
        children = self.child_entries
        for i, (module, cls) in enumerate(zip(self.modules, self.classes)):
            if type(module) is not cls:
                module.__class__ = cls
                changed = True
            current = module._modules
            if (current or children.held(i)) and not children.same(i, current):
                current.clear()
                current.update(children.at(i))
                changed = True
        if changed:
            note = (
                "the forward changes module classes or submodules (a parametrization added or removed, a child "
                "replaced); each pass started from, and the model keeps, the original structure"
            )
            if note not in self.notes:
                self.notes.append(note)

    def _put_parameters(self) -> None:
        entries = self.param_entries
        for i, module in enumerate(self.modules):
            current = module._parameters
            if not current and not entries.held(i):
                continue
            if entries.same(i, current):
                continue  # nothing assigned
            before = entries.at(i)
            replaced = [n for n in current if current[n] is not before.get(n)]
            for name in [n for n in current if n not in before]:
                del current[name]
            current.update(before)
            note = (
                f"the forward assigns parameter objects ({', '.join(replaced[:3])}); each pass started from, and the "
                "model keeps, the original ones"
            )
            if note not in self.notes:
                self.notes.append(note)

    def _put_buffers(self, tensors: dict[int, torch.Tensor]) -> None:
        entries = self.buffer_entries
        for i, module in enumerate(self.modules):
            current = module._buffers
            if not current and not entries.held(i):
                continue  # most modules have none, before and after
            before = entries.at(i)
            for name in [n for n in current if n not in before]:
                del current[name]
            for name, value in before.items():
                current[name] = None if value is None else tensors[id(value)]
