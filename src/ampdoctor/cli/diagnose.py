"""``ampdoctor diagnose CKPT --model pkg:factory``: load a checkpoint (or a failure bundle) and diagnose it."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..errors import AmpDoctorError, ModelRaised
from .common import (
    FORMATS,
    add_loading_options,
    add_output_options,
    allowed_globals,
    emit,
    guard_output,
    one_line,
    progress_printer,
    quiet_unsafe_warning,
    render,
    warn_unsafe,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..report import Report

# Random inputs from --input-shape are drawn with this seed, so two runs diagnose the same batch.
INPUT_SEED = 0
_SHAPE = re.compile(r"^\d+(x\d+)*$")


def add_diagnose_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "diagnose",
        help="load a checkpoint into your model and find where AMP makes the first inf/NaN",
        description="Build the model with FACTORY, load the checkpoint's weights into it (every key and shape "
        "must match), run one instrumented autocast step on a batch and print the report: the module whose own "
        "code first made inf/NaN (forward or backward), headroom, gradient underflow, loss-scale window, "
        "recommendations. Same report as ampdoctor.diagnose() in Python.",
        epilog="Example: ampdoctor diagnose ckpt.pt --model mypkg.models:build --model-kwargs '{\"depth\": 12}' "
        "--input-shape 8x3x224x224. Exit status: 0 healthy (or warnings only), 1 findings, 2 usage or input error.",
    )
    parser.add_argument(
        "checkpoint",
        metavar="CKPT",
        help="checkpoint file, directory of shards, or a failure bundle written by ampdoctor.watch (which holds "
        "its own batch)",
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="MODULE:FACTORY",
        help="a callable that returns the nn.Module, e.g. mypkg.models:build or torchvision.models:resnet50 "
        "(the current directory is importable)",
    )
    parser.add_argument("--model-kwargs", metavar="JSON", default="{}", help="keyword arguments for FACTORY (JSON)")
    parser.add_argument(
        "--loss",
        metavar="MODULE:FN",
        help="loss function FN(output, batch) -> scalar (for a bundle: FN(output, targets) when the watch had "
        "targets); without it: a scalar output, output.loss, or a surrogate",
    )
    inputs = parser.add_mutually_exclusive_group()
    inputs.add_argument(
        "--batch",
        metavar="FILE",
        help="the model's input: .pt (a tensor -> model(x), a tuple -> model(*x), a dict -> model(**x)), .npy, "
        ".npz (arr_0, arr_1, ... are positional, other names are keywords)",
    )
    inputs.add_argument("--input-shape", metavar="SHAPE", help="random input of this shape, e.g. 8x3x224x224")
    parser.add_argument(
        "--input-dtype",
        default="float32",
        metavar="DTYPE",
        help="dtype of the --input-shape tensor (default: float32; integer dtypes draw token ids below the "
        "model's smallest nn.Embedding size)",
    )
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16", help="autocast dtype")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to run (default: cpu)")
    parser.add_argument(
        "--scale",
        type=float,
        metavar="S",
        help="loss scale of the backward (default: the checkpoint's GradScaler scale if it has one, else 65536 "
        "for float16, 1 for bfloat16)",
    )
    add_loading_options(parser)
    add_output_options(parser, FORMATS)
    parser.set_defaults(func=run_diagnose)


def import_factory(spec: str, option: str = "--model") -> Callable[..., Any]:
    """``pkg.module:attr.attr`` -> the callable. The current directory is importable, as with ``python -m``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise AmpDoctorError(f"{option} {spec!r}: write it as MODULE:NAME, e.g. mypkg.models:build")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the user's module raises on import
        raise AmpDoctorError(
            f"{option} {spec}: cannot import {module_name} ({type(exc).__name__}: {exc}); check the module path "
            "and that its package is installed or in the current directory"
        ) from exc
    try:
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise AmpDoctorError(f"{option} {spec}: {module_name} has no attribute {attr!r}") from None
    if not callable(obj):
        raise AmpDoctorError(f"{option} {spec}: {attr} is a {type(obj).__name__}, not a callable that builds a model")
    return obj  # type: ignore[no-any-return]


def build_model(spec: str, kwargs_json: str) -> nn.Module:
    from torch import nn

    try:
        kwargs = json.loads(kwargs_json)
    except json.JSONDecodeError as exc:
        raise AmpDoctorError(f"--model-kwargs {kwargs_json!r} is not JSON: {exc.msg}") from exc
    if not isinstance(kwargs, dict):
        raise AmpDoctorError(f"--model-kwargs must be a JSON object such as '{{\"depth\": 12}}', got {kwargs_json!r}")
    factory = import_factory(spec)
    try:
        model = factory(**kwargs)
    except Exception as exc:  # the user's factory
        raise AmpDoctorError(f"--model {spec}: calling it raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise AmpDoctorError(f"--model {spec} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _dtype(name: str) -> torch.dtype:
    import torch

    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype) or value.is_complex or value.itemsize < 1 or "qint" in str(value):
        raise AmpDoctorError(f"--input-dtype {name!r} is not a real floating, integer or bool dtype (e.g. int64)")
    return value


