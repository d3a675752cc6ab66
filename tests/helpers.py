"""Checks shared by the tests: nothing the user owns may change, no hook may stay behind."""

from __future__ import annotations

import functools
import random
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

import ampdoctor


def _bits(t: torch.Tensor) -> bytes:
    """Raw bytes: torch.equal is False for NaN, so compare the storage itself."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@dataclass
class Snapshot:
    state: dict[str, bytes]
    grads: dict[str, Any]
    training: dict[str, bool]
    cpu_rng: bytes
    py_rng: Any
    np_rng: bytes
    hook_counts: dict[str, tuple[int, ...]]
    tensor_hooks: dict[str, Any]


def _tensor_hooks(p: torch.Tensor) -> Any:
    """A parameter's hook dict as it is: None, or (the dict, its keys). An empty dict left where there was none
    is a hook left behind too: torch calls into Python for it in every backward."""
    hooks = p._backward_hooks
    return None if hooks is None else (id(hooks), tuple(hooks))


def _hook_counts(module: nn.Module) -> tuple[int, ...]:
    return (
        len(module._forward_hooks),
        len(module._forward_pre_hooks),
        len(module._backward_hooks),
        len(getattr(module, "_backward_pre_hooks", {})),
        int("forward" in module.__dict__),  # an instance forward wrapper (the watch's) left behind
        int("__getstate__" in module.__dict__),
    )


def snapshot(model: nn.Module) -> Snapshot:
    return Snapshot(
        state={k: _bits(v) for k, v in model.state_dict(keep_vars=True).items()},
        grads={n: None if p.grad is None else _bits(p.grad) for n, p in model.named_parameters()},
        training={n: m.training for n, m in model.named_modules()},
        cpu_rng=_bits(torch.get_rng_state()),
        py_rng=random.getstate(),
        np_rng=np.random.get_state()[1].tobytes(),
        hook_counts={n: _hook_counts(m) for n, m in model.named_modules()},
        tensor_hooks={n: _tensor_hooks(p) for n, p in model.named_parameters()},
    )


def assert_untouched(model: nn.Module, before: Snapshot) -> None:
    after = snapshot(model)
    assert after.state == before.state, "parameters or buffers changed"
    assert after.grads == before.grads, ".grad fields changed"
    assert after.training == before.training, "training flags changed"
    assert after.cpu_rng == before.cpu_rng, "torch RNG state changed"
    assert after.py_rng == before.py_rng, "python RNG state changed"
    assert after.np_rng == before.np_rng, "numpy RNG state changed"
    assert after.hook_counts == before.hook_counts, "module hooks left behind"
    assert after.tensor_hooks == before.tensor_hooks, "tensor hook (or an emptied hook dict) left on a parameter"


_PACKAGE = Path(ampdoctor.__file__).resolve().parent
_DEMO = _PACKAGE / "demo.py"


@functools.cache
def is_library_file(filename: str) -> bool:
    """A file of the installed ampdoctor package (by its own directory, never by a path substring: a clone is
    itself a folder called ``ampdoctor``, and its tests are not library code). The demo model is user code."""
    if filename.startswith("<"):
        return False
    path = Path(filename).resolve()
    return path.is_relative_to(_PACKAGE) and path != _DEMO


def ampdoctor_frames_during(fn: Callable[[], Any]) -> list[str]:
    """Names of ampdoctor functions that ran while ``fn`` ran (module hooks, tensor hooks, global hooks).

    The built-in demo model's own code (ampdoctor/demo.py) is the user's model here, not instrumentation.
    """
    seen: list[str] = []

    def profiler(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and is_library_file(frame.f_code.co_filename):
            seen.append(frame.f_code.co_name)

    sys.setprofile(profiler)
    threading.setprofile(profiler)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return seen


def plain_amp_step(model: nn.Module, batch: torch.Tensor, dtype: torch.dtype = torch.float16) -> None:
    with torch.autocast("cpu", dtype=dtype):
        out = model(batch)
    out.float().sum().backward()
    model.zero_grad(set_to_none=True)


def constant_linear(n_in: int, n_out: int, value: float) -> nn.Linear:
    """A bias-free Linear whose every weight is ``value``: its output is ``n_in * value * x`` for a constant input,
    so a test can carry its expected answer in a comment."""
    layer = nn.Linear(n_in, n_out, bias=False)
    with torch.no_grad():
        layer.weight.fill_(value)
    return layer


def pass_spec(model: nn.Module, batch: torch.Tensor, backward: bool = True) -> Any:
    """A float16 CPU :class:`~ampdoctor.capture.passes.PassSpec` of one step of ``model`` on ``batch`` (no loss
    function: the output's sum), for tests that run a single pass."""
    from ampdoctor.capture.passes import PassSpec

    return PassSpec(
        root=model,
        names={id(m): n for n, m in model.named_modules()},
        params=list(model.named_parameters()),
        batch=batch,
        loss_fn=None,
        device_type="cpu",
        dtype=torch.float16,
        backward=backward,
    )


def amp_train(
    model: nn.Module, x: torch.Tensor, loss_of: Callable[[Any], torch.Tensor], steps: int = 20
) -> tuple[list[float], list[int]]:
    """``steps`` AdamW steps (lr 1e-3) on the same batch under CPU float16 autocast and GradScaler defaults:
    the losses, and the steps GradScaler skipped (the ones after which it lowered the scale)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    losses: list[float] = []
    skipped: list[int] = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of(model(x))
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < before:
            skipped.append(step)
        losses.append(float(loss.detach()))
    return losses, skipped
