"""Thin adapters that run ``ampdoctor.watch`` inside the training frameworks people already use.

Each framework is imported only when its adapter is asked for; ampdoctor itself needs neither (they are test
extras). Copy-pasteable examples, run on CPU by ``tests/test_integrations_*.py``:

Lightning (``Trainer.fit``)::

    from ampdoctor.integrations import lightning_callback
    doctor_cb = lightning_callback()
    trainer = lightning.Trainer(precision="16-mixed", callbacks=[doctor_cb])   # "bf16-mixed" on CPU
    trainer.fit(model)
    doctor_cb.report  # the Report, once training ended

Hugging Face ``Trainer``::

    from ampdoctor.integrations import hf_callback
    trainer = transformers.Trainer(model=model, args=TrainingArguments(..., fp16=True), ...)   # bf16=True on CPU
    doctor_cb = hf_callback(trainer)             # adds itself to the trainer
    trainer.train()
    doctor_cb.report  # the Report, once training ended

Accelerate needs no adapter: ``ampdoctor.watch(model, accelerator.scaler, log_to=accelerator)`` around the loop
(see the README); ``log_to=accelerator`` logs through ``accelerator.log`` into every tracker it was given.

**Logging.** Both adapters log the watch's scalars (``ampdoctor/loss_scale``, ``ampdoctor/skipped_steps``,
``ampdoctor/headroom_bits_min``, ``ampdoctor/headroom_bits/<module>``, ``ampdoctor/underflow_share``) into the
trainer's own loggers at the trainer's own cadence: Lightning's ``trainer.loggers`` every ``log_every_n_steps``;
the Hugging Face ``Trainer``'s ``report_to`` integrations with its own logs (every ``logging_steps``). Forecasts
go to the loggers that take text (TensorBoard) and, as always, to the ``ampdoctor`` logger. ``log=False`` turns
this off; ``log_to=...`` sends them elsewhere instead.

Both adapters find the framework's ``GradScaler`` (``scaler.update`` then closes each step). Without one
(bfloat16, or float16 on a CPU where the framework turns AMP to bfloat16) they hand the watch each step's loss
and close the step after the backward and before the optimizer step, so a capture replays the weights of the
failing forward.
"""

from __future__ import annotations

from typing import Any, Optional

from .errors import AmpDoctorError
from .report import Report
from .training.sinks import Latest


class _WatchAdapter:
    """What both adapters share: start a watch on the framework's model and scaler, close it, keep the report."""

    def _setup(self, watch_kwargs: dict[str, Any], log: bool) -> None:
        self.latest: Optional[Latest] = None
        if log and watch_kwargs.get("log_to") is None:
            self.latest = Latest()
            watch_kwargs = {**watch_kwargs, "log_to": self.latest}
        self.watch_kwargs = watch_kwargs
        self.doctor: Any = None
        self.report: Optional[Report] = None
        self._manual_steps = False

    def _start(self, model: Any, scaler: Any) -> None:
        from .training.runtime import watch

        self._stop()
        if scaler is not None and not getattr(scaler, "is_enabled", lambda: True)():
            scaler = None
        self._manual_steps = scaler is None
        self.doctor = watch(model, scaler, **self.watch_kwargs)

    def _loss(self, loss: Any) -> None:
        """Without a scaler nothing else shows the watch the loss."""
        if self.doctor is not None and self._manual_steps:
            self.doctor.see_loss(loss)

    def _step(self) -> None:
        if self.doctor is not None and self._manual_steps:
            self.doctor.step()

    def _stop(self) -> None:
        if self.doctor is not None:
            self.doctor.close()
            self.report = self.doctor.report()
            self.doctor = None

    def close(self) -> None:
        """Remove the watch's hooks now (the frameworks call this at the end of training)."""
        self._stop()


def _lightning_base() -> type:
    base: type
    try:
        from lightning.pytorch import Callback as LightningCallback

        base = LightningCallback
    except ImportError:
        try:
            from pytorch_lightning import Callback as LegacyCallback
        except ImportError:
            raise AmpDoctorError(
                "lightning_callback needs PyTorch Lightning: pip install lightning"
            ) from None
        base = LegacyCallback
    return base


