"""FSDP under the watch, and a gathered full model for ``diagnose`` (the design stated in the README).

With ``fully_shard`` (FSDP2) each rank holds a shard of every parameter (a ``DTensor``) between forwards, and a
forward all-gathers the full parameters in FSDP's own hooks. So:

* **statistics are each rank's own**: activations and their gradients are plain tensors of that rank's batch;
  weight norms are taken of each rank's shard (``to_local()``), never of the ``DTensor`` itself (a reduction
  of a ``DTensor`` is a collective, and a collective inside a hook hangs when ranks diverge);
* **a capture replays on the gathered full model** (:func:`full_model`): every rank all-gathers each parameter
  once, in the same order, FSDP's hooks are set aside, and the rank that failed runs ``diagnose`` on its own
  batch locally, with no collective inside (ranks that find different things may run different passes). The
  ranks first agree, in one small all-reduce per step (:func:`agree`), whether any rank wants a capture, so
  that all of them gather together or none does. Memory: the full parameters, on every rank, during a
  capture;
* ``MixedPrecisionPolicy(param_dtype=torch.float16)`` without autocast is low precision: the watch takes that
  dtype, and the full model's parameters are cast to it as FSDP casts them for its forward.

``FullyShardedDataParallel`` (FSDP1) keeps flat parameter buffers that only a collective forward can use: the
watch records every rank's steps there, but runs no capture and says so.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from torch import nn

# How long a rank waits for the others to agree on a capture before it gives up on captures (a rank that never
# arrives means the ranks already diverged; waiting longer would only hang training).
AGREE_TIMEOUT_S = 300.0

FSDP1_NOTE = (
    "FullyShardedDataParallel (FSDP1) keeps flat parameter shards that only a collective forward can use: the "
    "watch recorded every rank's steps but ran no capture and wrote no bundle; fully_shard (FSDP2) supports both"
)
FSDP2_NOTE = (
    "FSDP2 (fully_shard): the capture replayed the failing batch on this rank with the full parameters gathered "
    "from every rank, without FSDP's hooks"
)


def _loaded_type(module: str, name: str) -> Optional[type]:
    """``module.name`` when ``module`` is already imported, else None. A model can only hold an instance of a class
    whose module is loaded, so asking costs nothing: importing ``torch.distributed.tensor`` just to find no DTensor
    would take about 3 s and 80 MB on the first call in a process (it pulls in sympy and the fx machinery)."""
    loaded = sys.modules.get(module)
    found = getattr(loaded, name, None) if loaded is not None else None
    return found if isinstance(found, type) else None


def _fsdp_module_type() -> Optional[type]:
    return _loaded_type("torch.distributed.fsdp", "FSDPModule")


def _dtensor_type() -> Optional[type]:
    return _loaded_type("torch.distributed.tensor", "DTensor")


@dataclass(frozen=True)
class Sharding:
    """How a model is sharded, as far as the watch cares."""

    kind: Optional[Literal["fsdp2", "fsdp1"]]
    param_dtype: Optional[torch.dtype]  # FSDP2's MixedPrecisionPolicy(param_dtype=...) of the root's group


def describe(root: nn.Module) -> Sharding:
    fsdp2 = _fsdp_module_type()
    if fsdp2 is not None and any(isinstance(m, fsdp2) for m in root.modules()):
        return Sharding("fsdp2", _param_dtype(next(m for m in root.modules() if isinstance(m, fsdp2))))
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in root.modules()):
        return Sharding("fsdp1", None)
    return Sharding(None, None)


def _param_dtype(module: nn.Module) -> Optional[torch.dtype]:
    """The ``param_dtype`` of the ``MixedPrecisionPolicy`` FSDP2 was given for this module (private state:
    feature-checked; None when unknown)."""
    state_of = getattr(module, "_get_fsdp_state", None)
    policy = getattr(state_of(), "_mp_policy", None) if callable(state_of) else None
    dtype = getattr(policy, "param_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def locals_of(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`local` of each tensor, the DTensor type looked up once (many tensors per step)."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return tensors
    return [t.to_local() if isinstance(t, dtensor) else t for t in tensors]  # type: ignore[attr-defined]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` (no collective); any other tensor as it is."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        shard: torch.Tensor = t.to_local()  # type: ignore[attr-defined]
        return shard
    return t


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (0, 1 outside torch.distributed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def agree(want: bool, device: torch.device) -> Optional[bool]:
    """Whether any rank wants a capture at this step (every rank calls this once per step); None when the
    collective failed or timed out."""
    import torch.distributed as dist

    flag = torch.tensor([1 if want else 0], dtype=torch.int32, device=device)
    try:
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        if work is not None and work.wait(timeout=datetime.timedelta(seconds=AGREE_TIMEOUT_S)) is False:
            return None
    except RuntimeError:  # a timeout or a broken process group: no capture, training goes on
        return None
    return bool(flag.item())


def agreement_device(root: nn.Module) -> torch.device:
    """Where the agreement's flag lives: NCCL needs a CUDA tensor, gloo a CPU one."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _is_fsdp_hook(hook: Any) -> bool:
    fn = getattr(hook, "__func__", hook)
    fn = getattr(fn, "func", fn)  # functools.partial
    module = getattr(fn, "__module__", None) or ""
    return isinstance(module, str) and module.startswith("torch.distributed.fsdp")


