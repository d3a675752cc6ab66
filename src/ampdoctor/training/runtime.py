"""Training-time watch: ``ampdoctor.watch(model, scaler)`` around an unchanged autocast + GradScaler loop.

>>> with ampdoctor.watch(model, scaler, loss_fn=lambda out, targets: criterion(out, targets)) as doctor:
...     for inputs, targets in loader:
...         doctor.set_targets(targets)                 # optional: what loss_fn gets in a replay
...         with torch.autocast("cuda"):
...             loss = criterion(model(inputs), targets)
...         scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()
>>> report = doctor.report()        # same Report type as ampdoctor.diagnose, plus report.steps

This module is the runtime: hooks, the wrapped scaler methods, step boundaries (ARCHITECTURE.md §1). Next to
it: ``readback`` (what a step keeps, its one read-back into a record), ``runs`` (harmless / persistent runs of
skipped steps, pure), ``failures`` (captures and the bundle for each finished step), ``replay_step`` (a capture:
``diagnose`` of the failing forward), ``bundle`` and ``replay`` (failure bundles), ``compose`` (per-rank
payloads -> Report).

* **Step boundaries** come from ``scaler.update``, which the watch wraps (an instance attribute; put back on
  exit, also after an exception); ``scaler.scale`` is wrapped too, to see the loss. Nothing of the scaler's
  behaviour changes.
* **Every step** (cheap): the root module's inputs (by reference, for a replay), every RNG stream before each
  forward (:class:`RngState`: torch CPU and CUDA, Python, numpy), the loss, the root outputs' min/max, the scale
  before and after ``update`` and GradScaler's found-inf flags: on the device, read back once in ``update``
  (which already synchronises through ``scaler.step``).
* **Sampled steps** (every ``stats_every``): forward hooks on every module and gradient hooks on what they return
  (on a view's base, never a module-level backward hook), installed only for those steps.
* **DDP**: names come from the wrapped ``.module``; each rank records on its own (no collective per step);
  ``report()`` gathers the ranks once (``all_gather_object``: every rank must call it).
"""

from __future__ import annotations

import itertools
from collections import deque
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..capture.dtypes import autocast_dtype
from ..capture.hooks import register_grad_hook
from ..capture.model import unwrap_model
from ..capture.stats import format_limits
from ..capture.walk import iter_tensors
from ..errors import AmpDoctorError
from ..records import ModuleInfo, StepRecord
from ..report import Report
from .bundle import PathLike
from .compose import RankPayload, compose_report, trends
from .failures import FailureTracker
from .readback import MicroBatch, StepState, detach_tree, found_inf_flags, loss_value, scale_value
from .replay_step import LossFn, StepReplayer, has_own_loss

