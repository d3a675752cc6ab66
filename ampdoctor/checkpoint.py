"""Static scan of saved checkpoints (``ampdoctor.scan``) and safe loading of their weights.

Loading is always ``torch.load(..., weights_only=True)``. A file that needs other globals is refused with those
globals named; the caller may allow exactly those (``allow_globals``) or, as a last resort, load without the
safety net (``unsafe_load``). A directory of shards is read one file at a time (memory-mapped where the format
allows) and each file's tensors are measured and let go before the next file is opened.

The records here (``ScanReport`` and its parts) hold no torch objects: ``ScanReport.from_json`` and the
renderers work without torch. Torch is imported only by the functions that read files.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import re
import textwrap
import warnings
import zipfile
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from tabulate import tabulate

from ._version import __version__
from .analysis import headroom_bits
from .errors import AmpDoctorError
from .records import FormatLimits, TensorStats, json_object, load_versioned, to_plain
from .render_text import describe_bad, fmt_num
from .thresholds import HEADROOM_WARN_BITS, UNDERFLOW_VERDICT_SHARE

if TYPE_CHECKING:
    import torch
    from torch import nn

# Major.minor: readers refuse a newer major version; a newer minor only adds fields.
SCAN_SCHEMA_VERSION = "1.0"

# Files a directory scan opens (others, such as trainer_state.json, are left alone).
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")
# A GradScaler scale at or above 1 but below this has backed off a long way from its 2**16 default: warning.
LOW_SCALER_SCALE = 2.0**8
# Adam-style moment names checked for fp16 underflow (and exp_avg_sq for non-finite values).
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
# Modules whose globals can run code: a checkpoint that names them is likely hostile; the refusal says so.
_DANGEROUS_MODULES = frozenset(
    {
        "os",
        "posix",
        "nt",
        "subprocess",
        "builtins",
        "__builtin__",
        "sys",
        "shutil",
        "socket",
        "runpy",
        "importlib",
        "pickle",
        "_pickle",
        "marshal",
        "code",
        "codeop",
        "ctypes",
        "pty",
        "webbrowser",
    }
)
_MAX_DEPTH = 32  # nesting guard for the walk through a loaded object
_VERDICT_ORDER = ("overflow", "nan", "underflow")
_SEVERITIES = ("error", "warning", "note")
_TEXT_WIDTH = 116  # finding details are wrapped to this width in the text report

ProgressFn = Callable[[int, int, str], None]  # (index, total, file name) before each file


class CheckpointRefused(AmpDoctorError):
    """``torch.load(weights_only=True)`` refused a file; ``blocking`` names the globals it would need."""

    def __init__(self, path: str, blocking: Sequence[str]) -> None:
        self.path = path
        self.blocking = list(blocking)
        names = ", ".join(self.blocking) if self.blocking else "(unknown)"
        hostile = [n for n in self.blocking if _is_dangerous(n)]
        if hostile:
            advice = (
                f"{', '.join(hostile)} can run commands: this file is likely malicious; do not allow it and do not "
                "use --unsafe-load"
            )
        else:
            advice = (
                f"if you trust the file, allow exactly these with --allow-global {','.join(self.blocking)} "
                "(Python: allow_globals=[...]), or as a last resort --unsafe-load (runs any code the file holds)"
            )
        super().__init__(f"{path}: refused by torch.load(weights_only=True): it needs {names}; {advice}")


class UnsafeLoadWarning(UserWarning):
    """A checkpoint is being loaded with ``weights_only=False``: any code it holds runs."""


def _is_dangerous(name: str) -> bool:
    return name.split(".")[0] in _DANGEROUS_MODULES


# -- records -------------------------------------------------------------------------------------------------


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
        return fmt_num(self.scale)


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


# -- findings (pure: records in, findings out) ---------------------------------------------------------------


def _names(tensors: Iterable[ScannedTensor]) -> list[str]:
    return [t.name for t in tensors]


def _first(names: Sequence[str], n: int = 3) -> str:
    shown = ", ".join(names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def _flush_share(t: ScannedTensor, dtype: str) -> float:
    nonzero = t.stats.nonzero_count or 0
    return t.flush_count(dtype) / nonzero if nonzero else 0.0


def analyse_scan(
    tensors: Sequence[ScannedTensor],
    optimizers: Sequence[OptimizerInfo],
    scalers: Sequence[ScalerInfo],
    files: Sequence[ScannedFile],
    limits: FormatLimits,
) -> list[ScanFinding]:
    """Findings of a scan, errors first. No torch: works on a report loaded from JSON."""
    out: list[ScanFinding] = []
    out += _nonfinite_findings(tensors)
    out += _range_findings([t for t in tensors if t.role == "weights" and t.stats.measured], limits)
    out += _optimizer_findings(tensors, optimizers, limits)
    out += _scaler_findings(scalers)
    out += _file_findings(files, limits)
    # Errors first, the verdict's own finding leading; otherwise in the order found.
    severity = {s: i for i, s in enumerate(_SEVERITIES)}
    verdict = {v: i for i, v in enumerate(_VERDICT_ORDER)}
    return sorted(out, key=lambda f: (severity.get(f.severity, len(severity)), verdict.get(f.verdict, len(verdict))))


def _file_findings(files: Sequence[ScannedFile], limits: FormatLimits) -> list[ScanFinding]:
    out = []
    refused = [f for f in files if f.refused]
    if refused:
        out.append(
            ScanFinding(
                "warning",
                "refused_file",
                f"{len(refused)} file(s) not scanned: torch.load(weights_only=True) refused them",
                "; ".join(f"{f.name} needs {', '.join(f.refused)}" for f in refused)
                + "; to scan them too, allow those globals with --allow-global if you trust the files",
                tensors=[f.name for f in refused],
            )
        )
    empty = [f.name for f in files if f.skipped and not f.refused]
    if empty:
        out.append(ScanFinding("note", "no_tensors", f"{len(empty)} file(s) hold no tensors", _first(empty)))
    devices = sorted({d for f in files for d in f.saved_on if d.startswith("cuda")})
    if devices:
        out.append(
            ScanFinding(
                "note",
                "saved_from_cuda",
                f"tensors were saved from {', '.join(devices)}",
                f"they were read here on the CPU; the values (and this scan) are the same on any device, but a "
                f"{limits.dtype} diagnosis on the CPU can differ from CUDA, where autocast runs exp, pow, sum, "
                "softmax and layer_norm in float32",
            )
        )
    return out


def _nonfinite_findings(tensors: Sequence[ScannedTensor]) -> list[ScanFinding]:
    out = []
    for role, what, advice in (
        (
            "weights",
            "weight",
            "training had already broken when this was saved: restore an earlier checkpoint and run ampdoctor "
            "diagnose on it to find where the first inf/NaN is made",
        ),
        ("scaler", "GradScaler", "restore an earlier checkpoint"),
    ):
        bad = [t for t in tensors if t.role == role and t.stats.measured and not t.stats.is_finite]
        if not bad:
            continue
        has_inf = any(t.stats.has_posinf or t.stats.has_neginf for t in bad)
        details = "; ".join(f"{t.name}: {describe_bad(t.stats)}" for t in bad[:3])
        more = f" (and {len(bad) - 3} more tensors)" if len(bad) > 3 else ""
        out.append(
            ScanFinding(
                "error",
                "nonfinite",
                f"{len(bad)} {what} tensor(s) hold inf/NaN",
                f"{details}{more}; {advice}",
                "overflow" if has_inf else "nan",
                _names(bad),
            )
        )
    return out


def _range_findings(weights: Sequence[ScannedTensor], limits: FormatLimits) -> list[ScanFinding]:
    dtype = limits.dtype
    out = []
    over = [t for t in weights if t.overflow_count(dtype)]
    if over:
        total = sum(t.overflow_count(dtype) for t in over)
        worst = max(over, key=lambda t: t.stats.abs_max or 0.0)
        out.append(
            ScanFinding(
                "error",
                "beyond_range",
                f"{total} weight value(s) beyond the {dtype} range (|x| >= {limits.overflow_threshold:g})",
                f"they become inf when autocast casts them: {_first(_names(over))} (largest |x| "
                f"{fmt_num(worst.stats.abs_max)} in {worst.name}); run the layers that use them in float32 "
                "(ampdoctor.fp32_fallback) or train in bfloat16",
                "overflow",
                _names(over),
            )
        )
    flushed = [t for t in weights if t.flush_count(dtype)]
    heavy = [t for t in flushed if _flush_share(t, dtype) >= UNDERFLOW_VERDICT_SHARE]
    light = [t for t in flushed if t not in heavy]
    if heavy:
        worst = max(heavy, key=lambda t: _flush_share(t, dtype))
        out.append(
            ScanFinding(
                "error",
                "flush_to_zero",
                f"{len(heavy)} tensor(s) lose at least {UNDERFLOW_VERDICT_SHARE:.0%} of their nonzero values to zero "
                f"in {dtype}",
                f"|x| <= {fmt_num(limits.flush_threshold)} rounds to 0 when cast: {_first(_names(heavy))} (worst "
                f"{worst.name}: {_flush_share(worst, dtype):.1%}); rescale these weights, run their layers in float32 "
                "(ampdoctor.fp32_fallback), or use bfloat16 (float32's range)",
                "underflow",
                _names(heavy),
            )
        )
    if light:
        total = sum(t.flush_count(dtype) for t in light)
        out.append(
            ScanFinding(
                "warning",
                "flush_to_zero",
                f"{total} nonzero weight value(s) flush to zero in {dtype}",
                f"in {len(light)} tensor(s), under {UNDERFLOW_VERDICT_SHARE:.0%} of each tensor's nonzero values: "
                f"{_first(_names(light))}",
                tensors=_names(light),
            )
        )
    thin = [
        t
        for t in weights
        if t.stats.is_finite
        and not t.overflow_count(dtype)
        and (bits := headroom_bits(t.stats.abs_max, limits)) is not None
        and bits < HEADROOM_WARN_BITS
    ]
    if thin:
        out.append(
            ScanFinding(
                "warning",
                "thin_headroom",
                f"{len(thin)} tensor(s) within {HEADROOM_WARN_BITS:g} bit of the {dtype} max ({limits.max:g})",
                f"one more doubling overflows: {_first(_names(thin))}",
                tensors=_names(thin),
            )
        )
    return out


def _optimizer_findings(
    tensors: Sequence[ScannedTensor], optimizers: Sequence[OptimizerInfo], limits: FormatLimits
) -> list[ScanFinding]:
    out = []
    state = [t for t in tensors if t.role == "optimizer" and t.stats.measured]
    bad = [t for t in state if not t.stats.is_finite]
    if bad:
        sq = [t for t in bad if t.key in ("exp_avg_sq", "max_exp_avg_sq")]
        has_inf = any(t.stats.has_posinf or t.stats.has_neginf for t in bad)
        title = (
            f"Adam's second moment (exp_avg_sq) is non-finite for {len(sq)} parameter(s)"
            if sq
            else f"{len(bad)} optimizer state tensor(s) hold inf/NaN"
        )
        out.append(
            ScanFinding(
                "error",
                "optimizer_nonfinite",
                title,
                f"{_first([_with_param(t) for t in bad])}: the updates of these parameters are inf/NaN and stay so at "
                "every later step; restore an earlier checkpoint (or reset the optimizer state of these parameters) "
                "and find the first non-finite gradient with ampdoctor diagnose",
                "overflow" if has_inf else "nan",
                _names(bad),
            )
        )
    moments = [t for t in state if t.key in MOMENT_KEYS and t.stats.is_finite]
    in_fp16 = [t for t in moments if t.stats.dtype == "float16"]
    if in_fp16:
        zeros = sum(t.stats.zero_count or 0 for t in in_fp16)
        subnormal = sum(t.stats.subnormal_count or 0 for t in in_fp16)
        out.append(
            ScanFinding(
                "warning",
                "optimizer_fp16_state",
                f"{len(in_fp16)} optimizer moment tensor(s) are stored in float16",
                f"{zeros} zeros, {subnormal} subnormal values: moments below {fmt_num(limits.smallest_subnormal)} "
                "are lost; keep the optimizer state and master weights in float32 (torch.autocast does; "
                "model.half() does not)",
                tensors=_names(in_fp16),
            )
        )
    wide = [t for t in moments if t.stats.dtype != "float16" and t.flush_count("float16")]
    if wide:
        flushed = sum(t.flush_count("float16") for t in wide)
        nonzero = sum(t.stats.nonzero_count or 0 for t in wide)
        share = flushed / nonzero if nonzero else 0.0
        out.append(
            ScanFinding(
                "warning" if share >= UNDERFLOW_VERDICT_SHARE else "note",
                "optimizer_moment_underflow",
                f"{flushed} nonzero optimizer moment value(s) ({share:.1%}) would flush to zero in float16",
                f"in {_first(_names(wide))}: harmless while the optimizer state stays float32; keep it so",
                tensors=_names(wide),
            )
        )
    for opt in optimizers:
        zero_eps = [e for e in opt.eps if 0 < e <= limits.flush_threshold] if limits.dtype == "float16" else []
        if not zero_eps:
            continue
        eps_text = ", ".join(f"{e:g}" for e in sorted(set(zero_eps)))
        fix = f"use eps >= {fmt_num(limits.tiny)} (float16's smallest normal) or keep the optimizer in float32"
        where = opt.path or "<root>"
        if "float16" in opt.state_dtypes:
            out.append(
                ScanFinding(
                    "error",
                    "eps_zero",
                    f"optimizer eps {eps_text} is 0 in float16, and its state is float16",
                    f"{where}: sqrt(v) + eps can be 0, and the update divides by it (inf/NaN); {fix}",
                    "nan",
                    [opt.path],
                )
            )
        else:
            out.append(
                ScanFinding(
                    "note",
                    "eps_zero",
                    f"optimizer eps {eps_text} rounds to 0 in float16",
                    f"{where}: harmless while the optimizer runs in float32 (as with torch.autocast), a division by "
                    f"zero if it ever runs in float16; {fix}",
                    tensors=[opt.path],
                )
            )
    return out


def _with_param(t: ScannedTensor) -> str:
    return f"{t.name} ({t.param})" if t.param else t.name


def _scaler_findings(scalers: Sequence[ScalerInfo]) -> list[ScanFinding]:
    out = []
    for s in scalers:
        tracker = "" if s.growth_tracker is None else f", growth tracker {s.growth_tracker}"
        where = s.path or "<root>"
        if s.collapsed:
            out.append(
                ScanFinding(
                    "error",
                    "scaler_collapsed",
                    f"GradScaler scale collapsed to {s.scale_text}: persistent overflow",
                    f"{where}{tracker}: each backoff halves the scale after a step with inf/NaN gradients, so below 1 "
                    "the gradients were non-finite even unscaled, step after step: the forward or the unscaled "
                    "backward overflows, and no loss-scale setting fixes it; find the origin with ampdoctor diagnose",
                    "overflow",
                    [s.path],
                )
            )
        elif s.scale < LOW_SCALER_SCALE:
            out.append(
                ScanFinding(
                    "warning",
                    "scaler_low",
                    f"GradScaler scale {s.scale_text} is far below its 65536 default",
                    f"{where}{tracker}: steps overflowed often, and small gradient values underflow at this scale; "
                    "ampdoctor diagnose reports the largest finite scale and the share of gradients lost there",
                    tensors=[s.path],
                )
            )
    return out


# -- loading ---------------------------------------------------------------------------------------------------


@dataclass
class LoadedFile:
    """The contents of one file, held only while that file is scanned."""

    obj: Any
    format: str
    memory_mapped: bool
    locations: dict[int, str]  # storage data pointer -> location written in the file


class _SafetensorsMapping(Mapping[str, Any]):
    """A safetensors file as a read-only mapping; each tensor is read when asked for (the file is mmapped)."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self._handle = safe_open(str(path), framework="pt", device="cpu")
        self._keys = list(self._handle.keys())
        self._key_set = set(self._keys)

    def __getitem__(self, key: str) -> Any:
        if key not in self._key_set:
            raise KeyError(key)
        return self._handle.get_tensor(key)

    def __contains__(self, key: object) -> bool:
        return key in self._key_set

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _is_safetensors(path: Path) -> bool:
    """By suffix, or by content: an 8-byte little-endian header length, then a JSON object."""
    if path.suffix == ".safetensors":
        return True
    try:
        with open(path, "rb") as fh:
            head = fh.read(9)
        size = path.stat().st_size
    except OSError:
        return False
    return len(head) == 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < size


