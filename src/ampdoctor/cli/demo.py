"""``ampdoctor demo``: diagnose a built-in transformer that overflows in float16."""

from __future__ import annotations

import argparse

from .common import EXIT_OK, add_output_options, emit, render


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
    import torch

    from ..api import diagnose
    from ..demo import demo_loss, make_demo

    model, tokens, targets = make_demo()
    report = diagnose(
        model,
        tokens,
        loss_fn=lambda logits, _: demo_loss(logits, targets),
        dtype=getattr(torch, args.dtype),
        device_type="cpu",
    )
    emit(render(report, args.format), args.output)
    return EXIT_OK

