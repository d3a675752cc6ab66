"""The inputs of ``ampdoctor diagnose``: argument checks that need no torch (run first, so a typo is answered at
once), then the model from its factory and the batch (from a file, or random from ``--input-shape``)."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..errors import InvalidInput, ModelRaised
from ..numbers import fmt_scale
from ..training.bundle_format import BUNDLE_FORMAT
from .batch import Selection, check_batch_argument, parse_selection
from .common import user_code

if TYPE_CHECKING:
    import torch
    from torch import nn

# Random inputs from --input-shape are drawn with this seed, so two runs diagnose the same batch.
INPUT_SEED = 0
# Dtypes --input-shape draws (floating: normal values; integer: token ids; bool: coin flips).
INPUT_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
# A random input larger than this many values is refused (2**31 float32 values are 8 GiB).
MAX_INPUT_VALUES = 2**31
_SHAPE = re.compile(r"^\d+(x\d+)*$")
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


@dataclass(frozen=True)
class DiagnoseInputs:
    """What the arguments say, checked: the shape, the factory's keyword arguments, whether CKPT is a bundle."""

    shape: Optional[tuple[int, ...]]
    model_kwargs: dict[str, Any]
    bundle: bool
    selection: Optional[Selection] = None  # --model-inputs: the part of the batch the model receives


def parse_shape(text: str) -> tuple[int, ...]:
    """``8x3x224x224`` -> (8, 3, 224, 224): positive sizes, at most MAX_INPUT_VALUES values in all."""
    cleaned = text.strip().lower()
    if not _SHAPE.match(cleaned) or any(int(d) == 0 for d in cleaned.split("x")):
        raise InvalidInput(f"--input-shape {text!r}: write positive sizes joined by x, e.g. 8x3x224x224")
    shape = tuple(int(d) for d in cleaned.split("x"))
    if math.prod(shape) > MAX_INPUT_VALUES:
        raise InvalidInput(
            f"--input-shape {text}: {math.prod(shape):.3g} values is more than a random input can hold here (at "
            f"most 2**{int(math.log2(MAX_INPUT_VALUES))}); give a smaller shape, or save a real batch and pass "
            "--batch FILE"
        )
    return shape


def check_dtype_name(name: str) -> str:
    if name not in INPUT_DTYPES:
        raise InvalidInput(
            f"--input-dtype {name!r} is not a real floating, integer or bool dtype ampdoctor draws inputs in; use "
            f"one of: {', '.join(INPUT_DTYPES)}"
        )
    return name


