"""The exceptions ampdoctor raises: one base type and a few subclasses that say what went wrong.

Front ends decide by type, never by message text: the CLI exits 2 for any :class:`AmpDoctorError`, and adds
advice that depends on the subclass (:class:`ModelRaised` with ``stage == "forward"`` → check the batch).
"""

from __future__ import annotations

from typing import Literal, Optional

Stage = Literal["factory", "forward", "loss", "backward"]


class AmpDoctorError(RuntimeError):
    """A diagnosis could not be made; the message names the bad value and what to do about it.

    When it wraps an exception from the user's model or loss, that exception is chained as ``__cause__``.
    """


class InvalidInput(AmpDoctorError):
    """A bad argument, batch, option or path given to ampdoctor."""


class ModelRaised(AmpDoctorError):
    """The user's own code (model factory, forward, loss or backward) raised; ``stage`` says which."""

    def __init__(self, message: str, stage: Stage, where: Optional[str] = None) -> None:
        super().__init__(message)
        self.stage: Stage = stage
        self.where = where  # the module running when it raised, when known


class CheckpointError(InvalidInput):
    """A checkpoint or bundle file that cannot be read (missing, empty, truncated, corrupt, not a checkpoint)."""


class CheckpointRefused(CheckpointError):
    """``torch.load(weights_only=True)`` refused a file; ``blocking`` names the globals it would need."""

    def __init__(self, message: str, path: str, blocking: list[str]) -> None:
        super().__init__(message)
        self.path = path
        self.blocking = list(blocking)


class InternalError(AmpDoctorError):
    """ampdoctor itself failed while recording (a bug: please report it with the model class)."""


class OutOfMemory(AmpDoctorError):
    """The first pass (one instrumented AMP step) ran out of memory: nothing could be diagnosed."""


def raised_from(exc: BaseException, kind: type[BaseException]) -> bool:
    """``exc`` is a ``kind``, or was raised from one (its ``__cause__`` / ``__context__`` chain holds one): a pass
    that wraps what the model's code raised keeps the original in that chain."""
    seen: Optional[BaseException] = exc
    while seen is not None:
        if isinstance(seen, kind):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
