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

Accelerate needs no adapter: ``ampdoctor.watch(model, accelerator.scaler)`` around the loop (see the README).

Both adapters find the framework's ``GradScaler`` (``scaler.update`` then closes each step). Without one
(bfloat16, or float16 on a CPU where the framework turns AMP to bfloat16) they hand the watch each step's loss
and close the step after the backward and before the optimizer step, so a capture replays the weights of the
failing forward.
"""

from __future__ import annotations

from typing import Any, Optional

from .errors import AmpDoctorError
from .report import Report


class _WatchAdapter:
    """What both adapters share: start a watch on the framework's model and scaler, close it, keep the report."""

    def _setup(self, watch_kwargs: dict[str, Any]) -> None:
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


def lightning_callback(module: Optional[str] = None, **watch_kwargs: Any) -> Any:
    """A Lightning ``Callback`` that watches ``trainer.fit`` (keyword arguments go to ``ampdoctor.watch``).

    ``module``: the submodule to watch (``"net"`` for ``pl_module.net``) when ``training_step`` calls it rather
    than ``self(...)``: captures replay the watched module's forward. After fitting (or an exception),
    ``callback.report`` holds the Report.
    """
    base = _lightning_base()

    class AmpDoctorCallback(base, _WatchAdapter):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self._setup(watch_kwargs)

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            watched = pl_module.get_submodule(module) if module else pl_module
            self._start(watched, _lightning_scaler(trainer))

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            self._loss(loss)

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            self._step()  # after the (accumulated) backward, before optimizer.step

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            self._stop()

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            self._stop()

    return AmpDoctorCallback()


def hf_callback(trainer: Any = None, *, scaler: Any = None, **watch_kwargs: Any) -> Any:
    """A Hugging Face ``TrainerCallback`` that watches ``trainer.train()``; added to ``trainer`` when given.

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
            self._setup(watch_kwargs)

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
    return callback
