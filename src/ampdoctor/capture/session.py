"""The passes of one diagnosis: each starts from the user's state as it was, is logged with its purpose, may be
skipped when it would not fit in memory, and is shown as progress. ``api.diagnose`` orchestrates them."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Mapping
from typing import Callable, Optional, TypeVar

import torch

from ..errors import OutOfMemory, raised_from
from ..records import PassRecord, PassTrace
from .dtypes import dtype_name
from .hidden import targets_of
from .memory import describe, is_out_of_memory, pass_estimate, trim_host_heap
from .options import PLAIN_PASS, PassOptions, ProgressFn, ProgressOption
from .passes import PassSpec, SharedForward, run_pass
from .progress import Progress, progress_on_stderr
from .state import StateGuard

T = TypeVar("T")
SURVEY = "survey"
_PROBING = (SURVEY, "scale probe", "underflow reference", "loss-scale window")


class PassSkipped(Exception):
    """A pass not run: its estimated peak does not fit the memory limit (logged as "skipped")."""


class Session:
    """The passes of one diagnosis: every pass starts from the same state and is logged with its purpose."""

    def __init__(
        self, spec: PassSpec, guard: StateGuard, memory_limit: Optional[int], progress: Optional[ProgressFn]
    ) -> None:
        self.spec = spec
        self.guard = guard
        self.log: list[PassRecord] = []
        self.loss_sources: list[str] = []
        self.purpose = SURVEY
        self.share = SharedForward()  # the graph of the last survey-level pass, for probes at other scales
        self.histograms: Mapping[str, list[int]] = {}  # binade histograms of the last pass that took them
        self.memory_limit = memory_limit
        self.progress = progress
        self.survey: Optional[PassTrace] = None  # the first pass, for memory estimates

    def run(
        self,
        at_scale: float,
        options: PassOptions = PLAIN_PASS,
        dtype: Optional[torch.dtype] = None,
        *,
        variant: Optional[PassSpec] = None,
    ) -> PassTrace:
        """One pass at ``at_scale`` measuring what ``options`` asks for, in ``dtype`` (default: the spec's);
        ``variant``: a variant of the session's spec to run instead (another autocast policy, no backward)."""
        spec = variant or self.spec
        spec = spec if dtype is None else dataclasses.replace(spec, dtype=dtype)
        record = PassRecord(self.purpose, at_scale, dtype_name(spec.dtype) if options.autocast else "float32")
        survey_level = dtype is None and variant is None and options.survey_level
        # The graph is kept for the probes at other scales only; a verification re-run drops it at once.
        keep = survey_level and self.purpose in _PROBING
        self._check_memory(record, options.detailed, options.autocast, survey_level)
        if self.progress is not None:
            self.progress(self.purpose, len(self.log), None)
        # What the last pass freed goes back to the system first: each pass starts where the first one did.
        trim_host_heap()
        start = time.perf_counter()
        options = self._with_targets(options, dtype)
        try:
            try:
                with self._forward_only(spec):
                    trace, source = run_pass(spec, at_scale, options, self.guard, share=self.share, keep=keep)
            except Exception as exc:
                if not raised_from(exc, NeededSaved):
                    raise
                trace, source = run_pass(spec, at_scale, options, self.guard, share=self.share, keep=keep)
        except Exception as exc:
            self.share.release()
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            self.log.append(dataclasses.replace(record, status="failed", reason=reason,
                                                seconds=time.perf_counter() - start))
            if self.survey is None and is_out_of_memory(exc):
                raise _out_of_memory(reason) from exc
            raise
        self.histograms = self.share.histograms if options.histograms else {}
        self.log.append(dataclasses.replace(record, seconds=time.perf_counter() - start))
        self.loss_sources.append(source)
        if self.survey is None:
            self.survey = trace
        return trace

    def _forward_only(self, spec: PassSpec) -> contextlib.AbstractContextManager[object]:
        """An optional pass without backward (the CUDA-policy check of a forward origin) keeps no tensor for a
        backward that never comes: its peak is the forward's live tensors, not the whole graph's. A forward that
        runs a backward of its own inside needs them: it raises :class:`NeededSaved`, and the pass runs again
        keeping them. The survey is left as it is."""
        allowed = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
        if spec.backward or self.survey is None or (allowed is not None and not allowed()):
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(_dropped, _never_unpacked)

    def _with_targets(self, options: PassOptions, dtype: Optional[torch.dtype]) -> PassOptions:
        """A detailed re-run counts, classifies and locates the ops the survey flagged (same forward, same ops
        in the same order): ``options`` with those ``hidden`` targets."""
        if not options.detailed or dtype is not None or self.survey is None or not self.survey.op_overflows:
            return options
        return dataclasses.replace(options, hidden=targets_of(self.survey.op_overflows))

    def _check_memory(self, record: PassRecord, detailed: bool, autocast: bool, survey_level: bool) -> None:
        """Skip a pass whose estimated peak (from the survey's records) exceeds the memory limit."""
        if self.survey is None or self.memory_limit is None:
            return
        shared = survey_level and self.share.step is not None and self.share.step.repeatable
        kind = "backward" if shared else ("detailed" if detailed else ("survey" if autocast else "float32"))
        needed = pass_estimate(self.survey, kind)
        if needed > self.memory_limit:
            reason = f"estimated peak +{describe(needed)} exceeds the memory limit {describe(self.memory_limit)}"
            self.log.append(dataclasses.replace(record, status="skipped", reason=reason))
            raise PassSkipped(reason)

    def close(self) -> None:
        self.share.release()

    @contextlib.contextmanager
    def stage(self, purpose: str) -> Iterator[None]:
        before, self.purpose = self.purpose, purpose
        try:
            yield
        finally:
            self.purpose = before

    def optional(self, purpose: str, step: Callable[[], T], fallback: T) -> T:
        """Run an optional stage; if any of its passes raises, the stage is dropped (its failure is in the log,
        its traceback and tensors released here) and ``fallback`` stands in."""
        logged_before = sum(r.status != "ran" for r in self.log)
        with self.stage(purpose):
            try:
                return step()
            except Exception as exc:  # a pass's failure is logged by run(); anything else is logged here
                if sum(r.status != "ran" for r in self.log) == logged_before:
                    reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
                    self.log.append(PassRecord(purpose, 0.0, "", "failed", reason))
        return fallback


def _dropped(tensor: torch.Tensor) -> None:
    return None


class NeededSaved(RuntimeError):
    """A pass that kept no tensors for a backward met one (the model's forward ran a backward of its own)."""


def _never_unpacked(packed: object) -> torch.Tensor:
    raise NeededSaved("the model's forward ran a backward of its own in a pass that kept no tensors for one")


def _out_of_memory(reason: str) -> OutOfMemory:
    return OutOfMemory(
        f"the first pass (one instrumented AMP step on this batch) ran out of memory ({reason}). Try a smaller "
        "batch (a slice of it usually shows the same origin), backward=False (the forward only), or fewer "
        "passes (scale_window=False, verify=False); on CUDA, free cached memory first (torch.cuda.empty_cache())"
    )


@contextlib.contextmanager
def progress_callback(progress: ProgressOption) -> Iterator[Optional[ProgressFn]]:
    """The progress callback for ``diagnose(progress=...)``: the caller's function, the caller's ``Progress``
    (the CLI's), or one line on stderr (when it is a terminal, or ``True``); none for ``False``."""
    if isinstance(progress, Progress):
        shown, own = progress, False
    elif callable(progress):
        yield progress
        return
    else:
        shown, own = progress_on_stderr(quiet=progress is False, force=progress is True), True
    if not shown.visible:
        yield None
        return
    shown.stage("diagnosing")

    def show(purpose: str, index: int, total: Optional[int]) -> None:
        shown.detail(f"pass {index + 1}{f' of {total}' if total else ''}: {purpose}")

    try:
        yield show
    finally:
        if own:
            shown.close()
