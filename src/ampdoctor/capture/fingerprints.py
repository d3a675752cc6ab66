"""Fingerprints of tensors: two integer checksums of each tensor's bytes, computed on its device and read back at
once, so that a diagnosis can name a parameter or buffer that code it could not see (a C++ extension) wrote."""

from __future__ import annotations

import array

import torch

from .stats import chunks

# Fingerprints read tensors in chunks of this many elements (no full-size temporaries).
_FINGERPRINT_CHUNK = 1 << 22


def fingerprints(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Two integer checksums of each tensor's bytes, computed on the tensor's device and read back once: a cheap
    test that nothing wrote a tensor (any single changed element moves the first). Small contiguous tensors are
    summed together (:func:`_batched_checksums`: per device and dtype, one concatenation and a few whole-batch
    kernels, not a few ops per tensor: a model of 10,000 small layers has 20,000 parameters); a larger one alone,
    as wrapping sums of its 64-bit and 32-bit words (same-type sums run at memory speed; no temporaries)."""
    blocks: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = {}
    small: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        sparse = t.layout != torch.strided
        if not sparse and t.is_contiguous() and 0 < t.nbytes <= _BATCH_FINGERPRINT_BYTES and t.dtype in _WORDS:
            device = t.device
            if device.type != "meta":
                small.setdefault((device, t.dtype), []).append(i)
                continue
        total = torch.zeros(2, dtype=torch.int64, device=t.device)
        for flat in _sparse_parts(t.detach()) if sparse else (t.detach(),):
            if flat.numel() and not flat.is_complex() and flat.device.type != "meta":
                for chunk in chunks(flat, _FINGERPRINT_CHUNK):
                    total += _checksums(chunk)
        blocks.setdefault(t.device, []).append(([i], total.reshape(1, 2)))
    for (device, _), at in small.items():
        for start in range(0, len(at), _BATCH_TENSORS):
            part = at[start : start + _BATCH_TENSORS]
            blocks.setdefault(device, []).append((part, _batched_checksums([tensors[i] for i in part])))
    out: list[tuple[int, int]] = [(0, 0)] * len(tensors)
    for parts in blocks.values():  # one readback per device, not one per tensor
        numbers = torch.cat([block for _, block in parts]).tolist()
        for i, (a, b) in zip([i for at, _ in parts for i in at], numbers):
            out[i] = (int(a), int(b))
    return out


# Tensors up to this many bytes are fingerprinted together, at most this many at a time (their scratch: about 24
# bytes an element).
_BATCH_FINGERPRINT_BYTES = 1 << 16
_BATCH_TENSORS = 1 << 12
# The integer type of each element size: a tensor's elements are read as these (every bit pattern distinct).
_WORDS = {
    dtype: {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
                  torch.int32, torch.int64, torch.bool, *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2")
                                                              if hasattr(torch, n)))
}


def _sparse_parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The dense tensors a sparse one is stored as (indices and values): a write to either moves its fingerprint."""
    if t.layout == torch.sparse_coo:
        return (t._indices(), t._values())
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return (t.crow_indices(), t.col_indices(), t.values())
    return (t.ccol_indices(), t.row_indices(), t.values())


def _batched_checksums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(n, 2) int64 checksums of small contiguous tensors of one device and dtype, all at once: their elements
    concatenated (one C++ call), read as integers of the same width (bit patterns, so -0.0 and NaN payloads
    count), widened to int64; per tensor the wrapping sum of the elements, and of the elements times their
    position in the concatenation (a different mix of the same bits), from two running sums."""
    with torch.no_grad():
        flat = torch._utils._flatten_dense_tensors(tensors)
    words = flat.view(_WORDS[flat.dtype]).to(torch.int64)
    ends = torch.tensor([t.numel() for t in tensors], device=words.device).cumsum_(0).sub_(1)
    position = torch.arange(1, words.numel() + 1, dtype=torch.int64, device=words.device)
    # Out of place: ``words`` may be the tensor itself (a lone int64 tensor flattens to a view of it, and widens
    # to itself), and a fingerprint never writes what it reads.
    totals = torch.stack((words.cumsum(0), (words * position).cumsum_(0)), 1)[ends]
    totals[1:] -= totals[:-1].clone()  # running sums at each tensor's end, minus the previous end's
    return totals


def _checksums(chunk: torch.Tensor) -> torch.Tensor:
    chunk = chunk.contiguous()  # a strided 1-D piece (reshape keeps it as it is) cannot be viewed as bytes
    data = chunk.view(torch.uint8)
    whole = data.numel() // 8 * 8 if chunk.storage_offset() * chunk.element_size() % 8 == 0 else 0
    main, tail = data[:whole], data[whole:]
    out = torch.zeros(2, dtype=torch.int64, device=chunk.device)
    if whole:
        out[0] += main.view(torch.int64).sum()
        out[1] += main.view(torch.int32).sum(dtype=torch.int32).to(torch.int64)
    if tail.numel():
        out += tail.to(torch.int64).sum()
    return out


def packed(pairs: list[tuple[int, int]]) -> array.array[int]:
    """Fingerprints kept for the whole diagnosis: 16 bytes a tensor, not a tuple of two integers."""
    return array.array("q", [v for pair in pairs for v in pair])
