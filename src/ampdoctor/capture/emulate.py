"""CUDA's autocast policy, emulated on CPU tensors: diagnose as CUDA would on a machine without a GPU.

How: CUDA autocast is a set of kernels at the ``AutocastCUDA`` dispatch key that cast an op's inputs and then
redispatch with the autocast key excluded. CPU tensors pass the ``AutocastCPU`` key at the same place in the
dispatcher (above autograd, so autograd records the casts and the backward sees them; below Python, so inner ops
of ``F.multi_head_attention_forward`` or ``cross_entropy``'s ``log_softmax`` are seen too). While installed, this
module puts Python kernels at ``AutocastCPU`` that apply CUDA's table (``autocast_ops.py``, torch 2.13 lists) with
CUDA's rules: only floating, non-float64 CPU tensors are cast; ``Tensor``, ``Tensor?`` and ``Tensor[]``
arguments; ``fp32_if_dtype`` ops get ``dtype=float32`` only when the caller gave none; ``promote`` picks the widest
of the ``Tensor``/``Tensor[]`` inputs; float16 casts of float32 leaf parameters are cached inside a region (so a
weight used twice accumulates its gradient as on CUDA); ``binary_cross_entropy`` raises as on CUDA. Ops CPU
autocast lists but CUDA does not (``cat``, ``stack``, ``cross_entropy_loss``, ``conv1d.padding``, pools, pads …)
get a fallthrough, so they behave as on CUDA (not cast; composite ops decompose and their inner ops follow the
table). Only the registration names in the tables are touched: in-place ops, ``out=`` overloads and float64
inputs are never cast.

Two context managers::

    with installed_cuda_policy() as emulation:      # process-global kernels: the whole pass, forward+backward
        with cuda_autocast(torch.float16):          # where the CUDA code says torch.autocast("cuda", ...)
            loss = loss_fn(model(x), y)
        loss.backward()
    emulation.notes()                               # the approximations this pass actually ran into

``cuda_autocast`` alone also installs the kernels for its own duration. The region turns CPU autocast on (the
CPU stands in for the GPU: ``autocast(x.device.type, enabled=False)`` and checkpoint recomputation behave as on
CUDA) and also sets CUDA's autocast flag and dtype, so code that reads them (``nn.MultiheadAttention``'s fast-path
check, Hugging Face dtype probes, ``autocast("cuda", enabled=False)`` islands) behaves as on CUDA; inside a region,
an op runs without casts while CUDA's flag is off. Everything is restored on exit, after an exception too.

Known approximations (``policy.EMULATION_APPROXIMATIONS``; the report should carry them):

- kernel accumulation order and internal precision are CPU's, not cuBLAS/cuDNN's;
- ``scaled_dot_product_attention`` runs CPU's kernel, not CUDA's flash / memory-efficient / cuDNN kernels;
- RNN modules follow cuDNN's autocast wrapper (all float16) but CPU's recurrence;
- FFT, ``stft`` and ``avg_pool3d`` keep CPU's float32 (CPU has no float16 kernel for them);
- a nested ``autocast("cuda")`` in user code is disabled by torch on a CPU-only build, so its region runs
  without autocast; ``custom_fwd(cast_inputs=...)`` casts only CUDA tensors;
- only aten ops: custom ops with their own ``AutocastCPU`` kernels keep them; ``torch.compile`` is untested;
- while installed, *every* CPU autocast region of the process follows CUDA's policy (install it for the pass
  only); the five table ops with no CPU kernel (``NOT_EMULATED``) are never reached on CPU.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.library import fallthrough_kernel

from ..autocast_ops import (
    CPU_FP32_KEPT_IN_EMULATION,
    CUDA_BANNED,
    CUDA_FP32,
    CUDA_FP32_APPEND_DTYPE,
    CUDA_FP32_SET_OPT_DTYPE,
    CUDA_LOW,
    CUDA_PROMOTE,
    EMULATION_APPROXIMATIONS,
    POLICY_TORCH_VERSION,
)
from .cleanup import cleaned, on_cleanup, uninterrupted

_KEY = "AutocastCPU"
_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_LOW_DTYPES = (torch.float16, torch.bfloat16)

# Table ops with no CPU (or composite) kernel: CPU code never reaches them, so no kernel is installed. cuDNN
# convolutions and fused RNN cells sit below ops the table already casts (convolution, lstm_cell, gru_cell);
# the CUDA flash-attention op sits below scaled_dot_product_attention, which the table casts.
NOT_EMULATED = frozenset(
    {
        "aten::cudnn_convolution",
        "aten::cudnn_convolution_transpose",
        "aten::_thnn_fused_lstm_cell",
        "aten::_thnn_fused_gru_cell",
        "aten::_scaled_dot_product_flash_attention",
    }
)
# cuDNN's RNN autocast wrapper (``_cudnn_rnn``, CUDA builds only) sits below these; on CPU they are emulated at
# the top: input, states and weights cast to the low dtype, CPU's recurrence run on them.
RNN_OPS = frozenset(
    f"aten::{name}.{overload}" for name in ("lstm", "gru", "rnn_tanh", "rnn_relu") for overload in ("input", "data")
)
BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast. (CUDA autocast policy, emulated on CPU)"
)
_APPROX_BY_OP = {"aten::scaled_dot_product_attention": 1, **{op: 2 for op in RNN_OPS}}


def _overload(name: str) -> Any:
    base, _, overload = name.split("::", 1)[1].partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _arg_kind(arg: Any) -> str:
    kind = str(arg.type)
    return {"Tensor": "t", "Optional[Tensor]": "ot", "List[Tensor]": "tl"}.get(kind, "-")


@dataclass(frozen=True)
class _Plan:
    name: str  # registration name, "aten::pow.Tensor_Scalar"
    policy: str  # low | fp32 | fp32_if_dtype | fp32_append | promote | banned | rnn | kept_fp32
    op: Any  # the OpOverload
    kinds: tuple[str, ...]  # per schema argument: t, ot, tl or -
    names: tuple[str, ...]
    target: Any = None  # fp32_append: the dtype-taking overload
    kind_of: dict[str, str] = field(default_factory=dict)  # argument name -> kind, for keyword arguments


def _plan(name: str, policy: str) -> _Plan:
    op = _overload(name)
    arguments = op._schema.arguments
    target = _overload(CUDA_FP32_APPEND_DTYPE[name]) if policy == "fp32_append" else None
    kinds = tuple(_arg_kind(a) for a in arguments)
    names = tuple(a.name for a in arguments)
    return _Plan(name, policy, op, kinds, names, target, dict(zip(names, kinds)))


def _wanted() -> dict[str, str]:
    wanted = {op: "low" for op in CUDA_LOW}
    wanted.update({op: "fp32" for op in CUDA_FP32})
    wanted.update({op: "fp32_if_dtype" for op in CUDA_FP32_SET_OPT_DTYPE})
    wanted.update({op: "fp32_append" for op in CUDA_FP32_APPEND_DTYPE})
    wanted.update({op: "promote" for op in CUDA_PROMOTE})
    wanted.update({op: "banned" for op in CUDA_BANNED})
    wanted.update({op: "rnn" for op in RNN_OPS})
    wanted.update({op: "kept_fp32" for op in CPU_FP32_KEPT_IN_EMULATION})
    return {op: policy for op, policy in wanted.items() if op not in NOT_EMULATED}


_PLANS: list[_Plan] = []  # built once, read only: the kernels' plans, no behaviour of their own
_MISSING: list[str] = []  # table ops this torch does not have (another version than the tables follow)


def _plans() -> list[_Plan]:
    if not _PLANS:
        for name, policy in sorted(_wanted().items()):
            try:
                _PLANS.append(_plan(name, policy))
            except (AttributeError, RuntimeError):
                _MISSING.append(name)
    return _PLANS


# -- per-thread region state (autocast is thread-local too) ----------------------------------------------------
class _Local(threading.local):
    depth = 0

    def __init__(self) -> None:
        self.cache: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}


_LOCAL = _Local()


@dataclass
class EmulationStats:
    """What the kernels did while installed: calls per registration name, by what happened to them."""

    applied: Counter[str] = field(default_factory=Counter)  # CUDA's rule applied (whether or not it cast)
    island: Counter[str] = field(default_factory=Counter)  # ran uncast: CUDA's autocast flag was off
    kept_fp32: Counter[str] = field(default_factory=Counter)  # CPU's float32 kept (no CPU float16 kernel)

    def notes(self) -> list[str]:
        """The approximations this pass ran into, worded for a report; empty when none applied."""
        notes = [EMULATION_APPROXIMATIONS[0]]
        for index in sorted({_APPROX_BY_OP[op] for op in self.applied if op in _APPROX_BY_OP}):
            notes.append(EMULATION_APPROXIMATIONS[index])
        if self.kept_fp32:
            ops = ", ".join(sorted(op.split("::")[1] for op in self.kept_fp32))
            notes.append(f"{EMULATION_APPROXIMATIONS[3]} (ran: {ops})")
        if self.island:
            notes.append(
                f"{sum(self.island.values())} autocast-listed op calls ran with CUDA's autocast flag off: an "
                "autocast('cuda', enabled=False) island, or a nested autocast('cuda') that a build without CUDA "
                "disables (CUDA would autocast that one)"
            )
        return notes if self.applied or self.kept_fp32 or self.island else []


@dataclass
class CudaPolicyEmulation:
    """Handle of an installation, shared by nested uses: what is installed and what it did.

    ``installed``: registration names with a CUDA-policy kernel; ``fallthrough``: CPU autocast entries switched
    off (CUDA does not list them); ``not_emulated``: table ops with no kernel here (no CPU kernel, or missing
    from this torch); ``stats``: calls per op since installation; ``notes()``: the approximations met, for the
    report (empty when no autocast-listed op ran).
    """

    policy_torch_version: str
    torch_version: str
    installed: tuple[str, ...]
    fallthrough: tuple[str, ...]
    not_emulated: tuple[str, ...]
    stats: EmulationStats

    def notes(self) -> list[str]:
        version = []
        if not self.torch_version.startswith(self.policy_torch_version):
            version = [
                f"the emulated CUDA op lists are torch {self.policy_torch_version}'s; this is torch "
                f"{self.torch_version}"
            ]
        return version + self.stats.notes()


class _Installation:
    lock = threading.Lock()
    count = 0
    module: Any = None
    handle: Optional[CudaPolicyEmulation] = None


def _eligible(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.is_cpu and t.dtype != torch.float64


def _cast(t: Any, to: torch.dtype, low: torch.dtype, cache: bool) -> Any:
    if not _eligible(t) or t.dtype == to:
        return t
    cacheable = cache and to == low and t.dtype == torch.float32 and t.requires_grad and t.is_leaf
    if cacheable and not t._is_view() and not torch.is_inference_mode_enabled():
        hit = _LOCAL.cache.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        with torch.enable_grad():  # as ATen (pytorch#158232): a cast cached under no_grad serves later grad use
            casted = t.to(to)
        _LOCAL.cache[id(t)] = (weakref.ref(t), casted)
        return casted
    return t.to(to)


def _map(plan: _Plan, args: tuple[Any, ...], kwargs: dict[str, Any], fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every Tensor, Tensor? and Tensor[] argument (not Tensor?[]), as ATen's cached_cast does."""

    def one(kind: str, value: Any) -> Any:
        if kind in ("t", "ot") and value is not None:
            return fn(value)
        if kind == "tl" and isinstance(value, (list, tuple)):
            return [fn(v) for v in value]
        return value

    new_kwargs = {k: one(plan.kind_of.get(k, "-"), v) for k, v in kwargs.items()}
    return [one(plan.kinds[i], v) for i, v in enumerate(args)], new_kwargs


