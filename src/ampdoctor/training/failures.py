"""What the watch does with each finished step: run bookkeeping, captures of failing steps, the failure bundle,
and one log line when something happens.

:class:`FailureTracker` feeds every step record to the pure :class:`~.runs.RunTracker` and says what the step
calls for (:meth:`FailureTracker.plan`: a capture where a run starts or turns persistent, within a budget per kind;
the bundle once); :meth:`FailureTracker.execute` runs it (``diagnose`` of the failing forward, :mod:`.replay_step`),
points later skips of a run at its capture, and writes the bundle. Between the two, the watch may agree with the
other ranks and gather a sharded model (:mod:`.sharded`).

**Logging.** A persistent failure, a divergence and a written bundle each log one line on the ``ampdoctor`` logger
at WARNING, so Python's default handling prints it to stderr while training runs (ampdoctor adds no handler of
its own); in a distributed run each rank logs its own failures, prefixed with ``[rank R]``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from torch import nn

from ..capture import sharded
from ..capture.model import eager_calls
from ..records import StepRecord
from .bundle import Failure, PathLike, write_bundle
from .bundle_format import DEFAULT_BUNDLE_DIR
from .quiet import own_capture
from .readback import MicroBatch
from .replay_step import Capture, StepReplayer, capture, with_capture
from .runs import PERSISTENT, CaptureKind, Run, RunTracker

log = logging.getLogger("ampdoctor")


@dataclass(frozen=True)
class Plan:
    """What one finished step calls for."""

    record: StepRecord
    run: Optional[Run]  # the run a bad step belongs to; None for a good step
    kind: Optional[CaptureKind]  # why this step deserves a capture
    capture: bool  # a capture is due and within its budget
    bundle: bool  # the failure bundle is due

    @property
    def work(self) -> bool:
        return self.capture or self.bundle


@dataclass(eq=False)
class FailureTracker:
    """Runs of bad steps, the captures that explain them and the failure bundle, for one rank's watch."""

    root: nn.Module
    max_captures: int  # per kind of capture
    save_bundle: bool
    bundle_dir: Optional[PathLike]  # None: DEFAULT_BUNDLE_DIR in the current directory
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
    spent: set[CaptureKind] = field(default_factory=set)  # kinds whose captures ran out (noted once)

    def plan(self, record: StepRecord, micro: list[MicroBatch]) -> Plan:
        """Fold the step into the runs; what it calls for (nothing runs yet)."""
        observed = self.runs.observe(record)
        run = observed.run
        ended = observed.ended
        if ended is not None and ended.divergence is not None and ended.persistent_step == record.step:
            self._say(f"step {record.step}: {ended.reason} (see doctor.report())")  # found as the run ended
        if run is None:
            return Plan(record, None, None, False, False)
        kind = observed.capture
        due = kind is not None and bool(micro) and self.used[kind] < self.max_captures
        if kind is not None and micro and not due and kind not in self.spent:
            self.spent.add(kind)  # said once per kind: the report must not read as if every failure was captured
            what = "persistent failures" if kind == "persistent" else "runs of skipped steps"
            self.note(
                f"step {record.step} was not captured (max_captures=0): {what} are counted, not captured"
                if not self.max_captures else
                f"step {record.step} was not captured: the {self.max_captures} captures of {what} (max_captures) "
                "were spent; later ones are counted, not captured (watch(..., max_captures=N) keeps more)"
            )
        bundle = kind == "persistent" and bool(micro) and self.save_bundle and self.bundle_path is None
        return Plan(record, run, kind, due, bundle)

    def act(
        self,
        plan: Optional[Plan],
        micro: list[MicroBatch],
        bad_micro: list[bool],
        sharding: Optional[str],
        replayer: Callable[[], StepReplayer],
        history: Sequence[StepRecord],
    ) -> Optional[StepRecord]:
        """Run what the step's plan calls for (captures, the bundle), quietly: every watch ignores those passes;
        ``sharding`` is the model's (:func:`~ampdoctor.capture.sharded.describe`).

        Under FSDP2 the ranks first agree, every step, whether any of them wants a capture; if one does, all
        gather the full model together."""
        wants = plan is not None and plan.work
        if sharding == "fsdp2":
            agreed = sharded.agree(wants, sharded.agreement_device(self.root)) if self.world_size > 1 else wants
            if agreed is None:
                self.note("the ranks did not agree on a capture in time: no capture on this rank from now on")
                self.max_captures = 0
            if plan is None:
                return None
            if not agreed:
                return self.execute(plan, micro, bad_micro, None, history)
            with own_capture(), sharded.full_model(self.root):
                return self.execute(plan, micro, bad_micro, replayer(), history)
        if plan is None:
            return None
        if not plan.work or sharding == "fsdp1":
            return self.execute(plan, micro, bad_micro, None, history)
        with own_capture(), eager_calls(self.root):
            return self.execute(plan, micro, bad_micro, replayer(), history)

    def execute(
        self,
        plan: Plan,
        micro: list[MicroBatch],
        bad_micro: list[bool],
        replayer: Optional[StepReplayer],
        history: Sequence[StepRecord],
    ) -> StepRecord:
        """The step's record with what its capture (or its run's) found; the capture and the bundle on the way.

        ``replayer`` None: the plan's work cannot run here (say why beforehand). ``history`` is the steps recorded
        before this one (for the bundle's records). Never raises from a capture or a bundle: what fails becomes
        a note.
        """
        record, run, kind = plan.record, plan.run, plan.kind
        if run is None:
            return record
        captured: Optional[Capture] = None
        if plan.capture and kind is not None and replayer is not None:
            self.used[kind] += 1
            why = "the first skip of a run" if kind == "run_start" else "a persistent failure"
            log.info("%sampdoctor: step %d: diagnosing %s (a capture: a few seconds)", self._prefix(), record.step, why)
            captured = capture(replayer, micro, bad_micro, record.step, record.scale, self.note)
            if captured is not None:
                self.captures.append(captured)
                self.runs.explained_by(record.step)
                record = with_capture(record, captured.report, captured.local_nonfinite)
                if kind == "persistent":
                    self.failure = self.failure or captured
        else:
            record = self._explained(record, run)
        if kind == "persistent":
            self._say_persistent(record, run, captured)
        if plan.bundle and replayer is not None:
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
        found = with_capture(record, explained.report, None)
        return dataclasses.replace(  # a step's own gradient check names its own parameters best
            found, captured=False, explained_by=explained.step,
            nonfinite_params=record.checked_params or found.nonfinite_params,
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
        directory = self.bundle_dir if self.bundle_dir is not None else Path.cwd() / DEFAULT_BUNDLE_DIR
        try:
            scaler_state = self.scaler.state_dict() if self.scaler is not None else {}
            self.bundle_path = write_bundle(directory, failure, self.root, m, scaler_state)
        except Exception as exc:  # a full disk must not stop training: the report says so
            self.note(f"the failure bundle could not be written ({type(exc).__name__}: {exc})")
            return
        self._say(
            f"step {record.step}: failure bundle written to {self.bundle_path} (replay it: ampdoctor diagnose "
            f"{self.bundle_path} --model pkg.module:factory)"
        )

    def _say_persistent(self, record: StepRecord, run: Run, captured: Optional[Capture]) -> None:
        if run.status != PERSISTENT or run.persistent_step != record.step:
            return
        text = run.reason if run.reason.startswith("divergence") else f"persistent failure, {run.reason}"
        if run.divergence is not None and not run.reason.startswith("divergence"):
            text += f" (after a divergence from step {run.divergence.began})"
        if captured is not None:
            origin = captured.report.forward_origin or captured.report.backward_origin
            where = f", {origin.direction} origin: {origin.label}" if origin is not None else ""
            text += f"; captured: {captured.report.verdict.upper()}{where}"
        self._say(f"step {record.step}: {text} (see doctor.report())")

    def _prefix(self) -> str:
        return f"[rank {self.rank}] " if self.world_size > 1 else ""

    def _say(self, text: str) -> None:
        log.warning("%sampdoctor: %s", self._prefix(), text)
