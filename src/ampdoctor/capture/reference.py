"""Per-call float32 references (``diagnose(..., reference=True)``): one call at a time, never the whole model."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..records import Comparison
from .dtypes import to_fp32
from .state import RngState
from .stats import StatsCollector
from .walk import iter_tensors


class FloatReference:
    """Re-runs chosen calls in float32 under ``no_grad`` on the call's own inputs and compares the outputs.

    Never the whole model in float32 (the users who need this run out of memory there): one call at a time,
    both outputs dropped after the comparison. The RNG and the module's buffers are put back after each
    re-run so the AMP pass goes on exactly as without it.
    """

    def __init__(self, collector: StatsCollector, depth: Optional[int], device_type: str) -> None:
        self.collector = collector
        self.depth = depth  # None: leaf modules; n: modules n levels below the root (and shallower leaves)
        self.device_type = device_type
        self.busy = False
        self.pending: dict[int, tuple[Any, Any, RngState]] = {}
        self.compared: list[tuple[str, int, str, int]] = []  # module, call, path, values group

    def wants(self, module: nn.Module, name: str) -> bool:
        is_leaf = next(module.children(), None) is None
        if self.depth is None:
            return is_leaf
        level = 0 if name == "" else name.count(".") + 1
        return level == self.depth or (is_leaf and level < self.depth)

    def compare(
        self,
        module: nn.Module,
        name: str,
        number: int,
        inputs: tuple[Any, Any, RngState],
        output: Any,
    ) -> None:
        """``inputs``: the call's args, kwargs and the RNG state it started with (same dropout mask)."""
        args, kwargs, rng_before = inputs
        rng_after = RngState.capture()
        # The re-run updates copies of the buffers (BatchNorm statistics); the originals are swapped back
        # untouched, since the AMP forward may have saved them for its backward (an in-place restore would
        # bump their version and break that backward).
        swapped = []
        for owner in module.modules():
            for key, buf in owner._buffers.items():
                if buf is not None:
                    swapped.append((owner, key, buf))
                    owner._buffers[key] = buf.detach().clone()
        self.busy = True
        rng_before.restore()
        try:
            with torch.no_grad(), torch.autocast(self.device_type, enabled=False):
                reference = module(*tree_map(to_fp32, args), **tree_map(to_fp32, kwargs))
        finally:
            self.busy = False
            rng_after.restore()
            for owner, key, buf in swapped:
                owner._buffers[key] = buf
        low = dict(iter_tensors(output, "out"))
        for path, ref in iter_tensors(reference, "out"):
            got = low.get(path)
            if got is None or not ref.is_floating_point() or got.shape != ref.shape or not ref.numel():
                continue
            # Norms in float64: squares of tiny (subnormal) float32 values would underflow to 0 in float32.
            wide = torch.float32 if ref.device.type == "mps" else torch.float64
            signal = ref.to(wide).pow(2).sum()
            noise = (got.detach().to(wide) - ref.to(wide)).pow(2).sum()
            zero = torch.zeros((), dtype=wide, device=ref.device)
            inf = torch.full((), math.inf, dtype=wide, device=ref.device)
            # 0/0 (a call whose float32 output is all zero and matched exactly) is no error at all.
            relative = torch.where(signal > 0, (noise / signal).sqrt(), torch.where(noise > 0, inf, zero))
            sqnr = torch.where(noise > 0, 10 * torch.log10(signal / noise), inf)
            group = self.collector.add_values(
                [relative, sqnr, ((ref != 0) & (got == 0)).sum(), (ref != 0).sum()]
            )
            self.compared.append((name, number, path, group))

    def records(self) -> list[Comparison]:
        out = []
        for name, number, path, group in self.compared:
            rel, sqnr, underflow, nonzero = self.collector.values[group]
            out.append(Comparison(name, number, path, rel, sqnr, int(underflow), int(nonzero)))
        return out