def random_batch(shape_text: str, dtype_name: str, model: nn.Module) -> torch.Tensor:
    """A seeded random tensor; integer dtypes draw ids below the model's smallest embedding table."""
    import torch
    from torch import nn

    text = shape_text.strip().lower()
    if not _SHAPE.match(text) or any(int(d) == 0 for d in text.split("x")):
        raise AmpDoctorError(f"--input-shape {shape_text!r}: write positive sizes joined by x, e.g. 8x3x224x224")
    shape = tuple(int(d) for d in text.split("x"))
    dtype = _dtype(dtype_name)
    generator = torch.Generator().manual_seed(INPUT_SEED)
    try:
        if dtype.is_floating_point:
            return torch.randn(shape, generator=generator).to(dtype)
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=generator).bool()
        sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
        if not sizes:
            raise AmpDoctorError(
                f"--input-dtype {dtype_name}: no nn.Embedding in the model to take the range of ids from; "
                "save a real batch with torch.save and pass --batch FILE"
            )
        if min(sizes) - 1 > torch.iinfo(dtype).max:
            raise AmpDoctorError(f"--input-dtype {dtype_name} cannot hold token ids up to {min(sizes) - 1}; use int64")
        return torch.randint(0, min(sizes), shape, generator=generator, dtype=dtype)
    except (RuntimeError, MemoryError) as exc:  # e.g. a shape too large to allocate
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AmpDoctorError(f"--input-shape {shape_text}: cannot make that input ({first})") from exc


def load_batch(path_text: str) -> Any:
    """A batch from .pt (weights_only), .npy or .npz (no pickles)."""
    import numpy as np
    import torch

    path = Path(path_text)
    if not path.is_file():
        raise AmpDoctorError(f"--batch {path_text}: no such file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            return torch.from_numpy(np.load(path, allow_pickle=False))
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as data:
                arrays = {k: torch.from_numpy(data[k]) for k in data.files}
            if arrays and all(re.fullmatch(r"arr_\d+", k) for k in arrays):
                ordered = [arrays[k] for k in sorted(arrays, key=lambda k: int(k[4:]))]
                return ordered[0] if len(ordered) == 1 else tuple(ordered)
            return arrays
        batch = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # numpy/torch raise many types for a bad file: one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AmpDoctorError(
            f"--batch {path_text}: not a readable batch ({type(exc).__name__}: {first}); save a tensor, tuple or "
            "dict with torch.save (.pt), or an array with numpy.save (.npy) / numpy.savez (.npz)"
        ) from exc
    if isinstance(batch, list):
        batch = tuple(batch)
    if not isinstance(batch, (torch.Tensor, tuple, Mapping)):
        raise AmpDoctorError(f"--batch {path_text}: holds a {type(batch).__name__}; expected a tensor, tuple or dict")
    return batch


def _to_device(batch: Any, device: torch.device) -> Any:
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, tuple):
        return tuple(_to_device(b, device) for b in batch)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


def _device(name: str) -> torch.device:
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise AmpDoctorError("--device cuda: no CUDA device is available here (use --device cpu)")
    return torch.device(name)


def _checkpoint_scale(
    args: argparse.Namespace, scaler_scale: Optional[float], scaler_path: str
) -> tuple[Optional[float], str, list[str]]:
    """The loss scale to diagnose at, where it came from, and notes."""
    if args.scale is not None:
        if not (math.isfinite(args.scale) and args.scale > 0):
            raise AmpDoctorError(f"--scale must be a positive number, got {args.scale:g}")
        return args.scale, "--scale", []
    if scaler_scale is None:
        return None, "", []
    where = scaler_path or "<root>"
    if args.dtype != "float16":
        return None, "", [f"the checkpoint's GradScaler scale ({scaler_scale:g}) was ignored: bfloat16 runs unscaled"]
    if not (math.isfinite(scaler_scale) and scaler_scale > 0):
        note = f"the checkpoint's GradScaler scale is {scaler_scale:g} (collapsed): diagnosed at the default scale"
        return None, "", [note]
    return scaler_scale, f"the checkpoint's GradScaler state ({where})", []


