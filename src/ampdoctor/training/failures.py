"""What the watch does with each finished step: run bookkeeping, captures of failing steps, the failure bundle.

:class:`FailureTracker` feeds every step record to the pure :class:`~.runs.RunTracker`, runs a capture
(``diagnose`` of the failing forward, :mod:`.replay_step`) where a run starts or turns persistent, within a
budget per kind, points later skips of a run at its capture, and writes the failure bundle once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from torch import nn

from ..records import StepRecord
from .bundle import Failure, PathLike, write_bundle
from .readback import MicroBatch
from .replay_step import Capture, StepReplayer, capture, with_capture
from .runs import CaptureKind, Run, RunTracker


@dataclass(eq=False)
class FailureTracker:
    """Runs of bad steps, the captures that explain them and the failure bundle, for one rank's watch."""

    root: nn.Module
    max_captures: int  # per kind of capture
    save_bundle: bool
    bundle_dir: Optional[PathLike]  # None: the current directory
    rank: int
    world_size: int
    scaler: Any  # its state goes into the bundle
    note: Callable[[str], None]  # what failed (a capture, the bundle) goes to the report's notes
    runs: RunTracker = field(default_factory=RunTracker)
    captures: list[Capture] = field(default_factory=list)
    failure: Optional[Capture] = None  # the capture of the first persistent failure
    first_local: Optional[int] = None  # the first step whose own forward or gradients went non-finite
    bundle_path: Optional[Path] = None
    used: dict[CaptureKind, int] = field(default_factory=lambda: {"run_start": 0, "persistent": 0})

    def track(
        self,
        record: StepRecord,
        micro: list[MicroBatch],
        bad_micro: list[bool],
        replayer: StepReplayer,
        history: Sequence[StepRecord],
    ) -> StepRecord:
        """The step's record with what its capture (or its run's) found; captures and the bundle on the way.

        ``history`` is the steps recorded before this one (for the bundle's records). Never raises from a capture
        or a bundle: what fails becomes a note.
        """
        observed = self.runs.observe(record)
        run = observed.run
        if run is None:  # a good step
            return record
        kind = observed.capture
        captured: Optional[Capture] = None
        if kind is not None and micro and self.used[kind] < self.max_captures:
            self.used[kind] += 1
            captured = capture(replayer, micro, bad_micro, record.step, record.scale, self.note)
            if captured is not None:
                self.captures.append(captured)
                self.runs.explained_by(record.step)
                record = with_capture(record, captured.report, captured.local_nonfinite)
                if kind == "persistent":
                    self.failure = self.failure or captured
        else:
            record = self._explained(record, run)
        if kind == "persistent" and micro and self.save_bundle and self.bundle_path is None:
            # the batch that failed, captured or not: it can be replayed later (``replay_bundle``)
            index = captured.micro if captured is not None else next((i for i, b in enumerate(bad_micro) if b), 0)
            self._write_bundle(record, micro[index], captured, replayer, history)
        if record.local_nonfinite and self.first_local is None:
            self.first_local = record.step
        return record

    def _explained(self, record: StepRecord, run: Run) -> StepRecord:
        """A bad step not captured itself: what the capture of its run found, and which step that was."""
        explained = next((c for c in reversed(self.captures) if c.step == run.capture_step), None)
        if explained is None:
            return record
        return dataclasses.replace(
            with_capture(record, explained.report, None), captured=False, explained_by=explained.step
        )

    def _write_bundle(
        self,
        record: StepRecord,
        m: MicroBatch,
        captured: Optional[Capture],
        replayer: StepReplayer,
        history: Sequence[StepRecord],
    ) -> None:
        failure = Failure(
            step=record.step, scale=record.scale, rank=self.rank, world_size=self.world_size, dtype=replayer.low,
            device_type=replayer.device_type, steps=(*history, record),
            capture=captured.report if captured is not None else None,
        )
        directory = self.bundle_dir if self.bundle_dir is not None else Path.cwd()
        try:
            scaler_state = self.scaler.state_dict() if self.scaler is not None else {}
            self.bundle_path = write_bundle(directory, failure, self.root, m, scaler_state)
        except Exception as exc:  # a full disk must not stop training: the report says so
            self.note(f"the failure bundle could not be written ({type(exc).__name__}: {exc})")

