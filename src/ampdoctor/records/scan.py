"""Records of a checkpoint scan (no torch objects inside): what a scan measured, file by file and tensor by tensor.
The report that holds them is :class:`ampdoctor.report.scan_report.ScanReport`.

Frozen and hashable (tuples and FrozenMap, never lists or dicts); ``ScanReport.from_json(r.to_json()) == r``,
NaN statistics included.

Findings carry data (kind, severity, the tensors concerned, the numbers that matter), never prose: the renderers
in :mod:`ampdoctor.report.scan_text` and :mod:`ampdoctor.report.scan_markdown` write the sentences. The JSON
form adds each finding's ``title`` and ``message`` as the text report words them, for readers of the file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional

from . import FrozenMap, TensorStats

# Major.minor: readers refuse a newer major version; a newer minor only adds fields.
# 1.1: findings hold data (their prose is rendered), tuples, notes, storage formats (float8), exit_code.
# 1.2: the "incomplete" verdict, files listed but not read (unread) and shards an index names but the folder lacks
#      (missed), finding kinds "unread" and "skipped_unread".
SCAN_SCHEMA_VERSION = "1.2"

Severity = Literal["error", "warning", "note"]
# "incomplete": no finding, but files that may hold weights could not be read (never "healthy" then).
ScanVerdict = Literal["healthy", "overflow", "nan", "underflow", "incomplete"]
FindingVerdict = Literal["overflow", "nan", "underflow"]
Role = Literal["weights", "optimizer", "scaler"]  # "weights": anything outside an optimizer or a scaler
FileFormat = Literal["torch", "torch-legacy", "safetensors", "dcp", "unknown"]  # dcp: a torch.distributed.checkpoint
# folder; unknown: a file that was not read
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
    "unread",  # directory scan: files that may hold weights could not be read (the scan is incomplete)
    "skipped_unread",  # directory scan: unreadable or non-checkpoint files no index names (listed, not weights)
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
    # Those of ``refused`` the loading policy does not know to be harmless data types (unknown, or able to run
    # code); classified when the file was read, so the analysis needs no loading policy.
    refused_unknown: tuple[str, ...] = ()
    unread: bool = False  # could not be read at all (``skipped`` says why): absent, a dangling link, a FIFO ...
    missed: bool = False  # unread, and it may hold weights this scan did not see (an index names it, or no index)


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
    ``no_tensors``, ``unread``, ``skipped_unread``), or the optimizer / scaler path (``eps_zero``,
    ``scaler_*``). The other fields hold the numbers that matter for the kind and stay at their defaults
    otherwise (``unread`` is an error without a verdict: the report's verdict is then "incomplete"):

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
