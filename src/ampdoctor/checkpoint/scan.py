"""Static scan of saved checkpoints (``ampdoctor.scan``): walk each loaded file and measure its tensors.

A directory of shards is read one file at a time (memory-mapped where the format allows) and each file's tensors
are measured and let go before the next file is opened. Loading goes through :mod:`.safe_load`.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from .._version import __version__
from ..errors import AmpDoctorError, CheckpointRefused
from ..records import TensorStats
from .safe_load import checkpoint_files, first_line, load_file, refusal
from .scan_analysis import MOMENT_KEYS, analyse_scan
from .scan_records import OptimizerInfo, ScalerInfo, ScannedFile, ScannedTensor, ScanReport

if TYPE_CHECKING:
    import torch

_MAX_DEPTH = 32  # nesting guard for the walk through a loaded object

ProgressFn = Callable[[int, int, str], None]  # (index, total, file name) before each file


def is_optimizer_state(obj: Mapping[Any, Any]) -> bool:
    return isinstance(obj.get("state"), Mapping) and isinstance(obj.get("param_groups"), (list, tuple))


def is_scaler_state(obj: Mapping[Any, Any]) -> bool:
    return "scale" in obj and "_growth_tracker" in obj


def number(value: Any) -> Optional[float]:
    try:
        return float(value)  # a Python number or a 0-d tensor
    except (TypeError, ValueError, RuntimeError):
        return None


def join_key(prefix: str, key: Any) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


@dataclass
class _Pending:
    name: str
    role: str
    saved_on: str
    param: str
    slot16: int  # -1: not measured (sparse, quantized or other non-strided tensors); see ``unmeasured``
    slot_bf16: int
    unmeasured: Optional[TensorStats] = None


class _FileScan:
    """Measures every floating tensor in one loaded object; nothing of the object is kept after :meth:`read`."""

    def __init__(self, file: str, locations: Mapping[int, str]) -> None:
        import torch

        from ..capture.stats import StatsCollector

        self._torch = torch
        self.file = file
        self.locations = locations
        self.fp16 = StatsCollector(torch.float16, detailed=True)
        self.bf16 = StatsCollector(torch.bfloat16, detailed=True)
        self.pending: list[_Pending] = []
        self.optimizers: list[OptimizerInfo] = []
        self.scalers: list[ScalerInfo] = []

    def visit(self, obj: Any, name: str = "", role: str = "weights", param: str = "", depth: int = 0) -> None:
        torch = self._torch
        if depth > _MAX_DEPTH:
            return
        if isinstance(obj, torch.Tensor):
            self._add(obj, name, role, param)
        elif isinstance(obj, torch.nn.Module):  # a whole pickled model (only with unsafe_load)
            self.visit(obj.state_dict(), name, role, param, depth + 1)
        elif isinstance(obj, Mapping):
            if is_optimizer_state(obj):
                self._visit_optimizer(obj, name, depth)
                return
            if is_scaler_state(obj):
                self._record_scaler(obj, name)
                role = "scaler"
            for key, value in obj.items():
                self.visit(value, join_key(name, key), role, param, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                self.visit(value, join_key(name, i), role, param, depth + 1)
        elif isinstance(obj, argparse.Namespace):
            self.visit(vars(obj), name, role, param, depth + 1)
        elif type(obj).__module__ == "numpy" and type(obj).__name__ == "ndarray":
            if obj.dtype.kind == "f" and obj.dtype.itemsize in (2, 4, 8):
                self._add(torch.from_numpy(obj), name, role, param)

    def _add(self, tensor: torch.Tensor, name: str, role: str, param: str) -> None:
        torch = self._torch
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.device.type != "cpu":
            stats = TensorStats(dtype=str(tensor.dtype).replace("torch.", ""), shape=tuple(tensor.shape))
            self.pending.append(_Pending(name, role, "", param, -1, -1, stats))
            return
        try:
            saved_on = self.locations.get(tensor.untyped_storage().data_ptr(), "")
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
            saved_on = ""
        self.pending.append(_Pending(name, role, saved_on, param, self.fp16.add(tensor), self.bf16.add(tensor)))

    def _visit_optimizer(self, obj: Mapping[Any, Any], name: str, depth: int) -> None:
        groups = [g for g in obj["param_groups"] if isinstance(g, Mapping)]
        names: dict[Any, str] = {}  # state index -> parameter name (torch >= 2.6 records them)
        for g in groups:
            ids, pnames = g.get("params", []), g.get("param_names", [])
            if isinstance(ids, (list, tuple)) and isinstance(pnames, (list, tuple)):
                names.update(zip(ids, (str(n) for n in pnames)))
        dtypes: set[str] = set()
        state = obj["state"]
        for index, per_param in state.items():
            where = join_key(join_key(name, "state"), index)
            if isinstance(per_param, Mapping):
                for key, value in per_param.items():
                    if isinstance(value, self._torch.Tensor) and key in MOMENT_KEYS:
                        dtypes.add(str(value.dtype).replace("torch.", ""))
                    self.visit(value, join_key(where, key), "optimizer", names.get(index, ""), depth + 2)
            else:
                self.visit(per_param, where, "optimizer", names.get(index, ""), depth + 2)
        eps = [e for e in (number(g.get("eps")) for g in groups) if e is not None]
        self.optimizers.append(
            OptimizerInfo(
                path=name,
                file=self.file,
                states=len(state),
                param_groups=len(groups),
                eps=eps,
                state_dtypes=sorted(dtypes),
                param_names=list(names.values()),
            )
        )

    def _record_scaler(self, obj: Mapping[Any, Any], name: str) -> None:
        scale = number(obj.get("scale"))
        if scale is None:
            return
        tracker = number(obj.get("_growth_tracker"))
        interval = number(obj.get("growth_interval"))
        self.scalers.append(
            ScalerInfo(
                path=name,
                file=self.file,
                scale=scale,
                growth_tracker=None if tracker is None else int(tracker),
                growth_factor=number(obj.get("growth_factor")),
                backoff_factor=number(obj.get("backoff_factor")),
                growth_interval=None if interval is None else int(interval),
            )
        )

    def read(self) -> list[ScannedTensor]:
        """One read-back per collector for the whole file."""
        stats16, stats_bf16 = self.fp16.read(), self.bf16.read()
        out = []
        for p in self.pending:
            if p.unmeasured is not None:
                out.append(ScannedTensor(p.name, self.file, p.role, p.unmeasured, param=p.param))
                continue
            bf16 = stats_bf16[p.slot_bf16]
            out.append(
                ScannedTensor(
                    name=p.name,
                    file=self.file,
                    role=p.role,
                    stats=stats16[p.slot16],
                    bf16_overflow_count=bf16.cast_overflow_count,
                    bf16_flush_count=bf16.cast_flush_count,
                    saved_on=p.saved_on,
                    param=p.param,
                )
            )
        return out


def _count_locations(tensors: Iterable[ScannedTensor]) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for t in tensors:
        if t.saved_on:
            counts[t.saved_on] += 1
    return dict(counts)


def _scan_file(
    path: Path, label: str, allow_globals: Sequence[str], unsafe_load: bool
) -> tuple[ScannedFile, list[ScannedTensor], list[OptimizerInfo], list[ScalerInfo]]:
    """Load, measure and let go of one file: its tensors are unreachable when this returns."""
    loaded = load_file(path, allow_globals, unsafe_load)
    scan = _FileScan(label, loaded.locations)
    try:
        scan.visit(loaded.obj)
    except AmpDoctorError:
        raise
    except Exception as exc:  # e.g. a safetensors tensor that cannot be read: one line
        detail = f"{type(exc).__name__}: {first_line(str(exc))}"
        raise AmpDoctorError(f"{path}: could not read its tensors: {detail}") from exc
    fmt, mapped = loaded.format, loaded.memory_mapped
    del loaded
    tensors = scan.read()
    empty = not tensors and not scan.scalers and not scan.optimizers
    info = ScannedFile(
        name=label,
        format=fmt,
        size_bytes=path.stat().st_size,
        tensors=len(tensors),
        memory_mapped=mapped,
        saved_on=_count_locations(tensors),
        skipped="holds no tensors" if empty else "",
    )
    return info, tensors, scan.optimizers, scan.scalers


def scan(
    path: str | Path,
    *,
    dtype: str = "float16",
    allow_globals: Sequence[str] = (),
    unsafe_load: bool = False,
    progress: Optional[ProgressFn] = None,
) -> ScanReport:
    """Scan a saved checkpoint for values that break mixed precision; no model code is needed.

    Args:
        path: a ``torch.save``d state dict or training checkpoint (model / optimizer / scaler, nested), a
            ``.safetensors`` file, or a directory of such files (shards; read one at a time).
        dtype: the autocast format the verdict is about: ``"float16"`` (default) or ``"bfloat16"``. Counts for
            both are always reported.
        allow_globals: names such as ``"argparse.Namespace"`` to allow in ``torch.load(weights_only=True)``; a
            refusal (:class:`CheckpointRefused`) lists the ones a file needs.
        unsafe_load: last resort, ``weights_only=False``: runs any code the file holds (warns).
        progress: called as ``progress(index, total, file_name)`` before each file.

    The checkpoint is only read: nothing is written next to it. Raises :class:`AmpDoctorError` with one line
    for a missing, empty, truncated, corrupt or refused input. In a directory, files that are refused are
    skipped with a warning finding (naming their globals), and files without tensors with a note, as long as
    another file holds tensors.
    """
    import torch

    if dtype not in ("float16", "bfloat16"):
        raise AmpDoctorError(f"dtype must be 'float16' or 'bfloat16', got {dtype!r}")
    from ..capture.stats import format_limits

    limits = format_limits(getattr(torch, dtype))
    root = Path(path)
    files = checkpoint_files(root)
    scanned: list[ScannedFile] = []
    tensors: list[ScannedTensor] = []
    optimizers: list[OptimizerInfo] = []
    scalers: list[ScalerInfo] = []
    refusals: list[CheckpointRefused] = []
    for index, file in enumerate(files):
        label = file.name
        if progress is not None:
            progress(index, len(files), label)
        try:
            info, found, opts, scs = _scan_file(file, label, allow_globals, unsafe_load)
        except CheckpointRefused as refused:
            if not root.is_dir():
                raise
            refusals.append(refused)
            size = file.stat().st_size
            scanned.append(ScannedFile(label, "torch", size, skipped="refused", refused=refused.blocking))
            continue
        scanned.append(info)
        tensors += found
        optimizers += opts
        scalers += scs
    if all(f.skipped for f in scanned):
        if refusals:
            raise refusal(str(root), list(dict.fromkeys(n for r in refusals for n in r.blocking)))
        where = "no file in it holds" if root.is_dir() else "loaded, but holds no"
        raise AmpDoctorError(f"{path}: {where} tensors: not a checkpoint")
    findings = analyse_scan(tensors, optimizers, scalers, scanned, limits)
    return ScanReport(
        path=str(path),
        dtype=dtype,
        limits=limits,
        files=scanned,
        tensors=tensors,
        optimizers=optimizers,
        scalers=scalers,
        findings=findings,
        torch_version=torch.__version__,
        ampdoctor_version=__version__,
    )