@contextlib.contextmanager
def _without_fsdp_hooks(root: nn.Module) -> Iterator[None]:
    """FSDP's forward hooks (all-gather, reshard, backward registration) set aside; put back in their order."""
    stashed: list[tuple[dict[int, Any], list[tuple[int, Any]], set[int]]] = []
    for m in root.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            keys = {k for k, h in hooks.items() if _is_fsdp_hook(h)}
            if keys:
                stashed.append((hooks, list(hooks.items()), keys))
                for k in keys:
                    del hooks[k]
    try:
        yield
    finally:
        for hooks, before, keys in stashed:
            now = dict(hooks)
            hooks.clear()
            for k, h in before:  # FSDP's own, and the others still there, in their original order
                if k in keys or k in now:
                    hooks[k] = h
            for k, h in now.items():  # hooks added meanwhile
                hooks.setdefault(k, h)


def _policy_dtypes(root: nn.Module) -> dict[int, Optional[torch.dtype]]:
    """Each module's parameter dtype under FSDP2: the policy of the nearest ``fully_shard``-ed ancestor."""
    fsdp2 = _fsdp_module_type()
    dtypes: dict[int, Optional[torch.dtype]] = {}

    todo: list[tuple[nn.Module, Optional[torch.dtype]]] = [(root, None)]
    while todo:  # iterative: a deeply nested model must not cost ampdoctor recursion depth
        m, current = todo.pop()
        if fsdp2 is not None and isinstance(m, fsdp2):
            current = _param_dtype(m)
        dtypes[id(m)] = current
        todo.extend((child, current) for child in m.children())
    return dtypes


@contextlib.contextmanager
def full_model(model: nn.Module) -> Iterator[nn.Module]:
    """The root of ``model`` with every FSDP2 parameter gathered into a plain full tensor and FSDP's forward hooks
    set aside; everything is put back on exit. Collective: every rank enters it at the same point. A model that is
    not FSDP2-sharded is yielded as it is.

    >>> with ampdoctor.training.full_model(model) as full:     # on every rank
    ...     report = ampdoctor.diagnose(full, batch)            # local: no collective inside
    """
    from .model import unwrap_model

    root, _ = unwrap_model(model)
    dtensor = _dtensor_type()
    if describe(root).kind != "fsdp2" or dtensor is None:
        yield root
        return
    dtypes = _policy_dtypes(root)
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    plain: dict[int, nn.Parameter] = {}
    try:
        with torch.no_grad():
            for m in root.modules():  # the same order on every rank: one all-gather per parameter
                for name, p in list(m._parameters.items()):
                    if p is None or not isinstance(p, dtensor):
                        continue
                    if id(p) not in plain:
                        full = p.full_tensor().detach()  # type: ignore[attr-defined]
                        dtype = dtypes.get(id(m))
                        plain[id(p)] = nn.Parameter(full.to(dtype) if dtype else full, requires_grad=p.requires_grad)
                    swapped.append((m, name, p))
                    m._parameters[name] = plain[id(p)]
        with _without_fsdp_hooks(root):
            yield root
    finally:
        for m, name, p in swapped:
            m._parameters[name] = p
