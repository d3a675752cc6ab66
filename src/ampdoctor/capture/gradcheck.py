"""Non-finite gradients in a loop that no GradScaler guards (bfloat16, a disabled scaler, ``doctor.step()``).

With a scaler, GradScaler's own found-inf flags say that a step's gradients held inf/NaN (and it skips the
step). Without one nothing skips it: the optimizer applies NaN gradients and the weights are lost a step later,
with a finite loss meanwhile. :class:`GradCheck` gives the step's read-back, per device, one number that is
non-finite exactly when some gradient is (the sum of the gradients' L1 norms in float32: a NaN or an inf stays
in a sum); only on such a step does :meth:`GradCheck.nonfinite` name the parameters, from the per-parameter norms
already on the device (one more read) and an exact check of the flagged ones (one read more: a finite gradient
whose norm overflowed float32 is not named).

The parameters are listed again at every check (a parameter replaced after the watch started, by a re-init or
``resize_token_embeddings``, is checked too); a sparse gradient through its stored values (``nn.Embedding(sparse=
True)``); complex gradients are not checked.
"""

from __future__ import annotations

import math

import torch

from . import sharded

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
        # this step, per device: (parameters, their gradients as checked, per-parameter norms); dropped after the
        # read-back
        self._norms: list[tuple[list[torch.nn.Parameter], list[torch.Tensor], torch.Tensor]] = []

    def _parameters(self) -> list[torch.nn.Parameter]:
        """Every parameter of the model now, each once: a plain walk of the module tree (``named_parameters``
        builds every name, the larger part of this check's cost on a model of many small layers); names are
        made only for a step that needs them."""
        seen: set[int] = set()
        found: list[torch.nn.Parameter] = []
        stack = [self.root]
        while stack:
            module = stack.pop()
            for p in module._parameters.values():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    found.append(p)
            stack.extend(m for m in reversed(module._modules.values()) if m is not None)
        return found

    @torch.no_grad()
    def values(self) -> list[torch.Tensor]:
        """Per device holding gradients, a 0-d float32 tensor: inf/NaN when a gradient there holds inf/NaN."""
        params = [p for p in self._parameters() if p.grad is not None and p.grad.is_floating_point()]
        by_device: dict[torch.device, tuple[list[torch.nn.Parameter], list[torch.Tensor]]] = {}
        for p, grad in zip(params, sharded.locals_of([p.grad for p in params if p.grad is not None])):
            if grad.is_sparse:  # its stored values (float16 ones summed first, as GradScaler does: a sum overflows)
                grad = (grad.coalesce() if grad.dtype == torch.float16 else grad)._values()
            elif grad.layout != torch.strided:
                continue  # (CSR and other layouts: not checked)
            owners, grads = by_device.setdefault(grad.device, ([], []))
            owners.append(p)
            grads.append(grad)
        self._norms = [(owners, grads, torch.stack(_l1_norms(grads))) for owners, grads in by_device.values()]
        return [norms.sum() for _, _, norms in self._norms]

    def nonfinite(self) -> tuple[tuple[str, ...], int, bool]:
        """After a non-finite value of :meth:`values`: the parameters whose gradient holds inf/NaN (at most
        ``MAX_NAMED``, in the model's order), how many there are, and whether they hold NaN and no inf."""
        bad: set[int] = set()
        any_nan = any_inf = False
        for owners, grads, norms in self._norms:
            flagged = [i for i, norm in enumerate(norms.tolist()) if not math.isfinite(norm)]
            if not flagged:
                continue
            # one read for all flagged gradients: (holds NaN, holds inf) each
            marks = torch.stack([torch.stack([grads[i].isnan().any(), grads[i].isinf().any()]) for i in flagged])
            for i, (nan, inf) in zip(flagged, marks.tolist()):
                if nan or inf:  # else a finite gradient whose float32 norm overflowed
                    bad.add(id(owners[i]))
                    any_nan, any_inf = any_nan or bool(nan), any_inf or bool(inf)
        self._norms = []
        names = [name for name, p in self.root.named_parameters() if id(p) in bad]
        return tuple(names[:MAX_NAMED]), len(names), any_nan and not any_inf

    def clear(self) -> None:
        """Forget the step's norms and gradients (nothing kept alive between steps)."""
        self._norms = []
