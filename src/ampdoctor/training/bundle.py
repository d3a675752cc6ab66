"""Failure bundles: one ``torch.save`` file with what a later replay of a failing step needs.

A bundle holds plain tensors, numbers, strings, lists and dicts only, so that it loads with
``torch.load(weights_only=True)``: the failing forward's inputs (and targets), the model's state dict, the
scaler's state, every random stream as it was before that forward (:class:`RngState`: torch CPU, every CUDA
device, Python, numpy), the gradient the real loss sent into the model's outputs when it was kept, and the
watch's records as JSON text. :func:`write_atomic` never leaves a half-written file and never replaces one.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from .._version import __version__
from ..capture.dtypes import dtype_name
from ..errors import AmpDoctorError
from ..records import StepRecord
from ..report import Report
from ..serial import to_plain
from .bundle_format import BUNDLE_FORMAT
from .readback import MicroBatch

PathLike = Union[str, "os.PathLike[str]"]

BUNDLE_VERSION = 1
# Nesting kept of the user's inputs and targets (deeper levels are saved as None).
MAX_TREE_DEPTH = 8


@dataclass(frozen=True)
class Failure:
    """Where a bundle's failure happened, and what the watch knew of it."""

    step: int
    scale: float  # the scale the failing step used
    rank: int
    world_size: int
    dtype: torch.dtype
    device_type: str
    steps: Sequence[StepRecord]  # the watch's records up to and including the failing step
    capture: Optional[Report]  # the capture of the failing step, when it ran


def write_bundle(
    directory: PathLike, failure: Failure, root: nn.Module, m: MicroBatch, scaler_state: Mapping[str, Any]
) -> Path:
    """Save the failing forward ``m`` of ``root`` as ``ampdoctor-bundle-step<N>[-rank<R>].pt`` in ``directory``."""
    grads = m.output_grads()
    if grads is not None and not all(bool(torch.isfinite(g).all()) for g in grads.values()):
        grads = None  # a non-finite loss gradient replays nothing: the replay runs the forward only
    records = {
        "steps": [to_plain(s) for s in failure.steps],
        "capture": failure.capture.to_dict() if failure.capture is not None else None,
    }
    data = {
        "format": BUNDLE_FORMAT,
        "version": BUNDLE_VERSION,
        "ampdoctor_version": __version__,
        "torch_version": str(torch.__version__),
        "step": failure.step,
        "rank": failure.rank,
        "world_size": failure.world_size,
        "model_class": type(root).__name__,
        "args": plain_tree(m.args),
        "kwargs": plain_tree(m.kwargs),
        "targets": plain_tree(m.targets),
        "output_grads": {path: g.detach().clone() for path, g in grads.items()} if grads is not None else None,
        "loss_value": m.loss_value if m.loss_value is not None and math.isfinite(m.loss_value) else None,
        "inputs_changed": m.inputs_changed(),
        "training": root.training,
        "dtype": dtype_name(failure.dtype),
        "device_type": failure.device_type,
        "scale": failure.scale,
        "model_state": {k: v.detach() for k, v in root.state_dict().items()},
        "scaler_state": dict(scaler_state),
        "rng": m.rng.to_plain(),  # the failing forward's streams, all of them
        "records": json.dumps(records, allow_nan=False),
    }
    stem = f"ampdoctor-bundle-step{failure.step}" + (f"-rank{failure.rank}" if failure.world_size > 1 else "")
    return write_atomic(data, directory, stem)


def plain_tree(obj: Any, depth: int = 0) -> Any:
    """Tensors, numbers, strings, lists, tuples and dicts only: what ``torch.load(weights_only=True)`` reads."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()  # a view would save its whole storage
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if depth >= MAX_TREE_DEPTH:
        return None
    if isinstance(obj, Mapping):
        return {str(k): plain_tree(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain_tree(v, depth + 1) for v in obj]
    if isinstance(obj, tuple):
        return tuple(plain_tree(v, depth + 1) for v in obj)
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain_tree(getattr(obj, f.name, None), depth + 1) for f in fields(obj)}
    return None


def write_atomic(obj: Any, directory: PathLike, stem: str) -> Path:
    """``torch.save`` to a temporary file, then link it to ``<stem>.pt`` (or ``<stem>-1.pt`` ...).

    The final name appears complete or not at all, and an existing file is never replaced.
    """
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        for n in itertools.count():
            final = folder / (f"{stem}.pt" if n == 0 else f"{stem}-{n}.pt")
            try:
                os.link(tmp, final)  # atomic, and fails rather than replace an existing file
            except FileExistsError:
                continue
            except OSError:  # a file system without hard links
                if final.exists():
                    continue
                os.rename(tmp, final)
            return final
        raise AssertionError("unreachable")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_bundle(path: PathLike) -> dict[str, Any]:
    """Read a failure bundle written by ``watch`` (``torch.load`` with ``weights_only=True``, on the CPU)."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise AmpDoctorError(f"no such file: {path}") from None
    except Exception as exc:  # torch.load raises many kinds for a file that is not a bundle: all mean that
        raise AmpDoctorError(f"{path} is not an ampdoctor failure bundle ({type(exc).__name__}: {exc})") from exc
    if not isinstance(data, dict) or data.get("format") != BUNDLE_FORMAT:
        raise AmpDoctorError(f"{path} is not an ampdoctor failure bundle (no format marker {BUNDLE_FORMAT!r})")
    _check_fields(data, path)
    if data.get("version", 0) > BUNDLE_VERSION:
        raise AmpDoctorError(
            f"{path} is a version {data.get('version')} bundle, newer than this ampdoctor reads ({BUNDLE_VERSION}); "
            "upgrade ampdoctor (pip install -U ampdoctor)"
        )
    return data


def _check_fields(data: dict[str, Any], path: PathLike) -> None:
    """The fields a replay reads, of the types ``write_bundle`` writes: a bundle is a file like any other, and a
    wrong one is bad input (one line), not an internal error deep inside the replay."""
    def malformed(key: str, value: Any, what: str) -> AmpDoctorError:
        return AmpDoctorError(f"{path} is a malformed ampdoctor failure bundle: {key} is {value!r:.60}, not {what}")

    for key in ("version", "step", "rank", "world_size"):
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise malformed(key, value, "an integer")
    value = data.get("scale")
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise malformed("scale", value, "a number")
    for key, kind, what in (("model_state", Mapping, "a state dict"), ("records", str, "JSON text"),
                            ("kwargs", Mapping, "a dict of keyword arguments")):
        value = data.get(key)
        if value is not None and not isinstance(value, kind):
            raise malformed(key, value, what)
    if data.get("model_state") is None:
        raise malformed("model_state", None, "a state dict")


def is_bundle(path: PathLike) -> bool:
    """True when ``path`` is a failure bundle (a cheap check for front ends that accept several kinds of file)."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # not loadable as a weights-only torch file (whatever the reason): not a bundle
        return False
    return isinstance(data, dict) and data.get("format") == BUNDLE_FORMAT
