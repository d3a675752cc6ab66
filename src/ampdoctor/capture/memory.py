"""Memory: what the machine has free, what a pass is expected to add (from the survey's records), and whether an
exception means "out of memory".

On CUDA an out-of-memory error is an exception the diagnosis can record and survive. On a CPU the allocator
raises too, but under memory overcommit the process is often killed outright, so an optional pass whose
estimated peak does not fit is skipped before it runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any, Optional

import torch

from ..records import PassTrace
from .stats import chunk_size

_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1}
_OOM_TEXT = ("out of memory", "can't allocate memory", "not enough memory", "failed to allocate")


def is_out_of_memory(exc: BaseException) -> bool:
    """The exception, or one it was raised from, is an allocator's out-of-memory error."""
    seen: Optional[BaseException] = exc
    while seen is not None:
        if isinstance(seen, torch.OutOfMemoryError) or (
            isinstance(seen, (RuntimeError, MemoryError)) and any(t in str(seen).lower() for t in _OOM_TEXT)
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Optional[Any]:
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, Windows, musl)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def trim_host_heap() -> bool:
    """Hand the host heap's free pages back to the system (glibc's ``malloc_trim(0)``; a few milliseconds).

    A pass makes and frees thousands of small tensors and records; the C heap keeps the freed pages, scattered
    between live blocks, so without this every pass of a diagnosis would start from a higher resident size than
    the last, and its own peak (the step's activations, allocated afresh) would add on top. Returns whether the
    C library could do it (False elsewhere: nothing is done)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def available_bytes(device_type: str) -> Optional[int]:
    """Memory a diagnosis can still use: the CUDA device's free memory plus what the caching allocator holds
    unused, or the host's ``MemAvailable`` (Linux). None when it cannot be told."""
    if device_type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return int(free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated())
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _bytes(dtype: str, numel: int, as_float32: bool = False) -> int:
    size = _BYTES.get(dtype, 4)
    if as_float32 and dtype in ("float16", "bfloat16"):
        size = 4
    return numel * size


def pass_estimate(survey: PassTrace, kind: str) -> int:
    """The expected peak a pass adds, from the survey: the tensors its forward recorded (one count per tensor
    object) stand for what autograd keeps for the backward, plus the two largest tensors in flight.

    ``kind``: "survey" (a pass like the survey: same-dtype verification re-runs too), "detailed" (plus the
    chunked scratch of the detailed statistics), "float32" (low-precision activations held in float32), or
    "backward" (a backward on a graph already in memory: only the gradients in flight).
    """
    float32 = kind == "float32"
    sizes: dict[int, int] = {}
    for call in survey.calls:
        for record in (*call.inputs, *call.outputs):
            if record.ref >= 0:
                sizes.setdefault(record.ref, _bytes(record.stats.dtype, record.stats.numel, float32))
    largest = sorted(sizes.values(), reverse=True)[:2]
    in_flight = 2 * sum(largest)
    if kind == "backward":
        return in_flight
    largest_numel = max((r.stats.numel for call in survey.calls for r in (*call.inputs, *call.outputs)), default=0)
    scratch = 16 * chunk_size(largest_numel) if kind == "detailed" else 0
    return sum(sizes.values()) + in_flight + scratch


def describe(n: int) -> str:
    """Bytes as a report says them: MiB, KiB, or bytes below one KiB (never "0 KiB" for a limit of 0 or 300 B)."""
    if n >= 2**20:
        return f"{n / 2**20:.0f} MiB"
    return f"{n / 1024:.0f} KiB" if n >= 1024 else f"{n} B"
