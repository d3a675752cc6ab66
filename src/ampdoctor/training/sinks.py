"""Where the watch's scalars and forecasts go: ``watch(..., log_to=...)``.

:func:`make_sink` accepts what people already log with, and never imports a logging library itself unless given
a directory:

* a ``torch.utils.tensorboard.SummaryWriter`` (or anything with ``add_scalar``/``add_text``: tensorboardX, the
  ``experiment`` of Lightning's ``TensorBoardLogger``);
* a W&B run (``wandb.init(...)``): the watch's tags get their own step axis, ``ampdoctor/step``
  (``define_metric``), so they never fight the run's own step counter;
* an Accelerate ``Accelerator`` (``accelerator.log``: every tracker it was given), a Lightning logger
  (``log_metrics``), a Hugging Face ``Trainer`` (``trainer.log``: every ``report_to`` integration);
* any callable ``(tag, value, step)``: ``value`` is a float for a scalar and a str for a forecast;
* a directory (``str`` or ``Path``): a new ``SummaryWriter`` there (needs ``tensorboard``);
* a list or tuple of those: each of them.

Tags: ``ampdoctor/loss_scale``, ``ampdoctor/skipped_steps`` (so far), ``ampdoctor/headroom_bits_min`` (the least
headroom of any module at its latest measurement), ``ampdoctor/headroom_bits/<module>`` (the tightest modules),
``ampdoctor/underflow_share`` (sampled steps) and the text ``ampdoctor/forecast``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Union

from ..capture.options import refuse
from ..errors import AmpDoctorError

PREFIX = "ampdoctor/"
STEP_TAG = PREFIX + "step"

Value = Union[float, str]


class Sink:
    """Receives one step's scalars and texts at once."""

    def log(self, step: int, values: Mapping[str, Value]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Push what is buffered (at the end of the watch)."""


class CallableSink(Sink):
    def __init__(self, fn: Callable[[str, Value, int], Any]) -> None:
        self.fn = fn

    def log(self, step: int, values: Mapping[str, Value]) -> None:
        for tag, value in values.items():
            self.fn(tag, value, step)


class TensorBoardSink(Sink):
    def __init__(self, writer: Any, owned: bool = False) -> None:
        self.writer = writer
        self.owned = owned  # made here from a directory: closed at the end of the watch

    def log(self, step: int, values: Mapping[str, Value]) -> None:
        for tag, value in values.items():
            if isinstance(value, str):
                if hasattr(self.writer, "add_text"):
                    self.writer.add_text(tag, value, step)
            else:
                self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        flush = getattr(self.writer, "close" if self.owned else "flush", None)
        if callable(flush):
            flush()


class WandbSink(Sink):
    def __init__(self, run: Any) -> None:
        self.run = run
        self.defined = False

    def log(self, step: int, values: Mapping[str, Value]) -> None:
        if not self.defined:
            define = getattr(self.run, "define_metric", None)
            if callable(define):
                define(STEP_TAG)
                define(PREFIX + "*", step_metric=STEP_TAG)
            self.defined = True
        self.run.log({STEP_TAG: step, **values})


class DictSink(Sink):
    """``target.<method>(dict, step=step)``: Accelerate's ``log``, Lightning's ``log_metrics``. ``texts``: whether
    the target takes strings (Accelerate's trackers do: TensorBoard's writes them as text)."""

    def __init__(self, log: Callable[..., Any], texts: bool) -> None:
        self.fn = log
        self.texts = texts

    def log(self, step: int, values: Mapping[str, Value]) -> None:
        kept = {k: v for k, v in values.items() if self.texts or not isinstance(v, str)}
        if kept:
            self.fn(kept, step=step)


class Latest(Sink):
    """Keeps the latest value of each scalar and the texts not yet taken: a framework adapter hands them to the
    trainer's own loggers at the trainer's own logging cadence (:mod:`ampdoctor.integrations`)."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self.texts: list[tuple[str, str, int]] = []  # (tag, text, step)

    def log(self, step: int, values: Mapping[str, Value]) -> None:
        for tag, value in values.items():
            if isinstance(value, str):
                self.texts.append((tag, value, step))
            else:
                self.values[tag] = value

    def take_texts(self) -> list[tuple[str, str, int]]:
        texts, self.texts = self.texts, []
        return texts


class ManySinks(Sink):
    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def log(self, step: int, values: Mapping[str, Value]) -> None:
        for s in self.sinks:
            s.log(step, values)

    def flush(self) -> None:
        for s in self.sinks:
            s.flush()


def _writer(directory: Union[str, os.PathLike[str]]) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise AmpDoctorError(
            f"log_to={str(directory)!r} writes TensorBoard event files and needs tensorboard: pip install "
            "tensorboard (or pass a W&B run, or any callable (tag, value, step))"
        ) from None
    return SummaryWriter(log_dir=str(directory))


def accepts(target: Any) -> bool:
    """``target`` is something :func:`make_sink` takes without creating anything (a directory is checked there)."""
    if isinstance(target, (list, tuple)):
        return all(accepts(t) for t in target)
    return isinstance(target, (Sink, str, Path)) or callable(target) or any(
        callable(getattr(target, name, None)) for name in ("add_scalar", "log", "log_metrics")
    )


def make_sink(target: Any) -> Sink:
    """The sink for ``log_to`` (see the module docstring); AmpDoctorError for anything else."""
    if isinstance(target, Sink):
        return target
    if isinstance(target, (list, tuple)):
        return ManySinks([make_sink(t) for t in target])
    if isinstance(target, (str, Path)):
        return TensorBoardSink(_writer(target), owned=True)
    if callable(getattr(target, "add_scalar", None)):
        return TensorBoardSink(target)
    module = type(target).__module__ or ""
    if module.split(".")[0] == "wandb" and callable(getattr(target, "log", None)):
        return WandbSink(target)
    if callable(getattr(target, "log_metrics", None)):  # a Lightning logger
        return DictSink(target.log_metrics, texts=False)
    if callable(getattr(target, "log", None)) and hasattr(target, "trackers"):  # an Accelerator
        return DictSink(target.log, texts=True)
    if module.split(".")[0] == "transformers" and callable(getattr(target, "log", None)):  # a Trainer
        return DictSink(lambda values, step: target.log(dict(values)), texts=False)
    if callable(target):
        return CallableSink(target)
    raise refuse(
        "log_to", target, "a torch.utils.tensorboard.SummaryWriter, a W&B run, an Accelerator, a Lightning logger, "
        "a directory or a callable (tag, value, step)"
    )
