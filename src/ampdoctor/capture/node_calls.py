"""Which module call made each autograd node: the backward op zoom names the call whose forward made the node
where a gradient first went non-finite (a parameter shared by two modules, tied embeddings, has one gradient for
both: the node tells them apart)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

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

    def enter(self, index: int) -> None:
        if _next_node is not None:
            self._starts[index] = _next_node()

    def exit(self, index: int, module: str, number: int) -> None:
        first = self._starts.pop(index, None)
        if first is not None and _next_node is not None:
            self._ranges.append((first, _next_node(), module, number))

    def locate(self, node: int) -> Optional[tuple[str, int]]:
        """The innermost call that made node number ``node`` (the latest-started range holding it), if any."""
        best: Optional[tuple[int, int, str, int]] = None
        for r in self._ranges:
            if r[0] <= node < r[1] and (best is None or r[0] > best[0] or (r[0] == best[0] and r[1] < best[1])):
                best = r
        return (best[2], best[3]) if best is not None else None
