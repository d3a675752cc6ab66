"""``ampdoctor diagnose CKPT --model pkg:factory``: load a checkpoint (or a failure bundle) and diagnose it."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..errors import InvalidInput, ModelRaised
from ..numbers import fmt_scale
from .batch import describe, load_batch, select_inputs, to_device
from .common import (
    FORMATS,
    add_loading_options,
    add_output_options,
    allowed_globals,
    emit,
    progress_for,
    render,
    trusted_packages,
    user_code,
    warn_unsafe,
    warnings_as_notes,
    with_notes,
)
from .fileio import check_output
from .inputs import (
    INPUT_DTYPES,
    INPUT_SEED,
    DiagnoseInputs,
    build_model,
    check_arguments,
    import_factory,
    random_batch,
)

if TYPE_CHECKING:
    import torch

    from ..capture.progress import Progress
    from ..report import Report


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
        help="checkpoint file, folder of shards (Hugging Face, Accelerate save_state), torch.distributed.checkpoint "
        "folder, or a failure bundle written by ampdoctor.watch (which holds its own batch)",
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
        help="loss function FN(output, batch) -> scalar, as diagnose()'s loss_fn: batch is the whole --batch, "
        "targets included, also with --model-inputs (for a bundle: FN(output, targets) when the watch had "
        "targets); without it: a scalar output, output.loss, or a surrogate",
    )
    inputs = parser.add_mutually_exclusive_group()
    inputs.add_argument(
        "--batch",
        metavar="FILE|MODULE:FUNCTION",
        help="the batch, as a DataLoader yields it: a tensor, a tuple/list such as (inputs, targets), or a dict; "
        "from a file (.pt, loaded like a checkpoint: weights_only, --allow-global, --unsafe-load; .npy; .npz: "
        "arr_0, arr_1, ... are positional, other names are keywords) or returned by FUNCTION() (the current "
        "directory is importable). The model gets it by diagnose()'s rule: a tensor -> model(x), a tuple/list "
        "-> model(*batch), a dict -> model(**batch); or only the part --model-inputs names",
    )
    inputs.add_argument(
        "--input-shape",
        metavar="SHAPE",
        help="a RANDOM input of this shape, e.g. 8x3x224x224 (seeded); the report then says its verdict is on "
        "random input, which says nothing about your data",
    )
    parser.add_argument(
        "--model-inputs",
        metavar="WHICH",
        help="when --batch holds targets too: the part the model gets, by the same rule: positions of the tuple "
        "(0 -> model(batch[0]); 0,1 -> model(batch[0], batch[1])) or keys of the dict (input_ids,attention_mask "
        "-> model(input_ids=..., attention_mask=...)); --loss still gets the whole batch",
    )
    parser.add_argument(
        "--input-dtype",
        default="float32",
        metavar="DTYPE",
        help="dtype of the --input-shape tensor (default: float32; integer dtypes draw token ids below the "
        f"model's smallest nn.Embedding size): {', '.join(INPUT_DTYPES)}",
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
    parser.add_argument(
        "--margin-bits",
        type=float,
        default=1.0,
        metavar="B",
        help="a float32 fallback is verified only when every instance of the fixed mechanism keeps B bits of "
        "headroom below the format's max in the re-run (0 to 8; default: 1, i.e. 2x)",
    )
    parser.add_argument(
        "--underflow-reference",
        choices=["auto", "always", "never"],
        default="auto",
        help="the backward that counts gradient values lost to underflow: auto (default) skips it when the "
        "survey's own gradients show it would find almost nothing (the report's notes say so), always runs it, "
        "never runs it",
    )
    parser.add_argument(
        "--verify-steps",
        type=int,
        default=0,
        metavar="K",
        help="train K steps on the batch (a copy of the model, AdamW lr 1e-3, GradScaler) with the first verified "
        "fallback or rewrite, and say whether it holds (default: 0, off)",
    )
    add_loading_options(parser)
    add_output_options(parser, FORMATS)
    parser.set_defaults(func=run_diagnose)


def _device(name: str) -> torch.device:
    """Where the tensors go. ``--device cuda`` on a machine without CUDA keeps them on the CPU: the diagnosis
    then follows CUDA's autocast policy, emulated (``diagnose(device_type="cuda")``)."""
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device(name)


