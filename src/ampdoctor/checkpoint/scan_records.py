"""Records of a checkpoint scan (no torch objects inside): ``ScanReport.from_json`` and rendering need no torch.

Frozen and hashable (tuples and FrozenMap, never lists or dicts); ``ScanReport.from_json(r.to_json()) == r``,
NaN statistics included.

Findings carry data (kind, severity, the tensors concerned, the numbers that matter), never prose: the renderers
in :mod:`ampdoctor.report.scan_text` and :mod:`ampdoctor.report.scan_markdown` write the sentences. The JSON
form adds each finding's ``title`` and ``message`` as the text report words them, for readers of the file.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

from ..analysis.headroom import headroom_bits
from ..records import FormatLimits, FrozenMap, TensorStats
from ..serial import SavedReport, to_plain

# Major.minor: readers refuse a newer major version; a newer minor only adds fields.
# 1.1: findings hold data (their prose is rendered), tuples, notes, storage formats (float8), exit_code.
SCAN_SCHEMA_VERSION = "1.1"

Severity = Literal["error", "warning", "note"]
ScanVerdict = Literal["healthy", "overflow", "nan", "underflow"]
FindingVerdict = Literal["overflow", "nan", "underflow"]
Role = Literal["weights", "optimizer", "scaler"]  # "weights": anything outside an optimizer or a scaler
FileFormat = Literal["torch", "torch-legacy", "safetensors"]
FindingKind = Literal[
    "nonfinite",  # weight or GradScaler tensors hold inf/NaN (``role`` says which)
    "beyond_range",  # weight values that become inf when cast to the target format
    "flush_to_zero",  # nonzero weight values that become 0 when cast (error from UNDERFLOW_VERDICT_SHARE)
    "thin_headroom",  # finite weights within HEADROOM_WARN_BITS of the target format's max
    "float8_saturated",  # float8 tensors with many values at their own format's max (clipped when quantized)
    "optimizer_nonfinite",  # optimizer state (Adam's moments) holds inf/NaN
    "optimizer_fp16_state",  # optimizer moments stored in float16
    "eps_zero",  # an optimizer eps that is 0 in float16 while its state is float16
    "scaler_collapsed",  # GradScaler scale below 1: persistent overflow
    "scaler_low",  # GradScaler scale far below its default
    "refused_file",  # directory scan: a file refused for globals ampdoctor knows to be harmless (data types)
    "refused_unknown",  # directory scan: a file refused for globals ampdoctor cannot judge
    "no_tensors",  # directory scan: a file without tensors
]

VERDICT_ORDER: tuple[FindingVerdict, ...] = ("overflow", "nan", "underflow")
SEVERITIES: tuple[Severity, ...] = ("error", "warning", "note")
# Adam-style moment names (checked for non-finite values and float16 storage).
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
SECOND_MOMENT_KEYS = ("exp_avg_sq", "max_exp_avg_sq")


@dataclass(frozen=True)
class StorageFormat:
    """A narrow floating format tensors are *stored* in (float8): judged against its own limits (torch.finfo).

    Its values always fit float16 and bfloat16 when cast, so the verdict's range checks never flag them; what
    matters is whether they hold NaN/inf and how close they sit to their own format's max.
    """

    dtype: str  # "float8_e4m3fn"
    max: float  # 448 for float8_e4m3fn, 57344 for float8_e5m2
    tiny: float  # smallest normal
    has_inf: bool  # float8_e4m3fn has no inf: an overflow when quantizing (without saturation) gives NaN


@dataclass(frozen=True)
class ScannedFile:
    """One file of the checkpoint. ``saved_on`` counts storages by the device they were saved from."""

    name: str  # relative to the scanned directory (the file name when a file was scanned)
    format: FileFormat
    size_bytes: int
    tensors: int = 0
    memory_mapped: bool = False
    saved_on: FrozenMap[str, int] = field(default_factory=FrozenMap)
    skipped: str = ""  # why the file was not scanned (in a directory scan: refused, or no tensors)
    refused: tuple[str, ...] = ()  # the globals torch.load(weights_only=True) refused


@dataclass(frozen=True)
class ScannedTensor:
    """One tensor of the checkpoint.

    ``stats`` are measured against float16 (``cast_*`` count what a cast to float16 does); ``bf16_*`` count
    what a cast to bfloat16 does. ``at_max_count`` (float8 tensors only) counts values at their own format's
    max magnitude.
    """

    name: str  # key path in the loaded object: "model.blocks.0.attn.qkv.weight", "optimizer.state.3.exp_avg_sq"
    file: str
    role: Role
    stats: TensorStats
    bf16_overflow_count: Optional[int] = None
    bf16_flush_count: Optional[int] = None
    saved_on: str = ""  # the storage location written in the file ("cpu", "cuda:0"); "" when not recorded
    param: str = ""  # for optimizer state: the parameter's name when the optimizer recorded it
    at_max_count: Optional[int] = None

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

    def flush_share(self, dtype: str) -> float:
        """Share of the nonzero values that become zero when cast to ``dtype``."""
        nonzero = self.stats.nonzero_count or 0
        return self.flush_count(dtype) / nonzero if nonzero else 0.0


@dataclass(frozen=True)
class OptimizerInfo:
    """An optimizer ``state_dict()`` found in the checkpoint (``{"state": ..., "param_groups": ...}``)."""

    path: str
    file: str
    states: int
    param_groups: int
    eps: tuple[float, ...]
    state_dtypes: tuple[str, ...]
    param_names: tuple[str, ...] = ()


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


@dataclass(frozen=True)
class ScanFinding:
    """What the analysis found: data for the renderers, which write the sentences.

    ``severity`` "error" decides the verdict (``verdict``: overflow, nan or underflow); "warning" and "note" do
    not change the exit code. ``tensors`` names every tensor concerned, or the files (``refused_*``,
    ``no_tensors``), or the optimizer / scaler path (``eps_zero``, ``scaler_*``). The other fields hold the
    numbers that matter for the kind and stay at their defaults otherwise:

    - ``count``: values concerned (``beyond_range``, ``flush_to_zero`` warning, ``float8_saturated``)
    - ``worst`` / ``worst_value``: the tensor that shows it most and its |x|max (``beyond_range``) or its
      flushed share (``flush_to_zero`` error, ``float8_saturated``)
    - ``role``: whose tensors (``nonfinite``: weights or scaler)
    - ``scale`` / ``growth_tracker``: the GradScaler's (``scaler_*``)
    - ``eps``: the optimizer's eps values that are 0 in float16 (``eps_zero``)
    - ``globals``: what the refused files need (``refused_file``: all of it; ``refused_unknown``: the globals
      ampdoctor cannot judge)
    """

    severity: Severity
    kind: FindingKind
    tensors: tuple[str, ...] = ()
    verdict: Optional[FindingVerdict] = None
    count: int = 0
    worst: str = ""
    worst_value: Optional[float] = None
    role: Optional[Role] = None
    scale: Optional[float] = None
    growth_tracker: Optional[int] = None
    eps: tuple[float, ...] = ()
    globals: tuple[str, ...] = ()


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
    headroom_bits: Optional[float]  # against the target format, over the tensors not stored in float8


@dataclass(frozen=True)
class ScanReport(SavedReport):
    """What :func:`scan` found in a checkpoint. ``print(report)`` shows it; ``report.to_json()`` saves it."""

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
        """``overflow``, ``nan``, ``underflow`` (from error findings, in that order of priority) or ``healthy``."""
        seen = {f.verdict for f in self.findings if f.severity == "error"}
        return next((v for v in VERDICT_ORDER if v in seen), "healthy")

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

    # -- serialisation --------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data: the fields, plus ``kind``, ``verdict``, ``exit_code``, the per-module summary and
        each finding's ``title`` and ``message`` as the text report words them (``from_dict`` ignores those)."""
        from ..report.scan_text import finding_message, finding_title

        data: dict[str, Any] = to_plain(self)
        data["kind"] = "ampdoctor.scan"
        data["verdict"] = self.verdict
        data["exit_code"] = self.exit_code
        data["modules"] = to_plain(self.by_module())
        for plain, finding in zip(data["findings"], self.findings):
            plain["title"] = finding_title(finding, self)
            plain["message"] = finding_message(finding, self)
        return data

    # -- rendering ------------------------------------------------------------------------------------------
    def to_text(self, max_rows: int = 20) -> str:
        from ..report.scan_text import render_scan_text

        return render_scan_text(self, max_rows=max_rows)

    def to_markdown(self, max_rows: int = 20) -> str:
        from ..report.scan_markdown import render_scan_markdown

        return render_scan_markdown(self, max_rows=max_rows)

    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        return f"<ampdoctor.ScanReport verdict={self.verdict!r}, files={len(self.files)}, tensors={len(self.tensors)}>"
