"""Records of a checkpoint scan (no torch objects inside): ``ScanReport.from_json`` and rendering need no torch."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

from ..analysis.headroom import headroom_bits
from ..records import FormatLimits, TensorStats
from ..serial import json_object, load_versioned, to_plain

# Major.minor: readers refuse a newer major version; a newer minor only adds fields.
SCAN_SCHEMA_VERSION = "1.0"
_VERDICT_ORDER = ("overflow", "nan", "underflow")
_SEVERITIES = ("error", "warning", "note")


@dataclass(frozen=True)
class ScannedFile:
    """One file of the checkpoint. ``saved_on`` counts storages by the device they were saved from."""

    name: str  # relative to the scanned directory (the file name when a file was scanned)
    format: str  # "torch", "torch-legacy", "safetensors"
    size_bytes: int
    tensors: int = 0
    memory_mapped: bool = False
    saved_on: dict[str, int] = field(default_factory=dict)
    skipped: str = ""  # why the file was not scanned (in a directory scan: refused, or no tensors)
    refused: list[str] = field(default_factory=list)  # the globals torch.load(weights_only=True) refused


@dataclass(frozen=True)
class ScannedTensor:
    """One tensor of the checkpoint.

    ``stats`` are measured against float16 (``cast_*`` count what a cast to float16 does); ``bf16_*`` count
    what a cast to bfloat16 does. ``role``: "weights" (anything outside an optimizer or scaler), "optimizer",
    "scaler".
    """

    name: str  # key path in the loaded object: "model.blocks.0.attn.qkv.weight", "optimizer.state.3.exp_avg_sq"
    file: str
    role: str
    stats: TensorStats
    bf16_overflow_count: Optional[int] = None
    bf16_flush_count: Optional[int] = None
    saved_on: str = ""  # the storage location written in the file ("cpu", "cuda:0"); "" when not recorded
    param: str = ""  # for optimizer state: the parameter's name when the optimizer recorded it

    @property
    def module(self) -> str:
        """The module prefix: the name without its last component."""
        return self.name.rpartition(".")[0]

    @property
    def key(self) -> str:
        """The last component of the name ("weight", "exp_avg_sq")."""
        return self.name.rpartition(".")[2]

    def overflow_count(self, dtype: str) -> int:
        return (self.stats.cast_overflow_count or 0) if dtype == "float16" else (self.bf16_overflow_count or 0)

    def flush_count(self, dtype: str) -> int:
        return (self.stats.cast_flush_count or 0) if dtype == "float16" else (self.bf16_flush_count or 0)


@dataclass(frozen=True)
class OptimizerInfo:
    """An optimizer ``state_dict()`` found in the checkpoint (``{"state": ..., "param_groups": ...}``)."""

    path: str
    file: str
    states: int
    param_groups: int
    eps: list[float]
    state_dtypes: list[str]
    param_names: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ScalerInfo:
    """A ``GradScaler.state_dict()`` found in the checkpoint."""

    path: str
    file: str
    scale: float
    growth_tracker: Optional[int] = None
    growth_factor: Optional[float] = None
    backoff_factor: Optional[float] = None
    growth_interval: Optional[int] = None

    @property
    def collapsed(self) -> bool:
        """Below 1 (or zero / non-finite): GradScaler kept skipping steps even with gradients unscaled."""
        return not (math.isfinite(self.scale) and self.scale >= 1.0)

    @property
    def scale_text(self) -> str:
        if self.scale > 0 and math.isfinite(self.scale) and math.log2(self.scale).is_integer():
            return f"{self.scale:g} (2**{int(math.log2(self.scale))})"
        return f"{self.scale:.4g}"


@dataclass(frozen=True)
class ScanFinding:
    """``severity`` "error" decides the verdict (``verdict``: overflow, nan or underflow); "warning" and
    "note" do not change the exit code. ``tensors`` lists every tensor (or file) concerned."""

    severity: str
    kind: str
    title: str  # one short line (the verdict line shows the first error's)
    message: str  # the details and what to do
    verdict: str = ""
    tensors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ModuleSummary:
    """The tensors of one module prefix, summed (computed by :meth:`ScanReport.by_module`)."""

    module: str
    tensors: int
    numel: int
    nan_count: int
    inf_count: int
    overflow_count: int  # beyond the target format (become inf when cast)
    flush_count: int  # nonzero values that become zero when cast to the target format
    fp16_flush_count: int
    bf16_flush_count: int
    abs_max: Optional[float]
    headroom_bits: Optional[float]


@dataclass(frozen=True)
class ScanReport:
    """What :func:`scan` found in a checkpoint. ``print(report)`` shows it; ``report.to_json()`` saves it."""

    path: str
    dtype: str  # the format the verdict is about ("float16" or "bfloat16")
    limits: FormatLimits
    files: list[ScannedFile]
    tensors: list[ScannedTensor]
    optimizers: list[OptimizerInfo]
    scalers: list[ScalerInfo]
    findings: list[ScanFinding]
    torch_version: str
    ampdoctor_version: str
    schema_version: str = SCAN_SCHEMA_VERSION

    @property
    def verdict(self) -> str:
        """``overflow``, ``nan``, ``underflow`` (from error findings, in that order of priority) or ``healthy``."""
        seen = {f.verdict for f in self.findings if f.severity == "error"}
        return next((v for v in _VERDICT_ORDER if v in seen), "healthy")

    @property
    def exit_code(self) -> int:
        """CLI convention: 0 healthy or warnings only, 1 a finding."""
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

    def by_module(self) -> list[ModuleSummary]:
        """Floating weight tensors (optimizer and scaler state aside) summed per module prefix, in order."""
        groups: dict[str, list[ScannedTensor]] = {}
        for t in self.tensors:
            if t.stats.measured and t.role == "weights":
                groups.setdefault(t.module, []).append(t)
        return [_summarise(module, ts, self.dtype, self.limits) for module, ts in groups.items()]

    # -- serialisation --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = to_plain(self)
        data["kind"] = "ampdoctor.scan"
        data["verdict"] = self.verdict
        data["modules"] = to_plain(self.by_module())
        return data

    def to_json(self, indent: Optional[int] = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScanReport:
        return load_versioned(cls, data, SCAN_SCHEMA_VERSION, "scan report")

    @classmethod
    def from_json(cls, text: str) -> ScanReport:
        return cls.from_dict(json_object(text, "scan report"))

    # -- rendering ------------------------------------------------------------------------------------------
    def to_text(self, max_rows: int = 20) -> str:
        from ..report.scan_text import render_scan_text

        return render_scan_text(self, max_rows=max_rows)

    def to_markdown(self, max_rows: int = 20) -> str:
        return f"## ampdoctor scan: {self.verdict}\n\n```text\n{self.to_text(max_rows)}\n```\n"

    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        return f"<ampdoctor.ScanReport verdict={self.verdict!r}, files={len(self.files)}, tensors={len(self.tensors)}>"


def _summarise(module: str, tensors: list[ScannedTensor], dtype: str, limits: FormatLimits) -> ModuleSummary:
    maxima = [t.stats.abs_max for t in tensors if t.stats.abs_max is not None]
    abs_max = max(maxima) if maxima else None
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
        abs_max=abs_max,
        headroom_bits=headroom_bits(abs_max, limits),
    )

