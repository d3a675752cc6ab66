"""Training-time watch: ``ampdoctor.watch(model, scaler)`` around an unchanged autocast + GradScaler loop.

>>> with ampdoctor.watch(model, scaler) as doctor:
...     for inputs, targets in loader:                  # your loop, unchanged: no extra line
...         with torch.autocast("cuda"):
...             loss = criterion(model(inputs), targets)
...         scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()
>>> report = doctor.report()        # same Report type as ampdoctor.diagnose, plus report.steps

This module is the runtime: the watch's lifecycle, the scaler's step boundaries and what happens at each
(ARCHITECTURE.md §1). Next to it: ``hooks`` (the hooks on the model), ``taps`` (the shared wrappers of the
scaler's methods), ``quiet`` (ampdoctor's own passes are never training), ``readback`` (what a step keeps, its one
read-back into a record), ``runs`` and ``divergence`` (harmless / persistent / diverged runs, pure),
``failures`` (captures, the bundle and the log line for each finished step), ``replay_step`` (a capture:
``diagnose`` of the failing forward), ``compiled`` (torch.compile), ``sharded`` (FSDP), ``bundle`` and ``replay``
(failure bundles), ``compose`` (per-rank payloads -> Report), ``lookout`` (after each step: the headroom forecast
of ``forecast``, dense sampling, the tracked modules, ``log_to`` through ``sinks``).

* **Step boundaries** come from ``scaler.update`` (a disabled scaler's ``step``, ``doctor.step()`` without one);
  ``scaler.scale`` shows the loss: shared taps, put back on exit in any order. Without an enabled scaler nothing
  skips a non-finite step: the watch checks the gradients itself (:mod:`~ampdoctor.capture.gradcheck`).
* **Every step** (cheap): the root module's inputs (by reference, for a replay), every RNG stream before each
  forward, the loss, the root outputs' min/max, the gradient the loss sent into the outputs (until the step
  ends, up to ``max_output_grad_bytes``), the scale before and after ``update`` and GradScaler's found-inf flags:
  on the device, read back once in ``update`` (which already synchronises through ``scaler.step``).
* **Sampled steps** (every ``stats_every``, and every step for a while after the loss left its range): per-module
  output and gradient statistics, and (every ``WEIGHT_NORMS_EVERY`` steps of those) each module's weight norm.
* **DDP**: names come from the wrapped ``.module``; each rank records on its own (no collective per step);
  ``report()`` gathers the ranks once (``all_gather_object``: every rank must call it). **FSDP2**: one small
  all-reduce per step decides whether the ranks gather the full model for a capture (:mod:`.sharded`).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from pathlib import Path
from types import TracebackType
from typing import Any, Optional, Union

import torch
from torch import nn

from ..capture import sharded
from ..capture.cleanup import protect_frames_of, uninterrupted, uninterrupted_enter
from ..capture.dtypes import LOW_DTYPES
from ..capture.gradcheck import GradCheck
from ..capture.model import unwrap_model
from ..capture.room import HeldWhileOn
from ..capture.stats import format_limits
from ..records import FrozenMap, ModuleInfo, StepRecord
from ..report import Report
from .bundle import PathLike
from .compiled import COMPILED_NOTE, NO_STATS_NOTE
from .compose import RankPayload, compose_report, trends
from .failures import FailureTracker, Plan
from .fastpath import Slabs
from .forecast import FORECAST_HORIZON, WARN_HEADROOM_BITS
from .hooks import MAX_MICRO_BATCHES, WatchHooks
from .lookout import Lookout
from .options import (
    DEFAULT_HISTORY,
    DEFAULT_MAX_CAPTURES,
    DEFAULT_STATS_EVERY,
    MAX_KEPT_OUTPUT_GRAD_BYTES,
    WatchOptions,
    check_scaler,
    parameters_of,
)
from .readback import StepState, WeightNorms, detach_tree, found_inf_flags, loss_value, scale_value
from .replay_step import LossFn, ScalerKind, StepReplayer
from .runs import is_bad
from .taps import Tap, join

# After a loss leaves its range, this many further steps are sampled (to see what grows during a divergence).
DENSE_STEPS_AFTER_JUMP = 10
# Weight norms (one read of every parameter) on sampled steps that are multiples of this, on the steps sampled
# after a loss jump, and at the start of every run of bad steps.
WEIGHT_NORMS_EVERY = 10
# Hook errors and notes kept for the report (a broken hook fires every step: its first errors say enough).
ERRORS_KEPT = 5
NOTES_KEPT = 20


class Watch:
    """Watches an unchanged AMP training loop; see :func:`watch` (``watch(...)`` is ``Watch(...).start()``, with
    the same parameters). Use as a context manager. The keywords become one :class:`WatchOptions`, checked
    before anything is installed."""

    def __init__(
        self,
        model: nn.Module,
        scaler: Any = None,
        *,
        loss_fn: Optional[LossFn] = None,
        dtype: Optional[torch.dtype] = None,
        stats_every: int = DEFAULT_STATS_EVERY,
        history: int = DEFAULT_HISTORY,
        max_captures: int = DEFAULT_MAX_CAPTURES,
        bundle_dir: Optional[PathLike] = None,
        save_bundle: bool = True,
        max_output_grad_bytes: Union[int, str] = MAX_KEPT_OUTPUT_GRAD_BYTES,
        log_to: Any = None,
        warn_headroom_bits: float = WARN_HEADROOM_BITS,
        forecast_horizon: int = FORECAST_HORIZON,
    ) -> None:
        options = WatchOptions(
            loss_fn=loss_fn, dtype=dtype, stats_every=stats_every, history=history, max_captures=max_captures,
            bundle_dir=bundle_dir, save_bundle=save_bundle, max_output_grad_bytes=max_output_grad_bytes,
            log_to=log_to, warn_headroom_bits=warn_headroom_bits, forecast_horizon=forecast_horizon,
        )
        check_scaler(scaler)
        self.options = options
        self.model = model
        self.root, wrappers = unwrap_model(model)
        self.scaler = scaler
        # an enabled scaler skips bad steps, update() closes them; a disabled one's step() closes them (before opt)
        on = scaler is not None and bool(getattr(scaler, "is_enabled", lambda: True)())
        self.scaler_kind: ScalerKind = "enabled" if on else "disabled" if scaler is not None else "none"
        self.scaler_on = on
        self._stepped = False  # a disabled scaler's step() (or doctor.step()) closed the step: update() does not
        self.loss_fn = options.loss_fn
        self.stats_every = options.stats_every
        self.max_captures = options.max_captures
        self.max_output_grad_bytes = options.output_grad_bytes
        self.sharding = sharded.describe(self.root)
        self.low: Optional[torch.dtype] = options.dtype
        notes = [
            f"{type(model).__name__} wrapper peeled: module names are those of the wrapped model; a capture re-runs "
            "it on its own rank, outside the wrapper"
        ] if wrappers else []
        if dtype is None and self.sharding.param_dtype in LOW_DTYPES:
            self.low = self.sharding.param_dtype  # FSDP2's MixedPrecisionPolicy: low precision without autocast
            notes.append(f"the model runs in {self.low} through FSDP's MixedPrecisionPolicy(param_dtype=...)")
        if self.sharding.kind == "fsdp1":
            notes.append(sharded.FSDP1_NOTE)
        param = next(self.root.parameters(), None)
        self.device_type = param.device.type if param is not None else "cpu"
        if self.low is None and param is not None and param.dtype in LOW_DTYPES:
            self.low = param.dtype  # a model cast to float16/bfloat16 runs low precision without autocast
        self.rank, self.world_size = sharded.rank_and_world()
        self.names = {id(m): name for name, m in self.root.named_modules()}
        self._steps: deque[StepRecord] = deque(maxlen=options.history)
        self._step = 0
        self._dense_until = -1
        self._errors: list[str] = []
        self._notes: list[str] = notes
        self.active = False
        self.targets: Any = None
        self._slabs = Slabs()  # every step's (lo, hi) pairs, in buffers reused step after step
        self.cur = StepState.on(self._slabs)
        self.hooks = WatchHooks(self)
        self._lookout = Lookout(options.warn_headroom_bits, options.forecast_horizon, log_to, self.rank,
                                self.world_size)
        self.hooks.count_underflow = self._lookout.sink is not None
        self._taps: list[Tap] = []
        self._norms = WeightNorms(self.root)  # each module's own parameters' L2 norm, as one block
        self._grads = GradCheck(self.root)
        self._failures = FailureTracker(
            self.root, max_captures=self.max_captures, save_bundle=options.save_bundle, bundle_dir=options.bundle_dir,
            rank=self.rank, world_size=self.world_size, scaler=scaler, note=self._note,
        )

    @property
    def bundle_path(self) -> Optional[Path]:
        """The failure bundle written on the first persistent failure, if any."""
        return self._failures.bundle_path

    # -- lifecycle ------------------------------------------------------------------------------------------
    @uninterrupted_enter
    def __enter__(self) -> Watch:
        return self.start()

    @uninterrupted
    def __exit__(
        self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.close()

    @uninterrupted_enter
    def start(self) -> Watch:
        """Install the root hooks and tap the scaler (``__enter__`` does this)."""
        if self.active:
            return self
        self.active = True
        self._held: Optional[HeldWhileOn] = HeldWhileOn(self.root)  # Ctrl-C waits for installs; stack room
        try:
            self.hooks.install()
            if self.scaler is not None:
                self._taps = [join(self.scaler, "scale", self), join(self.scaler, "update", self)]
                if not self.scaler_on and callable(getattr(self.scaler, "step", None)):
                    self._taps.append(join(self.scaler, "step", self))
            self.hooks.sample(self._sampled(self._step), self._step <= self._lookout.dense_until)
        except BaseException:
            self.close()
            raise
        return self

    @uninterrupted
    def close(self) -> None:
        """Remove every hook and leave the scaler's taps; the records stay (``__exit__`` does this)."""
        self.cur.remove_hooks()
        self.hooks.remove()
        for tap in self._taps:
            tap.leave(self)
        self._taps.clear()
        try:
            self._lookout.close()  # the sink's buffered scalars out
        except Exception as exc:
            self.fail(exc)
        self.cur = StepState.on(self._slabs)  # no reference to the user's inputs (or targets) after the block
        self.targets = None
        self.active = False
        held, self._held = getattr(self, "_held", None), None
        if held is not None:
            held.release()  # last: a Ctrl-C held meanwhile is raised here

    # -- public verbs ----------------------------------------------------------------------------------------
    def set_targets(self, targets: Any) -> None:
        """Optional: targets of the current batch (call it before ``scaler.scale(loss)``), for a ``loss_fn`` given
        to the watch: a capture then calls ``loss_fn(output, targets)`` (without them, ``loss_fn(output, batch)``,
        checked against the step's recorded loss)."""
        self.targets = detach_tree(targets)
        micro = self.cur.micro
        if micro and not micro[-1].scaled:  # between its forward and scaler.scale(loss)
            micro[-1].targets = self.targets

    def see_loss(self, loss: Any) -> None:
        """Optional, for loops without a GradScaler: the step's loss (before its backward), so that the report has
        the losses (and can tell a divergence). ``scaler.scale(loss)`` does this itself, and so does a model whose
        output carries its loss (``output.loss``)."""
        self.scaled(loss)

    def step(self) -> None:
        """Close a step by hand, for loops without a GradScaler (bfloat16): after the backward, before
        ``optimizer.step()``, so a capture replays the weights of the failing forward. With a scaler, ``update``
        does it (a disabled scaler's ``step``)."""
        if self._stepped and not self.cur.seen:
            return  # a disabled scaler's step() closed it already
        self._end_step(None, None, [])
        self._stepped = self.scaler is not None and not self.scaler_on  # its update() closes nothing more

    @property
    def steps(self) -> list[StepRecord]:
        """The recorded steps still in the ring buffer, oldest first (without the ``run`` verdicts)."""
        return list(self._steps)

    def headroom_trends(self) -> dict[str, list[tuple[int, float]]]:
        """Per module, ``(step, headroom bits)`` of its low-precision outputs on each sampled step kept."""
        return trends(list(self._steps), format_limits(self.low or torch.float16).max)

    def report(self, merge: Optional[bool] = None) -> Report:
        """The Report of the run so far (same type as ``diagnose``), with ``.steps``.

        ``verdict``/``forward_origin``/``backward_origin`` describe the first persistent failure;
        ``"scale_overflow"`` when only harmless (or still open) runs of skipped steps happened;
        ``findings.divergence`` when a divergence led into a run of skipped steps. In a distributed run
        (``merge=None`` and a process group of more than one rank) this gathers every rank's records once: every
        rank must call it.
        """
        payload = self._payload()
        rank, world = sharded.rank_and_world()
        payloads = [payload]
        if (world > 1 if merge is None else merge) and world > 1:
            import torch.distributed as dist

            gathered: list[Optional[RankPayload]] = [None] * world
            dist.all_gather_object(gathered, payload)
            payloads = [p for p in gathered if p is not None]
        return compose_report(payloads, rank)

    # -- the scaler's taps (taps.ScaleListener, taps.UpdateListener) ---------------------------------------
    def scaled(self, outputs: Any) -> None:
        if not self.active:
            return
        try:
            value = loss_value(outputs)
            if value is None:
                return
            cur = self.cur
            slot = cur.collector.add(value)
            if cur.micro:
                micro = cur.micro[-1]
                micro.loss_slot, micro.scaled = slot, True
                if self.targets is not None:
                    micro.targets = self.targets
            else:
                cur.orphan_losses.append(slot)
            self.targets = None  # targets belong to one micro-batch
        except Exception as exc:
            self.fail(exc)

    def before_step(self) -> None:
        """A disabled scaler's ``step(optimizer)`` is about to apply the gradients: the step closes here, so that a
        capture replays the weights of its forward (the first ``step`` of several optimizers closes it)."""
        if not self.active or self.scaler_on or not self.cur.seen:
            return  # closed already (doctor.step(), an earlier optimizer), or the forwards run inside (a closure)
        try:
            self._end_step(None, None, [])
        except Exception as exc:  # never in the way of the optimizer
            self.fail(exc)
        self._stepped = True

    def before_update(self) -> tuple[Any, list[torch.Tensor]]:
        if not self.active:
            return None, []
        try:
            return scale_value(self.scaler), found_inf_flags(self.scaler)
        except Exception as exc:
            self.fail(exc)
            return None, []

    def after_update(self, before: tuple[Any, list[torch.Tensor]]) -> None:
        if not self.active:
            return
        if self._stepped:  # a disabled scaler: its step() closed the step already
            self._stepped = False
            return
        try:
            after = scale_value(self.scaler)
        except Exception as exc:
            self.fail(exc)
            after = None
        self._end_step(before[0], after, before[1])

    def update_failed(self) -> None:
        self._stepped = False
        self._drop_step()

    # -- the step boundary ----------------------------------------------------------------------------------
    def _sampled(self, step: int) -> bool:
        return self.stats_every > 0 and (step % self.stats_every == 0 or step <= self._dense_until)

    @uninterrupted
    def _drop_step(self) -> None:
        """Forget the current step (its ``update`` raised, or it was read): its hooks go, a new step starts."""
        self.cur.remove_hooks()
        self.cur = StepState.on(self._slabs)
        self.hooks.open = False
        self.hooks.ops.end_survey()

    def _end_step(self, before: Any, after: Any, found: list[torch.Tensor]) -> None:
        """One read-back, then the step's record, run bookkeeping, captures and the bundle. Never raises."""
        step, cur = self._step, self.cur
        sampled = self.hooks.all_modules  # with gradients, or only outputs (the forecast's dense window)
        if cur.dropped_micro:
            self._note(f"step {step}: {cur.dropped_micro} early forward(s) of {cur.forwards} not kept for a replay "
                       f"(at most {MAX_MICRO_BATCHES} per step)")
        self._drop_step()  # the step's hooks go before a capture runs its own passes
        plan: Optional[Plan] = None
        bad_micro: list[bool] = []
        try:
            record, bad_micro = self._read(cur, step, sampled, before, after, found)
            plan = self._failures.plan(record, list(cur.micro))
            if self._failures.runs.last_jump == step:
                self._dense_until = step + DENSE_STEPS_AFTER_JUMP
            self._look(cur, record, sampled)
        except Exception as exc:
            self.fail(exc)
        try:
            micro, history = list(cur.micro), tuple(self._steps)
            done = self._failures.act(plan, micro, bad_micro, self.sharding.kind, self._replayer, history)
            if done is not None:
                self._steps.append(done)
        except Exception as exc:
            self.fail(exc)
        finally:
            self._step += 1
            try:
                dense = self.stats_every > 0 and self._step <= self._lookout.dense_until  # outputs only
                self.hooks.sample(self.active and self._sampled(self._step), self.active and dense)
            except Exception as exc:
                self.fail(exc)

    def _look(self, cur: StepState, record: StepRecord, sampled: bool) -> None:
        """The forecast, dense sampling, the tracked modules and ``log_to`` (:mod:`.lookout`)."""
        underflow = cur.collector.underflow_share(cur.numbers) if sampled else None
        tracked = self._lookout.after_step(
            record.step, sampled, cur.pairs, self.low, record.new_scale, record.skipped, underflow,
            cur.out_max if record.sampled else None, track=self.stats_every != 1, unguarded=record.unguarded,
        )
        self.hooks.looked(tracked, self._lookout.seen, self._failures.captures)

    def _read(
        self, cur: StepState, step: int, sampled: bool, before: Any, after: Any, found: list[torch.Tensor]
    ) -> tuple[StepRecord, list[bool]]:
        norms_due = sampled and (step % WEIGHT_NORMS_EVERY == 0 or step <= self._dense_until)
        extras = [self._norms.block()] if norms_due else []
        compiled = self.hooks.compiled
        if sampled and compiled is not None:
            extras.append(compiled.extra())
        # no enabled scaler (none, a disabled one): nothing skips a step whose gradients are non-finite
        checks = self._grads.values() if not self.scaler_on else []
        record, bad_micro = cur.read(step, self.rank, sampled, before, after, found, extras, checks)
        if not record.grads_finite:
            names, count, nan = self._grads.nonfinite()
            record = dataclasses.replace(record, grads_finite=not count, grads_nan=nan, nonfinite_params=names)
        self._grads.clear()
        if sampled and compiled is not None and not compiled.seen and cur.forwards:
            self._note(NO_STATS_NOTE)
        if is_bad(record) and self._failures.runs.open_run is None and not record.weight_norm:
            weights = self._norms.block()  # a run starts: the weights it started from (one more read-back)
            record = dataclasses.replace(
                record, weight_norm=FrozenMap(weights.decode(weights.tensor.tolist()).weight_norm)
            )
        return record, bad_micro

    def _replayer(self) -> StepReplayer:
        notes = [COMPILED_NOTE] if self.hooks.compiled is not None else []
        if self.sharding.kind == "fsdp2":
            notes.append(sharded.FSDP2_NOTE)
        return StepReplayer(
            self.root, self.low or torch.float16, self.device_type, self.loss_fn, tuple(notes), self.scaler_kind
        )

    # -- reporting ------------------------------------------------------------------------------------------
    def _payload(self) -> RankPayload:
        """Everything ``report`` needs from this rank (what ranks exchange)."""
        return RankPayload(
            rank=self.rank,
            world_size=self.world_size,
            steps=tuple(self._steps),
            runs=self._failures.runs.runs,
            failure=self._failures.failure,
            first_capture=self._failures.captures[0] if self._failures.captures else None,
            first_local=self._failures.first_local,
            bundle=str(self.bundle_path) if self.bundle_path else None,
            notes=(*self._notes, *[f"watch hook error: {e}" for e in self._errors]),
            modules=tuple(ModuleInfo(name, type(m).__name__) for name, m in self.root.named_modules()),
            model_class=type(self.root).__name__,
            device_type=self.device_type,
            dtype=self.low or (torch.float16 if self.scaler_on else torch.bfloat16),
            stats_every=self.stats_every,
            scale=self._steps[-1].new_scale if self._steps else None,
            total_steps=self._step,
            forecasts=tuple(self._lookout.texts),
            scaler=self.scaler_kind,
        )

    def _note(self, text: str) -> None:
        if len(self._notes) < NOTES_KEPT and text not in self._notes:
            self._notes.append(text)

    def fail(self, exc: BaseException) -> None:
        """A hook or a step boundary failed: a note in the report, never an exception in the training loop."""
        if len(self._errors) < ERRORS_KEPT:
            self._errors.append(f"{type(exc).__name__}: {exc}")