# Per-module statistics every this many steps by default (every skipped step is captured regardless).
DEFAULT_STATS_EVERY = 50
# Steps kept in the ring buffer.
DEFAULT_HISTORY = 2048
# Full captures (a diagnose on the failing inputs) per kind: runs of skipped steps, and persistent failures.
DEFAULT_MAX_CAPTURES = 8
# Root forwards kept per step for a replay (gradient accumulation); beyond this the oldest are dropped.
MAX_MICRO_BATCHES = 64
# Without loss_fn, the gradient of the loss w.r.t. the root outputs is kept per step (to replay the real backward
# in a capture) while it takes at most this many bytes; beyond, a capture falls back to a surrogate loss.
MAX_KEPT_OUTPUT_GRAD_BYTES = 256 * 2**20
# Hook errors and notes kept for the report (a broken hook fires every step: its first errors say enough).
ERRORS_KEPT = 5
NOTES_KEPT = 20


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Watch:
    """Watches an unchanged AMP training loop; see :func:`watch`. Use as a context manager."""

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
    ) -> None:
        if dtype not in (None, torch.float16, torch.bfloat16):
            raise AmpDoctorError(f"dtype must be torch.float16, torch.bfloat16 or None, got {dtype}")
        if scaler is not None and not all(callable(getattr(scaler, m, None)) for m in ("scale", "update")):
            raise AmpDoctorError(
                f"scaler must be a GradScaler (with scale() and update()), got {type(scaler).__name__}"
            )
        if history < 1:
            raise AmpDoctorError(f"history must be at least 1, got {history}")
        self.model = model
        self.root, wrappers = unwrap_model(model)
        self.scaler = scaler
        self.loss_fn = loss_fn
        self.stats_every = max(0, int(stats_every))
        self.max_captures = max(0, int(max_captures))
        self._low: Optional[torch.dtype] = dtype
        param = next(self.root.parameters(), None)
        self.device_type = param.device.type if param is not None else "cpu"
        self.rank, self.world_size = _rank_and_world()
        self._names = {id(m): name for name, m in self.root.named_modules()}
        self._steps: deque[StepRecord] = deque(maxlen=history)
        self._step = 0
        self._errors: list[str] = []
        self._notes: list[str] = [
            f"{type(model).__name__} wrapper peeled: module names are those of the wrapped model; a capture re-runs "
            "it on its own rank, outside the wrapper"
        ] if wrappers else []
        self._busy = False  # a capture is replaying: the watch's own hooks stay quiet
        self._active = False
        self._root_handles: list[Any] = []
        self._module_handles: list[Any] = []
        self._patched: list[tuple[str, bool, Any]] = []
        self._targets: Any = None
        self._grads_on = False
        self._cur = StepState()
        self._failures = FailureTracker(
            self.root, max_captures=self.max_captures, save_bundle=save_bundle, bundle_dir=bundle_dir,
            rank=self.rank, world_size=self.world_size, scaler=scaler, note=self._note,
        )

    @property
    def bundle_path(self) -> Optional[Path]:
        """The failure bundle written on the first persistent failure, if any."""
        return self._failures.bundle_path

    # -- lifecycle ------------------------------------------------------------------------------------------
    def __enter__(self) -> Watch:
        return self.start()

    def __exit__(
        self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.close()

    def start(self) -> Watch:
        """Install the root hooks and wrap the scaler (``__enter__`` does this)."""
        if self._active:
            return self
        self._active = True
        try:
            self._root_handles.append(self.root.register_forward_pre_hook(self._root_pre, with_kwargs=True))
            self._root_handles.append(self.root.register_forward_hook(self._root_post, with_kwargs=True))
            if self.scaler is not None:
                self._patch("scale", self._wrap_scale(self.scaler.scale))
                self._patch("update", self._wrap_update(self.scaler.update))
            self._sample_hooks(self._sampled(self._step))
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Remove every hook and put the scaler's methods back; the records stay (``__exit__`` does this)."""
        self._cur.remove_hooks()
        for handle in itertools.chain(self._module_handles, self._root_handles):
            handle.remove()
        self._module_handles.clear()
        self._root_handles.clear()
        for name, had_own, original in reversed(self._patched):
            if had_own:
                setattr(self.scaler, name, original)
            else:
                self.scaler.__dict__.pop(name, None)
        self._patched.clear()
        self._cur = StepState()  # no reference to the user's inputs (or targets) after the block
        self._targets = None
        self._grads_on = False
        self._active = False

    def _patch(self, name: str, wrapper: Callable[..., Any]) -> None:
        had_own = name in self.scaler.__dict__
        self._patched.append((name, had_own, self.scaler.__dict__.get(name)))
        setattr(self.scaler, name, wrapper)

    # -- public verbs ----------------------------------------------------------------------------------------
    def set_targets(self, targets: Any) -> None:
        """Targets of the current batch (call it before ``scaler.scale(loss)``): a capture and a replay call
        ``loss_fn(output, targets)`` with them (without targets, ``loss_fn(output, batch)``)."""
        self._targets = detach_tree(targets)
        micro = self._cur.micro
        if micro and micro[-1].loss_slot is None:  # between its forward and scaler.scale(loss)
            micro[-1].targets = self._targets

    def step(self) -> None:
        """Close a step by hand, for loops without a GradScaler (bfloat16): after the backward, before
        ``optimizer.step()``, so a capture replays the weights of the failing forward. With a scaler, ``update``
        does it."""
        self._end_step(None, None, [])

    @property
    def steps(self) -> list[StepRecord]:
        """The recorded steps still in the ring buffer, oldest first (without the ``run`` verdicts)."""
        return list(self._steps)

    def headroom_trends(self) -> dict[str, list[tuple[int, float]]]:
        """Per module, ``(step, headroom bits)`` of its low-precision outputs on each sampled step kept."""
        return trends(list(self._steps), format_limits(self._low or torch.float16).max)

    def report(self, merge: Optional[bool] = None) -> Report:
        """The Report of the run so far (same type as ``diagnose``), with ``.steps``.

        ``verdict``/``forward_origin``/``backward_origin`` describe the first persistent failure;
        ``"scale_overflow"`` when only harmless (or still open) runs of skipped steps happened. In a distributed
        run (``merge=None`` and a process group of more than one rank) this gathers every rank's records once:
        every rank must call it.
        """
        payload = self._payload()
        rank, world = _rank_and_world()
        payloads = [payload]
        if (world > 1 if merge is None else merge) and world > 1:
            import torch.distributed as dist

            gathered: list[Optional[RankPayload]] = [None] * world
            dist.all_gather_object(gathered, payload)
            payloads = [p for p in gathered if p is not None]
        return compose_report(payloads, rank)

    # -- hooks: root ----------------------------------------------------------------------------------------
    def _root_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self._busy or not torch.is_grad_enabled():  # an evaluation forward is no training step
            return
        try:
            if self._low is None:
                self._low = autocast_dtype(self.device_type)
            micro = MicroBatch.keep(module, args, kwargs, self._targets)
            cur = self._cur
            if len(cur.micro) >= MAX_MICRO_BATCHES:
                cur.micro.popleft()
                cur.dropped_micro += 1
            cur.micro.append(micro)
            cur.forwards += 1
        except Exception as exc:  # never raise inside the user's forward
            self._fail(exc)

    def _root_post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self._busy or not torch.is_grad_enabled() or not self._cur.micro:
            return
        try:
            micro = self._cur.micro[-1]
            micro.own_loss = has_own_loss(output)
            keep = self.loss_fn is None and not micro.own_loss
            for path, t in iter_tensors(output, "out"):
                if not t.is_floating_point() or t.numel() == 0:
                    continue
                micro.root_slots.append(self._cur.collector.pair("root", "", t.detach(), t.dtype == self._low))
                if t.requires_grad:
                    if self._grads_on:
                        self._grad_hook(t, "")
                    if keep:
                        self._keep_grad(micro, path, t)
        except Exception as exc:
            self._fail(exc)

    def _keep_grad(self, micro: MicroBatch, path: str, t: torch.Tensor) -> None:
        """Keep the gradient reaching this output (the real loss's, scaled) until the step ends."""
        micro.expected_grads.add(path)
        nbytes = t.numel() * t.element_size()
        if self._cur.kept_bytes + nbytes > MAX_KEPT_OUTPUT_GRAD_BYTES:
            return  # expected, never kept: the capture falls back to a surrogate
        self._cur.kept_bytes += nbytes

        def receive(g: torch.Tensor) -> None:
            if not self._busy:
                micro.out_grads[path] = g.detach()

        self._cur.tensor_handles.append(register_grad_hook(t, receive)[0])

    # -- hooks: sampled steps -------------------------------------------------------------------------------
    def _module_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._busy:
            return
        try:
            name = self._names.get(id(module), "")
            if not name:
                return  # the root: recorded by _root_post
            tensors: Any = ((None, output),) if isinstance(output, torch.Tensor) else iter_tensors(output, "out")
            for _, t in tensors:
                if not t.is_floating_point() or t.numel() == 0:
                    continue
                self._cur.collector.pair("out", name, t.detach(), t.dtype == self._low)
                if t.requires_grad and self._grads_on:
                    self._grad_hook(t, name)
        except Exception as exc:
            self._fail(exc)

    def _grad_hook(self, t: torch.Tensor, name: str) -> None:
        low = t.dtype == self._low
        step = self._cur

        def receive(g: torch.Tensor) -> None:
            if self._busy or step is not self._cur:  # a capture's backward, or a late backward of a closed step
                return
            try:
                if g.numel():
                    step.collector.pair("grad", name, g.detach(), low)
            except Exception as exc:
                self._fail(exc)

        step.tensor_handles.append(register_grad_hook(t, receive)[0])

    def _sampled(self, step: int) -> bool:
        return self.stats_every > 0 and step % self.stats_every == 0

    def _sample_hooks(self, on: bool) -> None:
        """Module hooks only while a sampled step runs; an unsampled step runs the model's fast path."""
        self._grads_on = on
        if on and not self._module_handles:
            for module in self.root.modules():
                if module is not self.root:
                    self._module_handles.append(module.register_forward_hook(self._module_post))
        elif not on and self._module_handles:
            for handle in self._module_handles:
                handle.remove()
            self._module_handles.clear()

    # -- the scaler -----------------------------------------------------------------------------------------
    def _wrap_scale(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def scale(outputs: Any) -> Any:
            result = original(outputs)
            if self._active and not self._busy:
                try:
                    self._see_loss(outputs)
                except Exception as exc:
                    self._fail(exc)
            return result

        scale.__wrapped__ = original  # type: ignore[attr-defined]
        return scale

    def _see_loss(self, outputs: Any) -> None:
        value = loss_value(outputs)
        if value is None:
            return
        cur = self._cur
        slot = cur.collector.add(value)
        if cur.micro:
            micro = cur.micro[-1]
            micro.loss_slot = slot
            if self._targets is not None:
                micro.targets = self._targets
        else:
            cur.orphan_losses.append(slot)
        self._targets = None  # targets belong to one micro-batch

    def _wrap_update(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def update(*args: Any, **kwargs: Any) -> Any:
            before: Any = None
            found: list[torch.Tensor] = []
            if self._active:
                try:
                    before = scale_value(self.scaler)
                    found = found_inf_flags(self.scaler)
                except Exception as exc:
                    self._fail(exc)
            try:
                result = original(*args, **kwargs)
            except BaseException:
                self._drop_step()
                raise
            if self._active:
                try:
                    after = scale_value(self.scaler)
                except Exception as exc:
                    self._fail(exc)
                    after = None
                self._end_step(before, after, found)
            return result

        update.__wrapped__ = original  # type: ignore[attr-defined]
        return update

    # -- the step boundary ----------------------------------------------------------------------------------
    def _drop_step(self) -> None:
        """Forget the current step (its ``update`` raised, or it was read): its hooks go, a new step starts."""
        self._cur.remove_hooks()
        self._cur = StepState()

    def _end_step(self, before: Any, after: Any, found: list[torch.Tensor]) -> None:
        """One read-back, then the step's record, run bookkeeping, captures and the bundle. Never raises."""
        step, cur = self._step, self._cur
        sampled = bool(self._module_handles)
        if cur.dropped_micro:
            self._note(f"step {step}: {cur.dropped_micro} early forward(s) of {cur.forwards} not kept for a replay "
                       f"(at most {MAX_MICRO_BATCHES} per step)")
        self._drop_step()  # the step's hooks go before a capture runs its own passes
        try:
            record, bad_micro = cur.read(step, self.rank, sampled, before, after, found)
            self._steps.append(self._track(record, list(cur.micro), bad_micro))
        except Exception as exc:
            self._fail(exc)
        finally:
            self._step += 1
            try:
                self._sample_hooks(self._active and self._sampled(self._step))
            except Exception as exc:
                self._fail(exc)

    def _track(self, record: StepRecord, micro: list[MicroBatch], bad_micro: list[bool]) -> StepRecord:
        """Runs, captures and the bundle (:class:`FailureTracker`); the watch's hooks stay quiet meanwhile."""
        replayer = StepReplayer(self.root, self._low or torch.float16, self.device_type, self.loss_fn)
        self._busy = True
        try:
            return self._failures.track(record, micro, bad_micro, replayer, tuple(self._steps))
        finally:
            self._busy = False

    # -- reporting ------------------------------------------------------------------------------------------
    def _payload(self) -> RankPayload:
        """Everything ``report`` needs from this rank (what ranks exchange)."""
        scaler_on = self.scaler is not None and bool(getattr(self.scaler, "is_enabled", lambda: True)())
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
            dtype=self._low or (torch.float16 if scaler_on else torch.bfloat16),
            stats_every=self.stats_every,
            scale=self._steps[-1].new_scale if self._steps else None,
            total_steps=self._step,
        )

    def _note(self, text: str) -> None:
        if len(self._notes) < NOTES_KEPT:
            self._notes.append(text)

    def _fail(self, exc: BaseException) -> None:
        if len(self._errors) < ERRORS_KEPT:
            self._errors.append(f"{type(exc).__name__}: {exc}")


def watch(
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
) -> Watch:
    """Watch an unchanged autocast + GradScaler training loop; returns a started :class:`Watch`.

    >>> with ampdoctor.watch(model, scaler) as doctor:
    ...     train()                      # your loop: scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
    >>> print(doctor.report())

    Args:
        model: the model as trained (a DDP or ``torch.compile`` wrapper is peeled for the names).
        scaler: the loop's ``GradScaler``: each ``scaler.update()`` closes a step. Without one (bfloat16), call
            ``doctor.step()`` after the backward and before ``optimizer.step()`` (a capture after the optimizer
            applied non-finite gradients would replay the updated weights; the report says so when it happens).
        loss_fn: ``loss_fn(output, batch)`` (or ``(output, targets)`` after ``doctor.set_targets``) for the
            backward of a capture; without it, a scalar output, ``output.loss`` or a surrogate (as ``diagnose``).
        dtype: the autocast dtype; default: what autocast uses at the first forward.
        stats_every: per-module statistics (hooks on every module) every this many steps; 0 for never. Skipped
            steps are captured whatever this is.
        history: steps kept in the ring buffer.
        max_captures: full captures (a ``diagnose`` of the failing inputs) for runs of skipped steps, and as
            many again for persistent failures.
        bundle_dir: where the failure bundle goes (default: the current directory).
        save_bundle: write a failure bundle on the first persistent failure.

    Each step reads its statistics back from the device once, in ``scaler.update``. Use it as a context
    manager (or call ``close()``): the hooks and the wrapped scaler methods go away on exit, also after an
    exception. ``report()`` works inside and after the block.
    """
    return Watch(
        model, scaler, loss_fn=loss_fn, dtype=dtype, stats_every=stats_every, history=history,
        max_captures=max_captures, bundle_dir=bundle_dir, save_bundle=save_bundle,
    ).start()