def split_spec(spec: str, option: str) -> tuple[str, str]:
    """``pkg.module:attr.attr`` -> ("pkg.module", "attr.attr"), checked for syntax only (nothing imported)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not _DOTTED.fullmatch(module_name) or not _DOTTED.fullmatch(attr):
        raise InvalidInput(f"{option} {spec!r}: write it as MODULE:NAME, e.g. mypkg.models:build")
    return module_name, attr


def parse_kwargs(text: str) -> dict[str, Any]:
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"--model-kwargs {text!r} is not JSON: {exc.msg}") from exc
    if not isinstance(kwargs, dict):
        raise InvalidInput(f"--model-kwargs must be a JSON object such as '{{\"depth\": 12}}', got {text!r}")
    return kwargs


def check_arguments(args: argparse.Namespace) -> DiagnoseInputs:
    """Every check that needs no torch and no model: paths, syntax, numbers. Raises InvalidInput."""
    from ..checkpoint.sniff import may_be_bundle

    if not os.path.exists(args.checkpoint):
        raise InvalidInput(f"{args.checkpoint}: no such file or directory")
    split_spec(args.model, "--model")
    if args.loss:
        split_spec(args.loss, "--loss")
    kwargs = parse_kwargs(args.model_kwargs)
    if args.scale is not None and not (math.isfinite(args.scale) and args.scale > 0):
        raise InvalidInput(f"--scale must be a positive number, got {fmt_scale(args.scale)}")
    # (the same ranges as diagnose's keywords, said at once and by the flag's name)
    if not 0 <= args.margin_bits <= 8:
        raise InvalidInput(f"--margin-bits must be a number of bits from 0 to 8 (1 means 2x), got {args.margin_bits:g}")
    if not 0 <= args.verify_steps <= 10_000:
        raise InvalidInput(f"--verify-steps must be from 0 (off) to 10000, got {args.verify_steps}")
    if args.batch:
        check_batch_argument(args.batch)
    selection = parse_selection(args.model_inputs) if args.model_inputs else None
    if selection is not None and not args.batch:
        raise InvalidInput("--model-inputs picks the model's part of a --batch that holds targets too: give --batch")
    shape = parse_shape(args.input_shape) if args.input_shape is not None else None
    check_dtype_name(args.input_dtype)
    bundle = may_be_bundle(Path(args.checkpoint), BUNDLE_FORMAT)
    if bundle and (args.batch or shape):
        raise InvalidInput(f"{args.checkpoint} is a failure bundle with its own batch: drop --batch/--input-shape")
    if not bundle and not args.batch and not shape:
        raise InvalidInput("give the model's input: --batch FILE or --input-shape SHAPE (a bundle holds its own)")
    return DiagnoseInputs(shape, kwargs, bundle, selection)


def import_factory(spec: str, option: str = "--model") -> Callable[..., Any]:
    """``pkg.module:attr.attr`` -> the callable. The current directory is importable, as with ``python -m``."""
    module_name, attr = split_spec(spec, option)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        with user_code(f"{option} {spec}: importing {module_name}"):
            obj: Any = importlib.import_module(module_name)
    except InvalidInput:
        raise
    except Exception as exc:  # ImportError, or whatever the user's module raises on import: one line naming it
        raise InvalidInput(
            f"{option} {spec}: cannot import {module_name} ({type(exc).__name__}: {exc}); check the module path "
            "and that its package is installed or in the current directory"
        ) from exc
    try:
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise InvalidInput(f"{option} {spec}: {module_name} has no attribute {attr!r}") from None
    if not callable(obj):
        raise InvalidInput(f"{option} {spec}: {attr} is a {type(obj).__name__}, not a callable that builds a model")
    return obj  # type: ignore[no-any-return]


def build_model(spec: str, kwargs: Mapping[str, Any]) -> nn.Module:
    from torch import nn

    factory = import_factory(spec)
    try:
        with user_code(f"--model {spec}: the factory", "factory"):
            model = factory(**kwargs)
    except ModelRaised:
        raise
    except Exception as exc:  # the user's factory: one line naming it and what it raised
        raise ModelRaised(f"--model {spec}: calling it raised {type(exc).__name__}: {exc}", "factory") from exc
    if not isinstance(model, nn.Module):
        raise InvalidInput(f"--model {spec} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def random_batch(shape: tuple[int, ...], shape_text: str, dtype_name: str, model: nn.Module) -> torch.Tensor:
    """A seeded random tensor; integer dtypes draw ids below the model's smallest embedding table."""
    import torch
    from torch import nn

    dtype = getattr(torch, check_dtype_name(dtype_name))
    generator = torch.Generator().manual_seed(INPUT_SEED)
    try:
        if dtype.is_floating_point:
            return torch.randn(shape, generator=generator).to(dtype)
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=generator).bool()
        sizes = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
        if not sizes:
            raise InvalidInput(
                f"--input-dtype {dtype_name}: no nn.Embedding in the model to take the range of ids from; "
                "save a real batch with torch.save and pass --batch FILE"
            )
        if min(sizes) - 1 > torch.iinfo(dtype).max:
            raise InvalidInput(f"--input-dtype {dtype_name} cannot hold token ids up to {min(sizes) - 1}; use int64")
        return torch.randint(0, min(sizes), shape, generator=generator, dtype=dtype)
    except (RuntimeError, MemoryError) as exc:  # e.g. a shape too large to allocate here
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidInput(f"--input-shape {shape_text}: cannot make that input ({first})") from exc
