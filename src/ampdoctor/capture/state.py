"""The user's state: the one snapshot / rewind / restore of RNG streams, buffers and training flags.

Every re-run of a diagnosis, a watch capture, a bundle and its replay use :class:`RngState` for the random
streams (torch CPU, every initialised CUDA device, Python, numpy), so re-runs draw the same dropout masks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch import nn


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

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None and _cuda_ready():
            torch.cuda.set_rng_state_all(list(self.cuda))
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


class StateGuard:
    """Saves what a forward may change (RNG streams, buffers, train/eval flags) and puts it back exactly.

    Parameters and ``.grad`` are never written by a pass (gradients are taken with ``torch.autograd.grad``),
    so they need no copy.
    """

    def __init__(self, model: nn.Module, rng: Optional[RngState] = None) -> None:
        self.rng = rng or RngState.capture()
        self.buffers: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []
        # Which buffer names each module had (None entries included): a forward that fills a lazy cache
        # (register_buffer("cache", None), then set in forward) or adds a buffer is undone too.
        self.buffer_names = [(m, dict(m._buffers)) for m in model.modules()]
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    self.buffers.append((module, name, buf, buf.detach().clone()))
        self.training = [(m, m.training) for m in model.modules()]

    def rewind(self) -> None:
        self.rng.restore()
        for module, before in self.buffer_names:
            for name in [n for n in module._buffers if n not in before]:
                del module._buffers[name]
            for name, value in before.items():
                if value is None:
                    module._buffers[name] = None
        with torch.no_grad():
            for module, name, original, saved in self.buffers:
                if module._buffers.get(name) is not original:  # a forward that re-assigned the buffer
                    module._buffers[name] = original
                original.copy_(saved)
        for module, flag in self.training:
            module.training = flag