def _checkpoint_scale(
    args: argparse.Namespace, scaler_scale: Optional[float], scaler_path: str
) -> tuple[Optional[float], str, list[str]]:
    """The loss scale to diagnose at, where it came from, and notes."""
    if args.scale is not None:  # checked by check_arguments
        return args.scale, "--scale", []
    if scaler_scale is None:
        return None, "", []
    where = scaler_path or "<root>"
    if args.dtype != "float16":
        ignored = f"the checkpoint's GradScaler scale ({fmt_scale(scaler_scale)}) was ignored: bfloat16 runs unscaled"
        return None, "", [ignored]
    if not (math.isfinite(scaler_scale) and scaler_scale > 0):
        note = (
            f"the checkpoint's GradScaler scale is {fmt_scale(scaler_scale)} (collapsed): diagnosed at the default "
            "scale"
        )
        return None, "", [note]
    return scaler_scale, f"the checkpoint's GradScaler state ({where})", []


def _saved_from_cuda(saved_on: Mapping[str, int], device_type: str) -> list[str]:
    """The device-honesty note for a diagnosis off CUDA of a checkpoint saved from CUDA."""
    from ..autocast_ops import saved_from_cuda_note

    cuda = sorted(d for d in saved_on if d.startswith("cuda"))
    return [saved_from_cuda_note(cuda, device_type)] if cuda and device_type != "cuda" else []


def run_diagnose(args: argparse.Namespace) -> int:
    """Check the arguments (no torch yet), then build, load, diagnose and write the report."""
    plan = check_arguments(args)
    inputs = [p for p in (args.checkpoint, args.batch) if p and os.path.exists(p)]
    check_output(args.output, inputs)
    globals_ = allowed_globals(args)
    trusted_packages(args, args.model)  # checked before torch is imported
    warn_unsafe(args)
    with progress_for(args) as progress, warnings_as_notes() as warned:
        progress.stage("starting (importing torch)")
        import torch

        # The model factory and a random batch draw from torch's CPU RNG: a caller of main() gets it back as it was,
        # also when a Ctrl-C stops the run inside the factory (before diagnose's own RNG snapshot).
        with torch.random.fork_rng(devices=[]):
            report = _run_diagnose(args, plan, globals_, progress)
    inputs += _source_files(args)  # -o must not replace the factory's (or loss's) own source either
    emit(render(with_notes(report, warned), args.format), args.output, inputs)
    return report.exit_code


def _source_files(args: argparse.Namespace) -> list[str]:
    """The files of the modules ``--model`` and ``--loss`` were imported from."""
    files = []
    batch_spec = args.batch if args.batch and not os.path.exists(args.batch) else None
    for spec in (args.model, args.loss, batch_spec):
        module = sys.modules.get((spec or "").partition(":")[0])
        path = getattr(module, "__file__", None)
        if isinstance(path, str):
            files.append(path)
    return files