def _saved_from_cuda(saved_on: Mapping[str, int], device_type: str) -> list[str]:
    """The device-honesty note for a diagnosis off CUDA of a checkpoint saved from CUDA."""
    from ..capture.policy import saved_from_cuda_note

    cuda = sorted(d for d in saved_on if d.startswith("cuda"))
    return [saved_from_cuda_note(cuda, device_type)] if cuda and device_type != "cuda" else []


def _cuda_fp32_warning(report: Report) -> list[str]:
    """Mark an origin op that CUDA autocast runs in float32 when the diagnosis ran on the CPU."""
    from ..capture.policy import cuda_runs_in_fp32

    if report.run.device_type == "cuda":
        return []
    out = []
    for origin in (report.findings.forward_origin, report.findings.backward_origin):
        if origin is not None and origin.op is not None and cuda_runs_in_fp32(origin.op.op):
            out.append(
                f"the {origin.direction} origin op {origin.op.op} runs in float32 under CUDA autocast: this "
                f"finding comes from CPU autocast and may not happen on CUDA (rerun with --device cuda)"
            )
    return out


def run_diagnose(args: argparse.Namespace) -> int:
    try:
        return _run_diagnose(args)
    except AmpDoctorError as exc:
        raise one_line(exc) from exc


def _run_diagnose(args: argparse.Namespace) -> int:
    import torch

    from ..api import diagnose
    from ..checkpoint.load_weights import load_weights

    guard_output(args.output, args.checkpoint)
    device = _device(args.device)
    loss_fn = import_factory(args.loss, "--loss") if args.loss else None
    if _is_bundle(args.checkpoint):
        return _replay(args, loss_fn, device)
    if not args.batch and not args.input_shape:
        raise AmpDoctorError("give the model's input: --batch FILE or --input-shape SHAPE (a bundle holds its own)")
    model = build_model(args.model, args.model_kwargs)
    warn_unsafe(args)
    with quiet_unsafe_warning():
        loaded = load_weights(
            model,
            args.checkpoint,
            allow_globals=allowed_globals(args),
            unsafe_load=args.unsafe_load,
            progress=progress_printer(),
        )
    batch = load_batch(args.batch) if args.batch else random_batch(args.input_shape, args.input_dtype, model)
    scale, scale_source, notes = _checkpoint_scale(args, loaded.scaler_scale, loaded.scaler_path)
    model.to(device)
    try:
        report = diagnose(
            model,
            _to_device(batch, device),
            dtype=getattr(torch, args.dtype),
            device_type=device.type,
            scale=scale,
            loss_fn=loss_fn,
        )
    except ModelRaised as exc:
        if exc.stage != "forward":
            raise
        source = f"--batch {args.batch}" if args.batch else f"--input-shape {args.input_shape}"
        raise ModelRaised(f"{exc}; check that {source} fits what the model expects", exc.stage, exc.where) from exc
    run = report.run
    run = dataclasses.replace(
        run,
        scale_source=scale_source or run.scale_source,
        notes=(*run.notes, *notes, *_saved_from_cuda(loaded.saved_on, device.type)),
    )
    findings = dataclasses.replace(report.findings, warnings=(*report.findings.warnings, *_cuda_fp32_warning(report)))
    report = dataclasses.replace(report, run=run, findings=findings)
    emit(render(report, args.format), args.output)
    return report.exit_code


def _is_bundle(path_text: str) -> bool:
    from ..training.bundle import is_bundle

    return os.path.isfile(path_text) and is_bundle(path_text)


def _replay(args: argparse.Namespace, loss_fn: Optional[Callable[..., Any]], device: torch.device) -> int:
    """A failure bundle from ``ampdoctor.watch``: its saved batch, state and RNG on a fresh model."""
    from ..training.replay import replay_bundle

    if args.batch or args.input_shape:
        raise AmpDoctorError(f"{args.checkpoint} is a failure bundle with its own batch: drop --batch/--input-shape")
    ignored = [
        flag
        for flag, given in (
            ("--scale", args.scale is not None),
            ("--dtype", args.dtype != "float16"),
            ("--input-dtype", args.input_dtype != "float32"),
            ("--allow-global", bool(args.allow_global)),
            ("--unsafe-load", args.unsafe_load),
        )
        if given
    ]
    if ignored:
        raise AmpDoctorError(
            f"{args.checkpoint} is a failure bundle: it replays the step's own scale and dtype and loads safely; "
            f"drop {', '.join(ignored)}"
        )
    report = replay_bundle(args.checkpoint, lambda: build_model(args.model, args.model_kwargs), loss_fn, device=device)
    emit(render(report, args.format), args.output)
    return report.exit_code
