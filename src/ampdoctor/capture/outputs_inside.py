"""Which of the tensors a model returns its own code also read (a KV cache the attention read, embeddings the root
multiplied into logits): their gradients come partly from inside the model, so theirs is no "gradient of the
loss reaching the model" (analysis.origin.backward_origin)."""

from __future__ import annotations

from typing import Any

from .walk import iter_tensors


def outputs_used_inside(watch: Any, output: Any) -> list[tuple[int, str]]:
    """(root call, path) of each returned tensor (as :func:`.walk.iter_tensors` walks ``output``) whose values an
    op inside a module call read after they were made, itself or through a view of the same values: from the
    hidden-overflow watch's records (``watch``, a :class:`.hidden.HiddenWatch`, before it frees them), no walk of
    the autograd graph. The loss's ops (outside every call) and the views that return the tensor are no readers;
    neither are ops the watch did not see (a float32 pass has no watch: nothing is found there)."""
    calls = watch.recorder.calls
    if not calls or calls[0].parent is not None:
        return []
    root = calls[0].index
    where, nodes = watch._where, watch.nodes
    found = []
    for path, t in iter_tensors(output, "out"):
        entry = where.get(id(t))
        if entry is None or entry[0]() is not t:
            continue
        if any(nodes[c].call is not None for i in entry[1] for c in nodes[i].consumers):
            found.append((root, path))
    return found
