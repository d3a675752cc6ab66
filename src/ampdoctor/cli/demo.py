"""``ampdoctor demo``: diagnose a built-in transformer that overflows in float16."""

from __future__ import annotations

import argparse

from .common import EXIT_OK, add_output_options, emit, progress_for, render, warnings_as_notes, with_notes
from .fileio import check_output


def add_demo_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "demo",
        help="diagnose a built-in transformer that overflows in float16",
        description="Build a small transformer whose second attention overflows in float16, diagnose it on the "
        "CPU and print the report. Exits 0 when the diagnosis ran (the model is meant to overflow).",
    )
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16", help="autocast dtype")
    add_output_options(parser)
    parser.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    check_output(args.output)
    with progress_for(args) as progress, warnings_as_notes() as warned:
        progress.stage("starting (importing torch)")
        import torch

        from ..api import diagnose
        from ..demo import demo_loss, make_demo

        model, tokens, targets = make_demo()
        progress.stage("diagnosing the demo model")
        report = diagnose(
            model,
            tokens,
            loss_fn=lambda logits, _: demo_loss(logits, targets),
            dtype=getattr(torch, args.dtype),
            device_type="cpu",
            progress=progress,
        )
    emit(render(with_notes(report, warned), args.format), args.output)
    return EXIT_OK