@parameters_of(Watch)
def watch(*args: Any, **kwargs: Any) -> Watch:
    """Watch an unchanged autocast + GradScaler training loop; returns a started :class:`Watch`.

    >>> with ampdoctor.watch(model, scaler) as doctor:
    ...     train()                      # your loop: scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
    >>> print(doctor.report())

    Args:
        model: the model as trained (a DDP or ``torch.compile`` wrapper is peeled for the names; ``fully_shard``
            and ``model.compile()`` work as they are).
        scaler: the loop's ``GradScaler`` (or FSDP's ``ShardedGradScaler``): each ``scaler.update()`` closes a step.
            Without one (bfloat16), call ``doctor.step()`` after the backward and before ``optimizer.step()`` (a
            capture after the optimizer applied non-finite gradients would replay the updated weights; the report
            says so when it happens).
        loss_fn: optional. A capture replays the failing step's backward from the gradient the step's loss sent
            into the model's outputs; with ``loss_fn(output, batch)`` (or ``(output, targets)`` after
            ``doctor.set_targets``) it re-runs the loss too, and falls back to the recorded gradient when the
            loss raises on the replayed batch or gives another value than the step's.
        dtype: the autocast dtype; default: what autocast uses at the first forward (or FSDP2's ``param_dtype``).
        stats_every: per-module statistics every this many steps (and every step for a while after the loss
            left its range); 0 for never. Skipped steps are captured whatever this is.
        history: steps kept in the ring buffer.
        max_captures: full captures (a ``diagnose`` of the failing inputs) for runs of skipped steps, and as
            many again for persistent failures.
        bundle_dir: where the failure bundle goes (default: ``ampdoctor-bundles/`` in the current directory), named
            ``ampdoctor-bundle-step<N>.pt`` (``-rank<R>`` added in a distributed run; ``-1``, ``-2`` ... rather
            than write over a file).
        save_bundle: write a failure bundle on the first persistent failure.
        max_output_grad_bytes: the output gradients kept per step for a capture (default 256 MiB), in bytes or
            as text with a unit (``"64MiB"``, ``"1GB"``, as ``diagnose``'s ``memory_limit``); a larger one is not
            kept, and a capture says so.
        log_to: scalars (loss scale, skips, headroom, underflow share) and forecasts, every step, to a
            SummaryWriter, a W&B run, an Accelerator, a Lightning logger or a callable ``(tag, value, step)``.
        warn_headroom_bits, forecast_horizon: the overflow forecast warns about an output under this headroom
            (bits) forecast to overflow within this many steps (:mod:`.forecast`).

    Each step reads its statistics back from the device once, in ``scaler.update``. A persistent failure, a
    divergence, a written bundle and an overflow forecast each log one WARNING line on the ``ampdoctor`` logger.
    Use it as a context manager (or call ``close()``): the hooks and the scaler's taps go away on exit, also after
    an exception. ``report()`` works inside and after the block. A keyword of the wrong type or range
    (``stats_every=-1``, ``history=0``, ``dtype=torch.float32``) raises :class:`ampdoctor.InvalidInput` naming it,
    before anything is installed.
    """
    return Watch(*args, **kwargs).start()


# A Ctrl-C between start() and the with statement's __enter__ waits for __enter__, which leaves again before raising
# it (the with block would never reach its __exit__).
protect_frames_of(watch)
