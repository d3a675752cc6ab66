"""Ctrl-C at many moments of a run (issue 23): a timer thread sends SIGINT to the main thread at evenly spaced
offsets across a whole ``diagnose`` (or ``watch``) run, and after each the user's state is compared with before:
parameters, buffers, ``.grad``, ``training``, version counters, module hooks (all four kinds, on every module,
and torch's global ones), tensor hooks on parameters, the dispatch and function mode stacks, autocast (flags and
dtypes per device, cache, nesting), grad and anomaly mode, the RNG streams, the CPU autocast kernels (the emulated
CUDA policy must be gone), the garbage collector, the SIGINT handler and the recursion limit.

Used by tests/test_interrupt.py (a short sweep) and scripts/interrupt_sweep.py (20 sweeps in a row).
"""

from __future__ import annotations

import gc
import random
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn
from torch.nn.modules import module as module_globals

_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_buffer_registration_hooks",
    "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.norm(self.fc(x)))


class Interrupted(nn.Module):
    """In-place weight writes (``Embedding(max_norm=1)``), a BatchNorm in train mode, ``Linear + LayerNorm +
    GELU`` blocks, and a head that overflows float16 (so the detailed re-run, op zoom and verification run too)."""

    def __init__(self, blocks: int = 8, width: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, width, max_norm=1.0)
        self.norm = nn.BatchNorm1d(width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(blocks)])
        self.head = nn.Linear(width, 4)
        with torch.no_grad():
            self.head.weight.mul_(3e4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids).mean(1)
        return self.head(self.blocks(self.norm(x)))