def resolve_global(name: str) -> Any:
    """The object a ``module.attr`` global name refers to (imports the module: only for names the user gave)."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    raise AmpDoctorError(f"--allow-global {name}: no such global (write it as module.name, e.g. argparse.Namespace)")


def _allowed_objects(names: Sequence[str]) -> list[Any]:
    objects = [resolve_global(n) for n in names]
    if "numpy.dtype" in names:
        # numpy >= 1.25 pickles dtype instances as their concrete class (numpy.dtypes.Float32DType, ...):
        # allowing numpy.dtype means allowing those too.
        import numpy

        dtypes = getattr(numpy, "dtypes", None)
        if dtypes is not None:
            objects += [cls for cls in vars(dtypes).values() if isinstance(cls, type) and issubclass(cls, numpy.dtype)]
    return objects


_GLOBAL_PATTERNS = (
    re.compile(r"GLOBAL ([\w.]+)"),
    re.compile(r"but got <class '([\w.]+)'>"),
)


def _blocking_globals(path: Path, message: str) -> list[str]:
    """Globals that kept ``weights_only=True`` from loading; found without running anything in the file."""
    import torch

    names: list[str] = []
    getter = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if getter is not None and zipfile.is_zipfile(path):
        try:
            names = list(getter(str(path)))
        except Exception:  # a scan aid only; the error message below still names one
            names = []
    for pattern in _GLOBAL_PATTERNS:
        names += pattern.findall(message)
    return list(dict.fromkeys(names))


def _first_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else ""


def _load_torch(path: Path, allow_globals: Sequence[str], unsafe_load: bool) -> LoadedFile:
    import pickle

    import torch

    locations: dict[int, str] = {}

    def record_location(storage: Any, location: str) -> Any:
        try:
            locations[storage.data_ptr()] = location
        except Exception:  # storages without a data pointer (meta) simply go unrecorded
            pass
        return storage  # left on the CPU: nothing is copied to a device

    if path.stat().st_size == 0:
        raise AmpDoctorError(f"{path}: the file is empty (0 bytes): not a checkpoint, or the copy failed")
    is_zip = zipfile.is_zipfile(path)
    if not is_zip:
        with open(path, "rb") as fh:
            if fh.read(4) == b"PK\x03\x04":
                raise AmpDoctorError(
                    f"{path}: a truncated or corrupt PyTorch zip checkpoint (no zip directory at its end); "
                    "copy it again, or use an earlier checkpoint"
                )
    context: AbstractContextManager[Any] = nullcontext()
    if unsafe_load:
        warnings.warn(
            f"loading {path} with torch.load(weights_only=False): any code the file holds runs",
            UnsafeLoadWarning,
            stacklevel=3,
        )
    elif allow_globals:
        safe_globals = getattr(torch.serialization, "safe_globals", None)
        if safe_globals is None:
            raise AmpDoctorError(f"--allow-global needs torch >= 2.5 (this is {torch.__version__})")
        context = safe_globals(_allowed_objects(allow_globals))
    try:
        with context:
            obj = torch.load(str(path), map_location=record_location, mmap=is_zip, weights_only=not unsafe_load)
    except MemoryError:
        raise
    except Exception as exc:  # torch.load raises many types for a broken file; one message
        if not unsafe_load and isinstance(exc, pickle.UnpicklingError):
            blocking = [n for n in _blocking_globals(path, str(exc)) if n not in allow_globals]
            if blocking:
                raise CheckpointRefused(str(path), blocking) from exc
        raise AmpDoctorError(
            f"{path}: not a readable PyTorch checkpoint (truncated, corrupt, or not a checkpoint): "
            f"{type(exc).__name__}: {_load_reason(str(exc))}"
        ) from exc
    return LoadedFile(obj, "torch" if is_zip else "torch-legacy", is_zip, locations)


def _load_reason(message: str) -> str:
    """The informative line of a torch.load error (the weights-only unpickler wraps it in boilerplate)."""
    marker = "WeightsUnpickler error:"
    if marker in message:
        after = message.split(marker, 1)[1]
        lines = [line.strip() for line in after.splitlines() if line.strip()]
        if lines:
            return lines[0]
    return _first_line(message) or "no detail"


def _load_file(path: Path, allow_globals: Sequence[str] = (), unsafe_load: bool = False) -> LoadedFile:
    """Read one checkpoint file (the only place file contents are read). Raises AmpDoctorError, never more."""
    if _is_safetensors(path):
        try:
            import safetensors  # noqa: F401
        except ImportError:
            raise AmpDoctorError(
                f"{path}: reading .safetensors needs the safetensors package: pip install 'ampdoctor[safetensors]'"
            ) from None
        try:
            return LoadedFile(_SafetensorsMapping(path), "safetensors", True, {})
        except Exception as exc:  # SafetensorError and friends: one clear line
            raise AmpDoctorError(
                f"{path}: not a readable safetensors file (truncated or corrupt): {_first_line(str(exc))}"
            ) from exc
    return _load_torch(path, allow_globals, unsafe_load)


def checkpoint_files(path: Path) -> list[Path]:
    """The files a scan reads: the file itself, or the checkpoint files directly inside a directory."""
    if not path.exists():
        raise AmpDoctorError(f"{path}: no such file or directory")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in CHECKPOINT_SUFFIXES)
        if not files:
            raise AmpDoctorError(
                f"{path}: no checkpoint files in this directory (looked for {', '.join(CHECKPOINT_SUFFIXES)})"
            )
        return files
    if not path.is_file():
        raise AmpDoctorError(f"{path}: not a regular file or directory")
    return [path]


# -- walking a loaded object -----------------------------------------------------------------------------------


def _is_optimizer_state(obj: Mapping[Any, Any]) -> bool:
    return isinstance(obj.get("state"), Mapping) and isinstance(obj.get("param_groups"), (list, tuple))


def _is_scaler_state(obj: Mapping[Any, Any]) -> bool:
    return "scale" in obj and "_growth_tracker" in obj


def _number(value: Any) -> Optional[float]:
    try:
        return float(value)  # a Python number or a 0-d tensor
    except (TypeError, ValueError, RuntimeError):
        return None


def _join(prefix: str, key: Any) -> str:
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

        from .stats import StatsCollector

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
            if _is_optimizer_state(obj):
                self._visit_optimizer(obj, name, depth)
                return
            if _is_scaler_state(obj):
                self._record_scaler(obj, name)
                role = "scaler"
            for key, value in obj.items():
                self.visit(value, _join(name, key), role, param, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                self.visit(value, _join(name, i), role, param, depth + 1)
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
            where = _join(_join(name, "state"), index)
            if isinstance(per_param, Mapping):
                for key, value in per_param.items():
                    if isinstance(value, self._torch.Tensor) and key in MOMENT_KEYS:
                        dtypes.add(str(value.dtype).replace("torch.", ""))
                    self.visit(value, _join(where, key), "optimizer", names.get(index, ""), depth + 2)
            else:
                self.visit(per_param, where, "optimizer", names.get(index, ""), depth + 2)
        eps = [e for e in (_number(g.get("eps")) for g in groups) if e is not None]
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
        scale = _number(obj.get("scale"))
        if scale is None:
            return
        tracker = _number(obj.get("_growth_tracker"))
        interval = _number(obj.get("growth_interval"))
        self.scalers.append(
            ScalerInfo(
                path=name,
                file=self.file,
                scale=scale,
                growth_tracker=None if tracker is None else int(tracker),
                growth_factor=_number(obj.get("growth_factor")),
                backoff_factor=_number(obj.get("backoff_factor")),
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
    loaded = _load_file(path, allow_globals, unsafe_load)
    scan = _FileScan(label, loaded.locations)
    try:
        scan.visit(loaded.obj)
    except AmpDoctorError:
        raise
    except Exception as exc:  # e.g. a safetensors tensor that cannot be read: one line
        detail = f"{type(exc).__name__}: {_first_line(str(exc))}"
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
    from .stats import format_limits

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
            raise CheckpointRefused(str(root), list(dict.fromkeys(n for r in refusals for n in r.blocking)))
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


# -- loading weights into a model (for ``ampdoctor diagnose CKPT``) --------------------------------------------

_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


@dataclass(frozen=True)
class LoadedWeights:
    """What :func:`load_weights` put into the model and what else the checkpoint said."""

    files: list[str]
    tensors: int
    saved_on: dict[str, int]
    scaler_scale: Optional[float]  # the first GradScaler state's scale, when the checkpoint has one
    scaler_path: str = ""

    @property
    def saved_from_cuda(self) -> bool:
        return any(device.startswith("cuda") for device in self.saved_on)


def _tensor_mappings(obj: Any, depth: int = 0) -> Iterator[Mapping[str, Any]]:
    """Every mapping in ``obj`` whose values include tensors (candidate state dicts), outermost first."""
    import torch

    if depth > _MAX_DEPTH:
        return
    if isinstance(obj, torch.nn.Module):
        yield obj.state_dict()
        return
    if isinstance(obj, _SafetensorsMapping):
        yield obj
        return
    if isinstance(obj, Mapping):
        if _is_optimizer_state(obj) or _is_scaler_state(obj):
            return
        if any(isinstance(v, torch.Tensor) for v in obj.values()):
            yield obj
        for value in obj.values():
            if isinstance(value, (Mapping, list, tuple, torch.nn.Module)):
                yield from _tensor_mappings(value, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensor_mappings(value, depth + 1)


def _normalise_keys(keys: Iterable[str], wanted: set[str]) -> dict[str, str]:
    """checkpoint key -> model key: wrapper prefixes (DDP ``module.``, ``_orig_mod.``) dropped, and one common
    leading component (``model.``) dropped when that makes the keys match the model's."""
    out = {}
    for key in keys:
        k = key
        # A model may own a submodule really called "module": a key it knows is kept as it is.
        while k not in wanted and k.startswith(_WRAPPER_PREFIXES):
            k = k.split(".", 1)[1]
        out[key] = k
    if not wanted & set(out.values()):
        heads = {k.split(".", 1)[0] for k in out.values() if "." in k}
        if len(heads) == 1:
            head = heads.pop() + "."
            stripped = {key: k[len(head) :] if k.startswith(head) else k for key, k in out.items()}
            if wanted & set(stripped.values()):
                return stripped
    return out


