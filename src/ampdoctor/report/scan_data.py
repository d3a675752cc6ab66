"""The data of a checkpoint scan's report: the scan's records, its findings, and how they are read.

Pure (no torch). The renderers read a :class:`ScanReportData`; :class:`~.scan_report.ScanReport` adds the methods
that call them, so no renderer imports the module that imports it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import ClassVar, Optional

from ..analysis.headroom import headroom_bits
from ..records import FormatLimits
from ..records.scan import (
    SCAN_SCHEMA_VERSION,
    VERDICT_ORDER,
    ModuleSummary,
    OptimizerInfo,
    ScalerInfo,
    ScanFinding,
    ScannedFile,
    ScannedTensor,
    ScanVerdict,
    StorageFormat,
)
from ..serial import SavedReport


@dataclass(frozen=True)
class ScanReportData(SavedReport):
    """What :func:`scan` found in a checkpoint, as data (:class:`~.scan_report.ScanReport` renders it)."""

    SCHEMA: ClassVar[str] = SCAN_SCHEMA_VERSION
    KIND: ClassVar[str] = "scan report"

    path: str
    dtype: str  # the format the verdict is about ("float16" or "bfloat16")
    limits: FormatLimits
    files: tuple[ScannedFile, ...]
    tensors: tuple[ScannedTensor, ...]
    optimizers: tuple[OptimizerInfo, ...]
    scalers: tuple[ScalerInfo, ...]
    findings: tuple[ScanFinding, ...]
    torch_version: str
    ampdoctor_version: str
    schema_version: str = SCAN_SCHEMA_VERSION
    storage_formats: tuple[StorageFormat, ...] = ()  # narrow formats (float8) found, with their own limits
    notes: tuple[str, ...] = ()  # what the scan could not do, and library warnings raised while reading

    @property
    def verdict(self) -> ScanVerdict:
        """``overflow``, ``nan``, ``underflow`` (from error findings, in that order of priority), else
        ``incomplete`` when files that may hold weights could not be read, else ``healthy``."""
        seen = {f.verdict for f in self.findings if f.severity == "error"}
        found = next((v for v in VERDICT_ORDER if v in seen), None)
        return found or ("incomplete" if self.incomplete else "healthy")

    @property
    def incomplete(self) -> bool:
        """Files that may hold weights could not be read: absent shards an index names, dangling links ..."""
        return any(f.missed for f in self.files)

    @property
    def exit_code(self) -> int:
        """CLI convention: 0 healthy or warnings only, 1 a finding, 2 an incomplete scan (whatever it found)."""
        if self.incomplete:
            return 2
        return 0 if self.verdict == "healthy" else 1

    @property
    def saved_on(self) -> dict[str, int]:
        """Storages per device they were saved from, over all files."""
        total: dict[str, int] = defaultdict(int)
        for f in self.files:
            for device, n in f.saved_on.items():
                total[device] += n
        return dict(total)

    @property
    def saved_from_cuda(self) -> bool:
        return any(device.startswith("cuda") for device in self.saved_on)

    def errors(self) -> list[ScanFinding]:
        return [f for f in self.findings if f.severity == "error"]

    def tensor(self, name: str) -> ScannedTensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def storage_format(self, dtype: str) -> Optional[StorageFormat]:
        """The own limits of a narrow storage format (float8) found in this checkpoint."""
        return next((f for f in self.storage_formats if f.dtype == dtype), None)

    def headroom(self, t: ScannedTensor) -> Optional[float]:
        """Bits between the tensor's |x|max and the max of its own float8 format, or else of the target format."""
        own = self.storage_format(t.stats.dtype)
        if own is None:
            return headroom_bits(t.stats.abs_max, self.limits)
        if t.stats.abs_max is None or not math.isfinite(t.stats.abs_max):
            return None
        return math.inf if t.stats.abs_max == 0 else math.log2(own.max / t.stats.abs_max)

    def by_module(self) -> list[ModuleSummary]:
        """Floating weight tensors (optimizer and scaler state aside) summed per module prefix, in order."""
        groups: dict[str, list[ScannedTensor]] = {}
        for t in self.tensors:
            if t.stats.measured and t.role == "weights":
                groups.setdefault(t.module, []).append(t)
        return [self._summarise(module, ts) for module, ts in groups.items()]

    def _summarise(self, module: str, tensors: list[ScannedTensor]) -> ModuleSummary:
        def largest(ts: list[ScannedTensor]) -> Optional[float]:
            maxima = [t.stats.abs_max for t in ts if t.stats.abs_max is not None]
            return max(maxima) if maxima else None

        dtype = self.dtype
        wide = [t for t in tensors if self.storage_format(t.stats.dtype) is None]
        return ModuleSummary(
            module=module,
            tensors=len(tensors),
            numel=sum(t.stats.numel for t in tensors),
            nan_count=sum(t.stats.nan_count or 0 for t in tensors),
            inf_count=sum((t.stats.posinf_count or 0) + (t.stats.neginf_count or 0) for t in tensors),
            overflow_count=sum(t.overflow_count(dtype) for t in tensors),
            flush_count=sum(t.flush_count(dtype) for t in tensors),
            fp16_flush_count=sum(t.flush_count("float16") for t in tensors),
            bf16_flush_count=sum(t.flush_count("bfloat16") for t in tensors),
            abs_max=largest(tensors),
            headroom_bits=headroom_bits(largest(wide), self.limits),
        )