def _run_diagnose(args: argparse.Namespace, plan: DiagnoseInputs, globals_: list[str], progress: Progress) -> Report:
    import torch

    from ..api import diagnose
    from ..checkpoint.load_weights import load_weights

    device = _device(args.device)
    progress.stage("importing the model code")
    loss_fn = import_factory(args.loss, "--loss") if args.loss else None
    if plan.bundle and _is_bundle(args.checkpoint):
        return _replay(args, plan, loss_fn, device, progress)
    if plan.bundle:  # the marker was there, but it does not load as a bundle
        raise InvalidInput("give the model's input: --batch FILE or --input-shape SHAPE (a bundle holds its own)")
    progress.stage("building the model")
    model = build_model(args.model, plan.model_kwargs)
    loaded = load_weights(
        model,
        args.checkpoint,
        allow_globals=globals_,
        unsafe_load=args.unsafe_load,
        trust=trusted_packages(args, args.model),
        progress=progress,
    )
    progress.stage("making the batch")
    if plan.shape is not None:
        batch = random_batch(plan.shape, args.input_shape, args.input_dtype, model)
    else:
        batch = load_batch(args.batch, import_factory, globals_, args.unsafe_load)
    scale, scale_source, notes = _checkpoint_scale(args, loaded.scaler_scale, loaded.scaler_path)
    model.to(device)
    batch = to_device(batch, device)
    fed, model_loss = batch, loss_fn
    if plan.selection is not None:
        fed = select_inputs(batch, plan.selection, f"--batch {args.batch}")
        model_loss = None if loss_fn is None else _whole_batch_loss(loss_fn, batch)
    progress.stage("diagnosing (several instrumented passes)")
    try:
        with user_code("the model or its loss, during the diagnosis"):
            report = diagnose(
                model,
                fed,
                dtype=getattr(torch, args.dtype),
                device_type=args.device,
                scale=scale,
                loss_fn=model_loss,
                progress=progress,
                margin_bits=args.margin_bits,
                verify_steps=args.verify_steps,
                underflow_reference=args.underflow_reference,
            )
    except ModelRaised as exc:
        if exc.stage != "forward":
            raise
        raise ModelRaised(f"{exc}; {_forward_hint(args, plan, batch)}", exc.stage, exc.where) from exc
    run = report.run
    run = dataclasses.replace(
        run,
        random_input=f"--input-shape {args.input_shape}, {args.input_dtype}, seed {INPUT_SEED}" if plan.shape else "",
        scale_source=scale_source or run.scale_source,
        notes=(*run.notes, *notes, *_saved_from_cuda(loaded.saved_on, run.device_type)),
    )
    return dataclasses.replace(report, run=run)


def _whole_batch_loss(loss_fn: Callable[..., Any], batch: Any) -> Callable[[Any, Any], Any]:
    """``--loss FN`` with ``--model-inputs``: FN(output, the whole batch), targets included."""

    def loss(output: Any, _inputs: Any) -> Any:
        return loss_fn(output, batch)

    return loss


def _forward_hint(args: argparse.Namespace, plan: DiagnoseInputs, batch: Any) -> str:
    """What to check when the model's forward raised on the batch."""
    if args.batch is None:
        return f"check that --input-shape {args.input_shape} fits what the model expects"
    hint = f"check that --batch {args.batch} ({describe(batch)}) fits what the model expects"
    if plan.selection is None and not _is_tensor(batch):
        hint += (
            "; if it holds targets too (inputs, targets), give the model only its part: --model-inputs 0 (or the "
            "dict keys the forward takes)"
        )
    return hint


def _is_tensor(batch: Any) -> bool:
    import torch

    return isinstance(batch, torch.Tensor)


def _is_bundle(path_text: str) -> bool:
    from ..training.bundle import is_bundle

    return is_bundle(path_text)


def _replay(
    args: argparse.Namespace,
    plan: DiagnoseInputs,
    loss_fn: Optional[Callable[..., Any]],
    device: torch.device,
    progress: Progress,
) -> Report:
    """A failure bundle from ``ampdoctor.watch``: its saved batch, state and RNG on a fresh model."""
    from ..training.replay import replay_bundle

    ignored = [
        flag
        for flag, given in (
            ("--scale", args.scale is not None),
            ("--dtype", args.dtype != "float16"),
            ("--input-dtype", args.input_dtype != "float32"),
            ("--allow-global", bool(args.allow_global)),
            ("--unsafe-load", args.unsafe_load),
            ("--trust", bool(args.trust)),
        )
        if given
    ]
    if ignored:
        raise InvalidInput(
            f"{args.checkpoint} is a failure bundle: it replays the step's own scale and dtype and loads safely; "
            f"drop {', '.join(ignored)}"
        )
    progress.stage("replaying the failure bundle")
    with user_code("the model or its loss, during the replay"):
        return replay_bundle(
            args.checkpoint, lambda: build_model(args.model, plan.model_kwargs), loss_fn, device=device
        )