def _lightning_scaler(trainer: Any) -> Any:
    for owner in (trainer, getattr(trainer, "strategy", None)):
        plugin = getattr(owner, "precision_plugin", None)
        if plugin is not None and getattr(plugin, "scaler", None) is not None:
            return plugin.scaler
    return None


def _add_texts(writer: Any, texts: list[tuple[str, str, int]]) -> None:
    """Forecasts to a logger that takes text (a TensorBoard ``SummaryWriter``)."""
    if writer is not None and callable(getattr(writer, "add_text", None)):
        for tag, text, step in texts:
            writer.add_text(tag, text, step)


def lightning_callback(module: Optional[str] = None, *, log: bool = True, **watch_kwargs: Any) -> Any:
    """A Lightning ``Callback`` that watches ``trainer.fit`` (keyword arguments go to ``ampdoctor.watch``).

    ``log``: the watch's scalars go to ``trainer.loggers`` every ``log_every_n_steps`` (forecasts as text to a
    TensorBoard logger).

    ``module``: the submodule to watch (``"net"`` for ``pl_module.net``) when ``training_step`` calls it rather
    than ``self(...)``: captures replay the watched module's forward. After fitting (or an exception),
    ``callback.report`` holds the Report.
    """
    base = _lightning_base()

    class AmpDoctorCallback(base, _WatchAdapter):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self._setup(watch_kwargs, log)

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            watched = pl_module.get_submodule(module) if module else pl_module
            self._start(watched, _lightning_scaler(trainer))

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            self._loss(loss)

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            self._step()  # after the (accumulated) backward, before optimizer.step

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            latest = self.latest
            if latest is None or not latest.values or not trainer.loggers:
                return
            if trainer.global_step % max(1, int(getattr(trainer, "log_every_n_steps", 1) or 1)):
                return
            texts = latest.take_texts()
            for logger in trainer.loggers:
                logger.log_metrics(dict(latest.values), step=trainer.global_step)
                _add_texts(getattr(logger, "experiment", None), texts)

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            self._stop()

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            self._stop()

    return AmpDoctorCallback()


def hf_callback(trainer: Any = None, *, scaler: Any = None, log: bool = True, **watch_kwargs: Any) -> Any:
    """A Hugging Face ``TrainerCallback`` that watches ``trainer.train()``; added to ``trainer`` when given.

    ``log``: the watch's latest scalars join the Trainer's own logs (every ``logging_steps``, to every ``report_to``
    integration; forecasts as text to TensorBoard's writer). Given ``trainer``, the callback goes first in its list
    so that the integrations see them; added by hand, add it before them.

    The scaler is ``scaler`` or the trainer's ``accelerator.scaler``. Without one, steps close at
    ``on_pre_optimizer_step`` (after the backward and gradient clipping, before the optimizer), and the loss comes
    from the model's own output (``output.loss``). After training, ``callback.report`` holds the Report.
    """
    try:
        from transformers import TrainerCallback
    except ImportError:
        raise AmpDoctorError("hf_callback needs transformers: pip install transformers") from None

    class AmpDoctorTrainerCallback(TrainerCallback, _WatchAdapter):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self._setup(watch_kwargs, log)

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            latest = self.latest
            if latest is None or logs is None or not latest.values:
                return
            logs.update(latest.values)  # the same dict every callback after this one logs
            texts = latest.take_texts()
            handler = getattr(trainer, "callback_handler", None)
            for cb in getattr(handler, "callbacks", []):
                _add_texts(getattr(cb, "tb_writer", None), texts)

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            found = scaler
            if found is None and trainer is not None:
                found = getattr(getattr(trainer, "accelerator", None), "scaler", None)
            if model is None and trainer is not None:
                model = trainer.model
            if model is None:
                raise AmpDoctorError("hf_callback: the Trainer passed no model to on_train_begin")
            self._start(model, found)

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._step()

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._stop()

    callback = AmpDoctorTrainerCallback()
    if trainer is not None:
        trainer.add_callback(callback)
        callbacks = getattr(getattr(trainer, "callback_handler", None), "callbacks", None)
        if isinstance(callbacks, list) and callback in callbacks:  # first: on_log adds to the logs they write
            callbacks.insert(0, callbacks.pop(callbacks.index(callback)))
    return callback