def _promote_type(plan: _Plan, args: tuple[Any, ...], kwargs: dict[str, Any], low: torch.dtype) -> torch.dtype:
    """ATen's promote_type: the widest floating Tensor / Tensor[] input (float64 ignored, Tensor? not looked at)."""
    current = low
    values = [(plan.kinds[i], v) for i, v in enumerate(args)]
    values += [(plan.kind_of.get(k, "-"), v) for k, v in kwargs.items()]
    for kind, value in values:
        tensors = [value] if kind == "t" else list(value) if kind == "tl" and value is not None else []
        for t in tensors:
            if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.is_cpu) or t.dtype == torch.float64:
                continue
            if current == torch.float32 or t.dtype == torch.float32:
                current = torch.float32
            elif not (current == low and t.dtype == low):
                raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def _set_dtype(plan: _Plan, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    new_args, new_kwargs = list(args), dict(kwargs)
    index = plan.names.index("dtype")
    if index < len(new_args):
        if new_args[index] is None:
            new_args[index] = torch.float32
    elif new_kwargs.get("dtype") is None:
        new_kwargs["dtype"] = torch.float32
    return new_args, new_kwargs


def _append_dtype(plan: _Plan, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    schema = plan.op._schema.arguments
    full = list(args) + [kwargs.get(a.name, a.default_value) for a in schema[len(args) :]]
    first = full[0]
    dtype = torch.float32 if _eligible(first) else first.dtype
    return plan.target(*full, dtype=dtype)


def _kernel(plan: _Plan, stats: EmulationStats) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            if _LOCAL.depth and not torch.is_autocast_enabled("cuda"):
                stats.island[plan.name] += 1
                return plan.op(*args, **kwargs)
            low = torch.get_autocast_dtype("cpu")
            policy = plan.policy
            if policy == "kept_fp32":
                stats.kept_fp32[plan.name] += 1
            else:
                stats.applied[plan.name] += 1
            if policy == "banned":
                raise RuntimeError(BANNED_MESSAGE)
            if policy == "fp32_append":
                return _append_dtype(plan, args, kwargs)
            if policy == "fp32_if_dtype":
                if args and _eligible(args[0]):
                    args, kwargs = _set_dtype(plan, args, kwargs)  # type: ignore[assignment]
                return plan.op(*args, **kwargs)
            cache = bool(_LOCAL.depth) and torch.is_autocast_cache_enabled() and policy == "low"
            to = {"low": low, "rnn": low, "fp32": torch.float32, "kept_fp32": torch.float32}.get(policy)
            if policy == "promote":
                to = _promote_type(plan, args, kwargs, low)
            assert to is not None
            new_args, new_kwargs = _map(plan, args, kwargs, lambda t: _cast(t, to, low, cache))
            return plan.op(*new_args, **new_kwargs)

    kernel.__name__ = f"cuda_policy_{plan.name.replace('::', '_').replace('.', '_')}"
    return kernel


def _register() -> CudaPolicyEmulation:
    plans = _plans()
    ours = {p.name for p in plans}
    cpu_registered = torch._C._dispatch_get_registrations_for_dispatch_key(_KEY)
    fallthrough = sorted(op for op in cpu_registered if op.startswith("aten::") and op not in ours)
    stats = EmulationStats()
    # The Python binding takes (name, key, fn, with_keyset) as torch.library.Library.impl passes them; the stub
    # lists less. Used directly (not through Library) so torch.library's global bookkeeping stays untouched.
    module: Any = torch._C._dispatch_library("IMPL", "aten", _KEY, __file__, 0)
    try:
        with warnings.catch_warnings():  # "Overriding a previously registered kernel" (CPU autocast's own)
            warnings.simplefilter("ignore")
            for plan in plans:
                module.impl(plan.name.split("::", 1)[1], _KEY, _kernel(plan, stats), False)
            for name in fallthrough:
                module.impl(name.split("::", 1)[1], _KEY, fallthrough_kernel, False)
    except BaseException:
        module.reset()
        raise
    _Installation.module = module
    return CudaPolicyEmulation(
        policy_torch_version=POLICY_TORCH_VERSION,
        torch_version=torch.__version__,
        installed=tuple(p.name for p in plans),
        fallthrough=tuple(fallthrough),
        not_emulated=tuple(sorted(NOT_EMULATED | set(_MISSING))),
        stats=stats,
    )


@contextmanager
def installed_cuda_policy() -> Iterator[CudaPolicyEmulation]:
    """Install CUDA's autocast policy for CPU autocast, for the duration of the block (process-global).

    Enclose the forward *and* the backward (checkpoint recomputation runs in the backward). Nested uses share one
    installation; the last exit removes every kernel, restoring CPU autocast's own. Costs: installing and
    removing take a few milliseconds; each autocast-listed op call pays a Python kernel (tens of µs), other ops
    nothing. Yields the installation's handle, whose ``stats`` and ``notes()`` say what the pass ran into.
    """
    handle, release = _acquire()
    try:
        yield handle
    finally:
        release()


@uninterrupted
def _acquire() -> tuple[CudaPolicyEmulation, Callable[[], None]]:
    """One more user of the installation, and its (idempotent) release, owned by the cleanup owner from the
    moment the kernels are in: a Ctrl-C at any moment never leaves them installed."""
    with _Installation.lock:
        if _Installation.count == 0:
            _Installation.handle = _register()
        _Installation.count += 1
        handle = _Installation.handle
    released = False

    @uninterrupted
    def release() -> None:
        nonlocal released
        if released:
            return
        released = True
        with _Installation.lock:
            _Installation.count -= 1
            if _Installation.count == 0:
                module, _Installation.module, _Installation.handle = _Installation.module, None, None
                module.reset()
        cleaned(release)

    on_cleanup(release)
    assert handle is not None
    return handle, release


def is_installed() -> bool:
    return _Installation.count > 0


@contextmanager
def cuda_autocast(
    dtype: torch.dtype = torch.float16, enabled: bool = True, cache_enabled: Optional[bool] = None
) -> Iterator[CudaPolicyEmulation]:
    """The emulated ``torch.autocast("cuda", dtype=dtype)`` for CPU tensors (installs the kernels if needed).

    Sets CPU autocast (enabled, ``dtype``) and CUDA's autocast flag and dtype, and restores all of them, the
    autocast nesting count and cache flag, and this region's weight-cast cache, on exit (after an exception too).
    """
    if dtype not in _LOW_DTYPES:
        raise ValueError(f"CUDA autocast runs in float16 or bfloat16, not {dtype}")
    cache = torch.is_autocast_cache_enabled() if cache_enabled is None else cache_enabled
    with installed_cuda_policy() as handle:
        previous = (
            torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"),
            torch.is_autocast_enabled("cuda"),
            torch.get_autocast_dtype("cuda"),
            torch.is_autocast_cache_enabled(),
        )
        torch.autocast_increment_nesting()
        _LOCAL.depth += 1
        try:
            torch.set_autocast_enabled("cpu", enabled)
            torch.set_autocast_dtype("cpu", dtype)
            torch.set_autocast_enabled("cuda", enabled)
            torch.set_autocast_dtype("cuda", dtype)
            torch.set_autocast_cache_enabled(cache)
            yield handle
        finally:
            _LOCAL.depth -= 1
            if _LOCAL.depth == 0:
                _LOCAL.cache.clear()
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()
            torch.set_autocast_enabled("cpu", previous[0])
            torch.set_autocast_dtype("cpu", previous[1])
            torch.set_autocast_enabled("cuda", previous[2])
            torch.set_autocast_dtype("cuda", previous[3])
            torch.set_autocast_cache_enabled(previous[4])


def should_emulate_cuda(device_type: str) -> bool:
    """True when a diagnosis asks for CUDA's autocast and this torch cannot give it (no CUDA device)."""
    return device_type == "cuda" and not torch.cuda.is_available()
