"""Which module call made each autograd node: the backward op zoom names the call whose forward made the node
where a gradient first went non-finite (a parameter shared by two modules, tied embeddings, has one gradient for
both: the node tells them apart)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..records import LOSS

# The number the next autograd node made on this thread gets (nodes are numbered in the order they are made); a
# private torch function: without it, backward findings name no call, as before.
_next_node: Optional[Callable[[], int]] = getattr(torch._C._autograd, "_get_sequence_nr", None)


def available() -> bool:
    return _next_node is not None


class NodeCalls:
    """The autograd node numbers each module call of a forward made: [first, end) from its start to its end."""

    def __init__(self) -> None:
        self._starts: dict[int, int] = {}
        self._ranges: list[tuple[int, int, str, int]] = []  # (first, end, module, call number)
        self._backward_from: Optional[int] = None  # the first node number of the backward (recomputations)

    def backward_starts(self) -> None:
        """The forward and the loss are done: nodes from here on are the backward's own (a checkpoint's re-run)."""
        if _next_node is not None and self._backward_from is None:  # (a second backward of the same graph)
            self._backward_from = _next_node()

    def enter(self, index: int) -> None:
        if _next_node is not None:
            self._starts[index] = _next_node()

    def exit(self, index: int, module: str, number: int) -> None:
        first = self._starts.pop(index, None)
        if first is not None and _next_node is not None:
            self._ranges.append((first, _next_node(), module, number))

    def locate(self, node: int) -> Optional[tuple[str, int]]:
        """The innermost call that made node number ``node`` (the latest-started range holding it); ``(LOSS, 0)``
        for a node made after the model returned and before the backward (the loss function, the loss scale);
        else None (before the model ran, in the backward, on another thread: not known)."""
        best: Optional[tuple[int, int, str, int]] = None
        for r in self._ranges:
            if r[0] <= node < r[1] and (best is None or r[0] > best[0] or (r[0] == best[0] and r[1] < best[1])):
                best = r
        if best is not None:
            return best[2], best[3]
        model_end = max((r[1] for r in self._ranges), default=None)
        if model_end is not None and self._backward_from is not None and model_end <= node < self._backward_from:
            return LOSS, 0
        return None
