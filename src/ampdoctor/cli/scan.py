"""``ampdoctor scan PATH``: check a saved checkpoint's tensors, optimizer and GradScaler state."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import TYPE_CHECKING

from ..errors import InvalidInput
from .common import (
    add_loading_options,
    add_output_options,
    allowed_globals,
    emit,
    progress_for,
    trusted_packages,
    warn_unsafe,
    warnings_as_notes,
)
from .fileio import check_output

if TYPE_CHECKING:
    from ..report.scan_report import ScanReport

SCAN_FORMATS = ("text", "json", "markdown")


def add_scan_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "scan",
        help="check a saved checkpoint's tensors, optimizer and GradScaler state (no model code needed)",
        description="Read a checkpoint and report, per tensor and per module, inf/NaN, values beyond the float16 "
        "range, nonzero values that flush to zero in float16 and bfloat16, and headroom; Adam moments that are "
        "non-finite, eps that is zero in float16 with float16 optimizer state, and a GradScaler scale that "
        "collapsed. float8 tensors are judged against their own format. PATH is a torch.save'd state dict or "
        "training checkpoint, a .safetensors file, or a directory of shards (read one file at a time). The "
        "checkpoint is only read.",
        epilog="Exit status: 0 healthy (or warnings only), 1 findings, 2 usage or input error (a refused, corrupt "
        "or non-checkpoint file included).",
    )
    parser.add_argument(
        "path",
        metavar="PATH",
        help="checkpoint file (.pt, .bin, .ckpt, .safetensors), folder of shards (Hugging Face, Accelerate "
        "save_state), or torch.distributed.checkpoint folder (.metadata + *.distcp)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float16", "bfloat16"],
        default="float16",
        help="the autocast format the verdict is about (default: float16); counts for both are shown",
    )
    parser.add_argument("--max-rows", type=int, default=20, metavar="N", help="rows per table (default: 20)")
    add_loading_options(parser)
    add_output_options(parser, SCAN_FORMATS)
    parser.set_defaults(func=run_scan)


def render_scan(report: ScanReport, fmt: str, max_rows: int = 20) -> str:
    if fmt == "json":
        return report.to_json(indent=2)
    if fmt == "markdown":
        return report.to_markdown(max_rows)
    return report.to_text(max_rows)


def run_scan(args: argparse.Namespace) -> int:
    """Check the arguments (no torch yet), scan, and write the report."""
    if args.max_rows < 1:
        raise InvalidInput(f"--max-rows must be at least 1, got {args.max_rows}")
    if not os.path.exists(args.path):
        raise InvalidInput(f"{args.path}: no such file or directory")
    check_output(args.output, [args.path])
    globals_ = allowed_globals(args)
    trust = trusted_packages(args)
    warn_unsafe(args)
    with progress_for(args) as progress, warnings_as_notes() as warned:
        progress.stage("starting (importing torch)")
        from ..checkpoint.scan import scan

        report = scan(
            args.path,
            dtype=args.dtype,
            allow_globals=globals_,
            unsafe_load=args.unsafe_load,
            trust=trust,
            progress=progress,
        )
    if warned:
        report = dataclasses.replace(report, notes=(*report.notes, *warned))
    emit(render_scan(report, args.format, args.max_rows), args.output, [args.path])
    return report.exit_code