def model_and_batch(seed: int = 0, blocks: int = 8) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    model = Interrupted(blocks)
    with torch.no_grad():
        model.emb.weight.mul_(3.0)  # rows above max_norm: the forward renormalises them in place
    return model, torch.randint(0, 64, (16, 5))


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _autocast_kernels() -> list[str]:
    return sorted(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"))


def _nesting() -> int:
    depth = torch.autocast_decrement_nesting() + 1
    torch.autocast_increment_nesting()
    return depth


# What a watched training loop changes itself (its forward writes the embedding, BatchNorm statistics, .grad);
# a watch is checked on everything else.
TRAINING_CHANGES = ("tensors", "versions", "grads")


def state_of(model: nn.Module, scaler: Any = None) -> dict[str, Any]:
    """Everything an interrupted run must leave as it was."""
    from ampdoctor.capture import emulate

    modules = dict(model.named_modules())
    return {
        "tensors": {k: _bits(v) for k, v in model.state_dict(keep_vars=True).items()},
        "objects": {k: id(v) for k, v in model.state_dict(keep_vars=True).items()},
        "versions": {k: v._version for k, v in model.state_dict(keep_vars=True).items()},
        "grads": {n: None if p.grad is None else _bits(p.grad) for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in modules.items()},
        "module hooks": {
            n: (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks),
                dict(m._backward_pre_hooks))
            for n, m in modules.items()
        },
        "attributes": {n: sorted(vars(m)) for n, m in modules.items()},
        "tensor hooks": {n: dict(p._backward_hooks or {}) for n, p in model.named_parameters()},
        "global hooks": {name: dict(getattr(module_globals, name)) for name in _GLOBAL_HOOKS},
        "dispatch modes": [type(m).__name__ for m in _dispatch_modes()],
        "function modes": torch._C._len_torch_function_stack(),
        "autocast": [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")],
        "autocast cache": torch.is_autocast_cache_enabled(),
        "autocast nesting": _nesting(),
        "grad mode": torch.is_grad_enabled(),
        "inference mode": torch.is_inference_mode_enabled(),
        "anomaly": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        "torch rng": _bits(torch.get_rng_state()),
        "python rng": random.getstate(),
        "numpy rng": np.random.get_state()[1].tobytes(),
        "emulation": (emulate.is_installed(), _autocast_kernels()),
        "gc": gc.isenabled(),
        "sigint handler": signal.getsignal(signal.SIGINT),
        "recursion limit": sys.getrecursionlimit(),
        "scaler attributes": None if scaler is None else sorted(vars(scaler)),
    }


def _dispatch_modes() -> list[Any]:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return list(_get_current_dispatch_mode_stack())


def differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    out = []
    for key, value in before.items():
        if after[key] != value:
            if isinstance(value, dict):
                which = [k for k in value if after[key].get(k) != value[k]] + [k for k in after[key] if k not in value]
                out.append(f"{key}: {which[:6]}")
            else:
                out.append(f"{key}: {value!r} -> {after[key]!r}")
    return out


@dataclass
class Outcome:
    offset: float
    result: str  # "interrupted", "finished", or the unexpected exception
    left_behind: list[str]


def _interrupt_after(delay: float, main: int, done: threading.Event) -> threading.Thread:
    def fire() -> None:
        if not done.wait(delay):
            signal.pthread_kill(main, signal.SIGINT)  # what the terminal's Ctrl-C delivers

    thread = threading.Thread(target=fire, daemon=True)
    thread.start()
    return thread


# The autocast state a Ctrl-C leaves when it cuts torch's own ``torch.autocast`` enter or exit in the user's loop
# (half of its flags set): plain torch does the same with or without ampdoctor, so it is not ampdoctor's to restore.
_AUTOCAST_STATE = ("autocast", "autocast cache", "autocast nesting")


def _cut_the_users_autocast(exc: BaseException) -> bool:
    """The KeyboardInterrupt was raised inside ``torch.autocast.__enter__``/``__exit__`` called from this harness's
    own loop (not from ampdoctor's code)."""
    frames = [f for f, _ in traceback.walk_tb(exc.__traceback__)]
    for inner, outer in zip(frames[1:], frames):
        if inner.f_code.co_filename.endswith("autocast_mode.py") and inner.f_code.co_name in ("__enter__",
                                                                                             "__exit__"):
            return outer.f_code.co_filename == __file__
    return False


def _put_autocast_back(before: dict[str, Any]) -> None:
    for device, enabled, dtype in before["autocast"]:
        torch.set_autocast_enabled(device, enabled)
        torch.set_autocast_dtype(device, dtype)
    torch.set_autocast_cache_enabled(before["autocast cache"])
    while _nesting() > before["autocast nesting"]:
        torch.autocast_decrement_nesting()
    while _nesting() < before["autocast nesting"]:
        torch.autocast_increment_nesting()


def interrupt_at(
    run: Callable[[], Any], model: nn.Module, offset: float, scaler: Any = None, ignore: tuple[str, ...] = ()
) -> Outcome:
    """Run ``run()`` with SIGINT sent ``offset`` seconds in; compare the state after with before (all but the
    keys in ``ignore``, and the autocast flags when the Ctrl-C cut the user's own ``torch.autocast`` block)."""
    before = state_of(model, scaler)
    for key in ignore:
        del before[key]
    done = threading.Event()
    result = "finished"
    thread: Optional[threading.Thread] = None
    try:
        thread = _interrupt_after(offset, threading.main_thread().ident or 0, done)
        run()
        done.set()
        thread.join()
        time.sleep(0.002)  # a signal sent just as the run ended is handled here, outside it
    except KeyboardInterrupt as exc:
        result = "interrupted"
        if _cut_the_users_autocast(exc):
            _put_autocast_back(before)  # for the runs (and tests) after this one
            for key in _AUTOCAST_STATE:
                before.pop(key, None)
    except Exception as exc:  # noqa: BLE001 - reported, the caller asserts
        result = f"{type(exc).__name__}: {exc}"
    finally:
        done.set()
        while thread is not None and thread.is_alive():
            try:
                thread.join()
            except KeyboardInterrupt:
                result = "interrupted"
        try:
            time.sleep(0.002)
        except KeyboardInterrupt:
            result = "interrupted"
    return Outcome(offset, result, differences(before, state_of(model, scaler)))


def sweep(
    run: Callable[[], Any],
    model: nn.Module,
    moments: int,
    duration: float,
    rng: Optional[random.Random] = None,
    scaler: Any = None,
    ignore: tuple[str, ...] = (),
) -> list[Outcome]:
    """``moments`` interrupts spread evenly over ``duration`` seconds (with a random jitter of up to one step
    when ``rng`` is given), each on a fresh run."""
    step = duration / moments
    offsets = [step * (i + (rng.random() if rng else 0.5)) for i in range(moments)]
    return [interrupt_at(run, model, offset, scaler, ignore) for offset in offsets]


def timed(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def watched_run(seed: int = 2, blocks: int = 4, steps: int = 3) -> tuple[Callable[[], None], nn.Module, Any]:
    """A short training loop under ``ampdoctor.watch`` (every step sampled; the head overflows, so steps are
    skipped and captured): the run, its model and its scaler."""
    import ampdoctor

    model, batch = model_and_batch(seed, blocks)
    scaler = torch.amp.GradScaler("cpu")
    optimizers: list[torch.optim.Optimizer] = []  # kept alive: the scaler's per-optimizer state is keyed by id

    def run() -> None:
        # A fresh optimizer per run: an interrupt between the user's scaler.step() and scaler.update() leaves
        # their scaler waiting for update() for that optimizer (the user's loop state, not ampdoctor's).
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        optimizers.append(opt)
        with ampdoctor.watch(model, scaler, stats_every=1, save_bundle=False):
            for _ in range(steps):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(batch).float().pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)

    return run, model, scaler