def _best_state_dict(obj: Any, wanted: set[str]) -> tuple[dict[str, Any], int]:
    """The candidate mapping that shares most keys with the model, renamed to the model's keys."""
    import torch

    best: Optional[tuple[int, Mapping[str, Any], dict[str, str]]] = None
    for mapping in _tensor_mappings(obj):
        names = _normalise_keys([str(k) for k in mapping.keys()], wanted)
        hits = len(wanted & set(names.values()))
        if best is None or hits > best[0]:
            best = (hits, mapping, names)
    if best is None:
        return {}, 0
    hits, source, names = best
    tensors = {}
    for key in source.keys():
        value = source[key]
        if isinstance(value, torch.Tensor):
            tensors[names[str(key)]] = value
    return tensors, hits


def _short_list(items: Sequence[str], n: int = 5) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items)} in all)" if len(items) > n else "")


def load_weights(
    model: nn.Module,
    path: str | Path,
    *,
    allow_globals: Sequence[str] = (),
    unsafe_load: bool = False,
    progress: Optional[ProgressFn] = None,
) -> LoadedWeights:
    """Load a checkpoint's weights into ``model`` (strictly: every key, every shape).

    The state dict is found inside training checkpoints (the nested mapping that matches the model's keys
    best); DDP's ``module.`` and ``torch.compile``'s ``_orig_mod.`` prefixes are dropped. A directory of shards
    is loaded one file at a time, twice: the first round only checks keys and shapes, so a checkpoint that does
    not fit leaves the model untouched. Raises :class:`AmpDoctorError` naming missing and unexpected keys and
    shape mismatches. The checkpoint is only read.
    """
    import torch

    root = Path(path)
    files = checkpoint_files(root)
    own = model.state_dict()
    wanted = set(own)
    seen: set[str] = set()
    unexpected: list[str] = []
    mismatched: dict[str, str] = {}  # model key -> description
    locations: dict[str, int] = defaultdict(int)
    scaler: Optional[tuple[float, str]] = None
    used: list[str] = []
    refusals: list[CheckpointRefused] = []
    for index, file in enumerate(files):  # first round: check every file, load nothing
        if progress is not None:
            progress(index, len(files), file.name)
        try:
            loaded = _load_file(file, allow_globals, unsafe_load)
        except CheckpointRefused as refused:
            if not root.is_dir():
                raise
            refusals.append(refused)
            continue
        if scaler is None:
            scaler = _find_scaler(loaded.obj)
        part, hits = _best_state_dict(loaded.obj, wanted)
        if root.is_dir() and hits == 0:
            continue  # optimizer.pt, scheduler.pt, ... in a training checkpoint directory
        used.append(file.name)
        for location in loaded.locations.values():
            locations[location] += 1
        fits: dict[str, torch.Tensor] = {}
        for key, value in part.items():
            if key not in own:
                unexpected.append(key)
            elif tuple(value.shape) != tuple(own[key].shape):
                mismatched[key] = f"{key} (checkpoint {list(value.shape)}, model {list(own[key].shape)})"
            else:
                fits[key] = value
        seen.update(fits)
        del loaded, part, fits
    if refusals and len(refusals) == len(files):
        raise CheckpointRefused(str(root), list(dict.fromkeys(n for r in refusals for n in r.blocking)))
    if not used:
        raise AmpDoctorError(f"{root}: no file in it holds weights for this model")
    missing = sorted(k for k in wanted - seen - set(mismatched) if not _tied_to(k, own, seen))
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing: {_short_list(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected: {_short_list(sorted(unexpected))}")
        if mismatched:
            parts.append(f"{len(mismatched)} shape mismatch(es): {_short_list(list(mismatched.values()))}")
        raise AmpDoctorError(
            f"the weights in {root} do not fit the model ({type(model).__name__}): {'; '.join(parts)}; "
            "check that --model and --model-kwargs build the model that was trained"
        )
    for name in used:  # second round: everything fits; load one file at a time
        loaded = _load_file(root / name if root.is_dir() else root, allow_globals, unsafe_load)
        part, _ = _best_state_dict(loaded.obj, wanted)
        del loaded
        with torch.no_grad():
            model.load_state_dict(part, strict=False)
        del part
    return LoadedWeights(
        files=used,
        tensors=len(seen),
        saved_on=dict(locations),
        scaler_scale=None if scaler is None else scaler[0],
        scaler_path="" if scaler is None else scaler[1],
    )


def _tied_to(key: str, own: Mapping[str, Any], loaded: set[str]) -> bool:
    """A tied weight (``lm_head.weight`` sharing ``embed.weight``'s storage) is loaded with its twin: checkpoints
    such as Hugging Face safetensors files store it once."""
    tensor = own[key]
    return any(
        other in loaded and own[other].data_ptr() == tensor.data_ptr() and own[other].shape == tensor.shape
        for other in own
        if other != key
    )


def _find_scaler(obj: Any, name: str = "", depth: int = 0) -> Optional[tuple[float, str]]:
    if depth > _MAX_DEPTH:
        return None
    if isinstance(obj, Mapping):
        if _is_scaler_state(obj):
            scale = _number(obj.get("scale"))
            return None if scale is None else (scale, name)
        if _is_optimizer_state(obj) or isinstance(obj, _SafetensorsMapping):
            return None
        items: Iterable[tuple[Any, Any]] = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    for key, value in items:
        if isinstance(value, (Mapping, list, tuple)):
            found = _find_scaler(value, _join(name, key), depth + 1)
            if found is not None:
                return found
    return None


# -- text rendering (pure) -------------------------------------------------------------------------------------


def _bits(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.2f}"


def _share(part: int, whole: Optional[int]) -> str:
    return f"{part} ({part / whole:.1%})" if part and whole else str(part)


def _verdict_line(report: ScanReport) -> str:
    errors = report.errors()
    head = f"ampdoctor scan: {report.verdict.upper()}"
    if errors:
        more = f" (+{len(errors) - 1} more finding(s))" if len(errors) > 1 else ""
        return f"{head} - {errors[0].title}{more}"
    warnings_ = [f for f in report.findings if f.severity == "warning"]
    return head + (f" - {len(warnings_)} warning(s)" if warnings_ else " - no inf/NaN, nothing out of range")


def _module_rows(report: ScanReport, max_rows: int) -> list[list[str]]:
    summaries = report.by_module()

    def badness(m: ModuleSummary) -> tuple[int, int, float, float]:
        share = m.flush_count / m.numel if m.numel else 0.0
        return (-(m.nan_count + m.inf_count), -m.overflow_count, -share, m.headroom_bits or math.inf)

    summaries.sort(key=badness)
    return [
        [
            m.module or "<root>",
            str(m.tensors),
            str(m.numel),
            str(m.nan_count),
            str(m.inf_count),
            str(m.overflow_count),
            str(m.fp16_flush_count),
            str(m.bf16_flush_count),
            fmt_num(m.abs_max),
            _bits(m.headroom_bits),
        ]
        for m in summaries[:max_rows]
    ]


def _tensor_rows(report: ScanReport, max_rows: int) -> list[list[str]]:
    dtype = report.dtype
    flagged = [
        t
        for t in report.tensors
        if t.stats.measured and (not t.stats.is_finite or t.overflow_count(dtype) or t.flush_count(dtype))
    ]
    return [
        [
            t.name,
            t.stats.dtype,
            "x".join(map(str, t.stats.shape)) or "scalar",
            str(t.stats.nan_count or 0),
            str((t.stats.posinf_count or 0) + (t.stats.neginf_count or 0)),
            str(t.overflow_count(dtype)),
            _share(t.flush_count(dtype), t.stats.nonzero_count),
            fmt_num(t.stats.abs_max),
            _bits(headroom_bits(t.stats.abs_max, report.limits)),
        ]
        for t in flagged[:max_rows]
    ]


def render_scan_text(report: ScanReport, max_rows: int = 20) -> str:
    """The verdict line, the findings, the scaler and optimizer state, then per-module and per-tensor tables."""
    measured = [t for t in report.tensors if t.stats.measured]
    values = sum(t.stats.numel for t in measured)
    lim = report.limits
    lines = [
        _verdict_line(report),
        f"  {report.path}: {len(report.files)} file(s), {len(measured)} floating tensor(s), {values} values; "
        f"torch {report.torch_version}",
        f"  checked against {report.dtype}: max {lim.max:g}, inf from |x| >= {lim.overflow_threshold:g}, "
        f"zero for 0 < |x| <= {fmt_num(lim.flush_threshold)}",
    ]
    for severity, title in (("error", "Findings"), ("warning", "Warnings"), ("note", "Notes")):
        chosen = [f for f in report.findings if f.severity == severity]
        if chosen:
            lines += ["", title]
            for i, f in enumerate(chosen, 1):
                lines.append(f"  {i}. {f.title}")
                lines += textwrap.wrap(f.message, _TEXT_WIDTH, initial_indent="     ", subsequent_indent="     ")
    if report.scalers:
        lines += ["", "GradScaler state"]
        for s in report.scalers:
            tracker = "-" if s.growth_tracker is None else str(s.growth_tracker)
            state = (
                "collapsed (persistent overflow)" if s.collapsed else ("low" if s.scale < LOW_SCALER_SCALE else "ok")
            )
            lines.append(f"  {s.path or '<root>'}: scale {s.scale_text}, growth tracker {tracker}: {state}")
    if report.optimizers:
        lines += ["", "Optimizer state"]
        for o in report.optimizers:
            eps = ", ".join(f"{e:g}" for e in sorted(set(o.eps))) or "-"
            lines.append(
                f"  {o.path or '<root>'}: {o.states} parameter state(s), {o.param_groups} param group(s), eps {eps}, "
                f"moments in {', '.join(o.state_dtypes) or '-'}"
            )
    module_rows = _module_rows(report, max_rows)
    if module_rows:
        headers = [
            "module",
            "tensors",
            "values",
            "NaN",
            "inf",
            f">{report.dtype} max",
            "flush fp16",
            "flush bf16",
            "|x|max",
            "headroom bits",
        ]
        lines += [
            "",
            f"Modules (worst first, {min(max_rows, len(module_rows))} shown)",
            tabulate(module_rows, headers=headers, tablefmt="simple", disable_numparse=True),
        ]
    tensor_rows = _tensor_rows(report, max_rows)
    if tensor_rows:
        headers = [
            "tensor",
            "dtype",
            "shape",
            "NaN",
            "inf",
            f">{report.dtype} max",
            f"flush {report.dtype}",
            "|x|max",
            "headroom bits",
        ]
        lines += [
            "",
            "Tensors with inf/NaN or values the format cannot hold",
            tabulate(tensor_rows, headers=headers, tablefmt="simple", disable_numparse=True),
        ]
    if len(report.files) > 1 or any(f.skipped for f in report.files):
        rows = [
            [
                f.name,
                f.format,
                str(f.size_bytes),
                str(f.tensors),
                ", ".join(f"{d} ({n})" for d, n in sorted(f.saved_on.items())) or "-",
                f.skipped or "scanned",
            ]
            for f in report.files[:max_rows]
        ]
        lines += [
            "",
            "Files",
            tabulate(
                rows,
                headers=["file", "format", "bytes", "tensors", "saved on", "status"],
                tablefmt="simple",
                disable_numparse=True,
            ),
        ]
    elif report.saved_on:
        lines += ["", "Saved on: " + ", ".join(f"{d} ({n} tensors)" for d, n in sorted(report.saved_on.items()))]
    return "\n".join(lines)


def with_cuda_note(notes: Iterable[str], saved_on: Mapping[str, int], device_type: str) -> list[str]:
    """Add the device-honesty note for a diagnosis on the CPU of a checkpoint saved from CUDA."""
    out = list(notes)
    cuda = sorted(d for d in saved_on if d.startswith("cuda"))
    if cuda and device_type != "cuda":
        out.append(
            f"the checkpoint was saved from {', '.join(cuda)} and this diagnosis ran on {device_type}: CPU autocast "
            "keeps exp, pow, sum, softmax and layer_norm in the low dtype where CUDA runs them in float32, so a "
            "finding in those ops may not happen on CUDA (rerun with --device cuda to confirm)"
        )
    return out


# CPU autocast leaves these ops in float16/bfloat16; CUDA autocast runs them in float32 (ARCHITECTURE.md §3).
CUDA_FP32_OPS = frozenset(
    {
        "aten::exp",
        "aten::pow",
        "aten::sum",
        "aten::softmax",
        "aten::_softmax",
        "aten::log_softmax",
        "aten::_log_softmax",
        "aten::layer_norm",
        "aten::native_layer_norm",
    }
)
