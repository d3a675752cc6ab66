"""One training step's measurements on the device, read back in one transfer (:class:`Collector`), and its pairs
folded per module (:func:`fold_pairs`) for the step's record (:mod:`.readback`).

The hooks write each (lo, hi) pair of a step with ``aminmax`` into the watch's reused buffers (:mod:`.fastpath`)
and queue a few other device values (the loss, the scale, GradScaler's found-inf flags); ``scaler.update`` reads
them all back at once (``update`` synchronises anyway).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

from .fastpath import Slabs

# What a (lo, hi) pair of the collector measures: a root output, a module output, or an output's gradient.
PairKind = Literal["root", "out", "grad", "op"]  # "op": an op inside a module (.optrack), module "<module>:<op>#<n>"


# What a pair is: its kind, its module ("" the root) and whether the tensor was in the low-precision format.
PairKey = tuple[PairKind, str, bool]
# One measured (lo, hi) pair: what it measures, the module ("" the root), its values, and whether the tensor was
# in the low-precision format.
Pair = tuple[PairKind, str, float, float, bool]


class Collector:
    """What one step measured, read back in one transfer per device: (lo, hi) pairs written into the watch's
    preallocated :class:`~.fastpath.Slabs` (no tensor per pair), and other device values (0-d, or 1-D blocks such
    as a compiled model's statistics buffer), with what each one is."""

    def __init__(self, slabs: Optional[Slabs] = None) -> None:
        self.slabs = slabs if slabs is not None else Slabs()
        self.values: list[torch.Tensor] = []  # 0-d, or 1-D blocks (each spans block.numel() numbers)
        self._starts: list[int] = []  # index of each value's first number
        # Per pair, in put order: its key (kind, module, low dtype), a tuple made once per module and dtype by the
        # hooks, so a pair allocates nothing the garbage collector tracks (with statistics every step, a tuple per
        # tensor made collections of the whole heap a measurable share of it). The index of each pair's lo is in
        # its slab's ``ats`` (:meth:`_pair_ats` puts them in put order).
        self._keys: list[PairKey] = []
        self.size = 0  # numbers in all values and pairs
        self.small: list[tuple[int, int]] = []  # (index of [zeros, below tiny], numel) of low-precision gradients
        self.ops = 0  # "op" pairs put (:meth:`op_pairs` walks the keys only when there are some)

    def add(self, value: torch.Tensor) -> int:
        """A 0-d value, or a 1-D block; returns the index of its (first) number."""
        index = self.size
        self.values.append(value)
        self._starts.append(index)
        self.size = index + value.numel()
        return index

    def pair(self, kind: PairKind, module: str, t: torch.Tensor, low: bool) -> int:
        """The (lo, hi) of ``t`` (detached), one pass on the device; returns the index of lo (hi follows)."""
        if kind == "op":
            self.ops += 1
        return self.put((kind, module, low), t)

    def put(self, key: PairKey, t: torch.Tensor) -> int:
        """:meth:`pair` with its key made beforehand (the hooks' hot path: one call, nothing allocated but
        Python ints). ``aminmax`` writes straight into the next row of the watch's slab for ``t``'s device and
        dtype."""
        slabs = self.slabs
        slab = slabs.last
        if slabs.owner is not self or slab.dtype is not t.dtype or slab.device != t.device:
            slab = slabs.find(self, t)  # a new step's first pair, or another dtype or device than the last
        ats = slab.ats
        i = len(ats)  # the slab's next row
        if i == len(slab.rows):
            slab.grow()
        torch.aminmax(t, out=slab.rows[i])  # one pass; NaN and inf show up in the result
        at = self.size
        self.size = at + 2
        ats.append(at)
        self._keys.append(key)
        return at

    def underflow(self, g: torch.Tensor) -> None:
        """Count a low-precision gradient's zeros and its values below the smallest normal (two reductions)."""
        tiny = torch.finfo(g.dtype).tiny
        self.small.append((self.add(torch.stack([(g == 0).sum(), (g.abs() < tiny).sum()])), g.numel()))

    def underflow_share(self, numbers: list[float]) -> Optional[float]:
        """Of the nonzero low-precision gradient values counted, the share below the smallest normal (subnormal:
        losing bits, and flushed to zero by the next halving of the scale); None when none was counted."""
        nonzero = sum(n - numbers[i] for i, n in self.small)
        if not self.small or nonzero <= 0:
            return None
        return sum(numbers[i + 1] - numbers[i] for i, _ in self.small) / nonzero

    def _pair_ats(self) -> Sequence[int]:
        """The index of each pair's lo, in put order: a step's indices grow with every put, so the slabs' own lists
        merged in order (one slab, the common case: its list as it is)."""
        blocks = self.slabs.blocks(self)
        if len(blocks) == 1:
            return blocks[0][1]
        return sorted(at for _, ats in blocks for at in ats)

    def pairs(self, numbers: list[float]) -> list[Pair]:
        return [(key[0], key[1], numbers[i], numbers[i + 1], key[2]) for i, key in zip(self._pair_ats(), self._keys)]

    def op_pairs(self, numbers: list[float]) -> list[Pair]:
        """The "op" pairs only (none: no walk over the step's pairs)."""
        if not self.ops:
            return []
        return [(key[0], key[1], numbers[i], numbers[i + 1], key[2]) for i, key in zip(self._pair_ats(), self._keys)
                if key[0] == "op"]

    def fold(self, numbers: list[float], before: float, folded: Folded) -> None:
        """Fold every pair of the step into ``folded`` (:func:`fold_pairs`), straight from the keys and indices:
        no tuple per pair."""
        fold_pairs(self._keys, self._pair_ats(), numbers, before, folded)

    def read(self) -> list[float]:
        """Every number as a Python float: per device one ``cat`` of the slabs' used rows and the other values,
        widened to float64 (exact for every floating format), and one ``tolist``. The numbers go to their indices
        by a Python loop when the pairs are few, else by one scatter on the host (no loop over hundreds of pairs:
        statistics every step on a deep model)."""
        if not self.size:
            return []
        blocks = self.slabs.blocks(self)
        if len(blocks) <= 1:
            quick = self._read_one_slab(blocks[0][0] if blocks else None)
            if quick is not None:
                return quick
        by_device: dict[torch.device, list[tuple[torch.Tensor, Optional[array[int]], int]]] = {}
        for flat_pairs, pair_ats in blocks:  # pairs: lo at each index in ats, hi right after
            by_device.setdefault(flat_pairs.device, []).append((flat_pairs, pair_ats, 0))
        for v, start in zip(self.values, self._starts):
            by_device.setdefault(v.device, []).append((v.detach().reshape(-1), None, start))
        numbers: list[float] = [math.nan] * self.size
        for parts in by_device.values():  # one device, unless the model is split across devices
            flat = torch.cat([p.to(torch.float64) for p, _, _ in parts]) if len(parts) > 1 else parts[0][0].double()
            if sum(len(ats) for _, ats, _ in parts if ats is not None) >= SCATTER_PAIRS:
                _scatter(numbers, flat.cpu(), parts)
                continue
            values = flat.tolist()
            k = 0
            for block, ats, start in parts:
                if ats is not None:
                    for at in ats:
                        numbers[at] = values[k]
                        numbers[at + 1] = values[k + 1]
                        k += 2
                else:
                    n = block.numel()
                    numbers[start : start + n] = values[k : k + n]
                    k += n
        return numbers


    def _read_one_slab(self, flat_pairs: Optional[torch.Tensor]) -> Optional[list[float]]:
        """:meth:`read` of the common step: its pairs in one slab (one dtype), on the device of every value. One
        ``cat`` (its type promotion widens every floating part exactly; integer parts are made float64 first) and
        one ``tolist``; the pairs' numbers, in the slab's row order, are the order of the step's indices between
        the values, so the numbers are put in place by list slices around the values (no loop over the pairs).
        None when the values are on another device than the pairs (the general path)."""
        parts = [] if flat_pairs is None else [flat_pairs]
        device = None if flat_pairs is None else flat_pairs.device
        for v in self.values:
            if device is None:
                device = v.device
            elif v.device != device:
                return None
            if v.dim() != 1:
                v = v.reshape(-1)  # cat takes no 0-d tensor (values are detached: no graph either)
            parts.append(v if v.is_floating_point() else v.double())
        flat = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
        n_pairs = 0 if flat_pairs is None else flat_pairs.numel()
        if not self.values:
            return flat  # type: ignore[no-any-return]
        numbers: list[float] = []
        taken = 0  # pair numbers placed so far
        k = n_pairs  # the next value's first number in ``flat``
        for v, start in zip(self.values, self._starts):
            if start > len(numbers):  # the pairs put before this value
                more = start - len(numbers)
                numbers += flat[taken : taken + more]
                taken += more
            n = v.numel()
            numbers += flat[k : k + n]
            k += n
        numbers += flat[taken:n_pairs]
        return numbers


# From this many pairs on a device, the read-back places its numbers by a scatter on the host (a few fixed-cost
# tensor ops) rather than a Python loop over the pairs (about a tenth of a microsecond each).
SCATTER_PAIRS = 256


def _scatter(
    numbers: list[float], flat: torch.Tensor, parts: list[tuple[torch.Tensor, Optional[array[int]], int]]
) -> None:
    """Put one device's numbers (``flat``, float64 on the host, in the order of ``parts``) at their indices."""
    places = []
    for block, ats, start in parts:
        if ats is not None:
            at = torch.frombuffer(ats, dtype=torch.long)  # no copy: used at once
            places.append(torch.stack((at, at + 1), 1).reshape(-1))
        else:
            places.append(torch.arange(start, start + block.numel()))
    if len(numbers) == flat.numel():  # the only device: every index is filled
        out = torch.empty(len(numbers), dtype=torch.float64)
        out[torch.cat(places)] = flat
        numbers[:] = out.tolist()
        return
    index = torch.cat(places).tolist()
    for i, value in zip(index, flat.tolist()):
        numbers[i] = value


def bad_pair(lo: float, hi: float) -> bool:
    """Non-finite, unless the only non-finite values are ``-inf`` (an additive mask, not an overflow)."""
    return math.isnan(lo) or math.isnan(hi) or hi == math.inf


@dataclass
class Folded:
    """A sampled step's pairs folded per module: the largest finite |x| of its low-precision outputs and of its
    (unscaled) output gradients, and the modules with a non-finite output or gradient, in completion order.
    ``out_max`` is a plain dict for the forecast to read (a record's FrozenMap reads each key through a call)."""

    out_max: dict[str, float] = field(default_factory=dict)
    grad_max: dict[str, float] = field(default_factory=dict)
    bad_out: list[str] = field(default_factory=list)
    bad_grad: list[str] = field(default_factory=list)


def fold_pairs(
    keys: Sequence[PairKey], ats: Iterable[int], numbers: Sequence[float], before: float, folded: Folded
) -> None:
    """Fold pairs (``keys[k]`` measured lo ``numbers[ats[k]]``, hi right after) into ``folded``: one plain loop over
    every pair of the step, no call per pair."""
    out_max, grad_max, bad_out, bad_grad = folded.out_max, folded.grad_max, folded.bad_out, folded.bad_grad
    inf = math.inf
    for (kind, module, low), i in zip(keys, ats):  # a "root" pair is the root's output (module "")
        if kind == "op":
            continue  # op trends are the forecast's (.optrack), not the step record's
        lo = numbers[i]
        hi = numbers[i + 1]
        if lo != lo or hi != hi or hi == inf:  # bad_pair, inline: NaN, or +inf (a -inf alone is a mask)
            bad = bad_grad if kind == "grad" else bad_out
            if module not in bad:
                bad.append(module)
            continue
        if not low:
            continue  # only tensors in the low-precision format can overflow it
        value = hi if hi >= 0 else -hi
        if lo != -inf and -lo > value:  # -inf masks: the finite side
            value = -lo
        if kind == "grad":
            if before:
                value /= before  # gradients are stored unscaled, like everywhere else
            if value > grad_max.get(module, -1.0):
                grad_max[module] = value
        elif value > out_max.get(module, -1.0):
            out_max[module] = value
