"""Non-finite gradients in a loop that no GradScaler guards (bfloat16, a disabled scaler, ``doctor.step()``).

With a scaler, GradScaler's own found-inf flags say that a step's gradients held inf/NaN (and it skips the
step). Without one nothing skips it: the optimizer applies NaN gradients and the weights are lost a step later,
with a finite loss meanwhile. :class:`GradCheck` gives the step's read-back, per device, one number that is
non-finite exactly when some gradient is (the sum of the gradients' L1 norms in float32: a NaN or an inf stays
in a sum); only on such a step does :meth:`GradCheck.nonfinite` name the parameters, from the per-parameter norms
already on the device (one more read) and an exact check of the flagged ones (a finite gradient whose norm
overflowed float32 is not named).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..capture import sharded

# Parameters named per step with a non-finite gradient (the report shows a few; the count says the rest).
MAX_NAMED = 16


def _l1_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's L1 norm in float32 (a float16 gradient's norm overflows float16 long before its values)."""
    try:
        return list(torch._foreach_norm(grads, 1, dtype=torch.float32))
    except (TypeError, RuntimeError):  # an older torch without the dtype, or a mix its foreach path refuses
        return [torch.linalg.vector_norm(g, 1, dtype=torch.float32) for g in grads]


class GradCheck:
    """The model's parameters' gradients at the step's end: finite or not, in the step's one read-back."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.root = root
        self._params: Optional[list[tuple[str, torch.nn.Parameter]]] = None  # found once: the structure is fixed
        self._norms: list[tuple[list[str], torch.Tensor]] = []  # this step, per device: names, per-parameter norms

    def values(self) -> list[torch.Tensor]:
        """Per device holding gradients, a 0-d float32 tensor: inf/NaN when a gradient there holds inf/NaN."""
        if self._params is None:
            self._params = [(name, p) for name, p in self.root.named_parameters()]  # shared ones once
        by_device: dict[torch.device, tuple[list[str], list[torch.Tensor]]] = {}
        for name, p in self._params:
            grad = p.grad
            if grad is None or not grad.is_floating_point() or grad.is_sparse:
                continue
            grad = sharded.local(grad).detach()
            names, grads = by_device.setdefault(grad.device, ([], []))
            names.append(name)
            grads.append(grad)
        self._norms = [(names, torch.stack(_l1_norms(grads))) for names, grads in by_device.values()]
        return [norms.sum() for _, norms in self._norms]

    def nonfinite(self) -> tuple[tuple[str, ...], int]:
        """After a non-finite value of :meth:`values`: the parameters whose gradient holds inf/NaN (at most
        ``MAX_NAMED``, in the model's order) and how many there are."""
        found: list[str] = []
        params = dict(self._params or [])
        for names, norms in self._norms:
            for name, norm in zip(names, norms.tolist()):
                if math.isfinite(norm):
                    continue
                grad = params[name].grad
                if grad is not None and not bool(torch.isfinite(sharded.local(grad)).all()):
                    found.append(name)  # not a finite gradient whose float32 norm overflowed
        self._norms = []
        return tuple(found[:MAX_NAMED]), len(found)

    def clear(self) -> None:
        """Forget the step's norms (no gradient kept alive between steps)."""
        self._norms = []
