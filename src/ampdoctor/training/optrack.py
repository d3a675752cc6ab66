"""Per-op headroom trends: ops inside a module whose values the module hides (``q @ k.T`` before a softmax).

A module's output can stay bounded while an op inside it climbs towards the format's maximum (attention scores
under a softmax): the module trends of :mod:`.lookout` never see it, and when it overflows the softmax hides the
``-inf`` or turns it into NaN. So the watch also follows a few ops:

* **The survey** (the first watched forward, then on a sampled step at most every ``SURVEY_EVERY`` steps): a
  forward ``TorchFunctionMode`` and module pre/post hooks for that one forward measure every low-precision op
  output (``aminmax``, into the step's collector) by (innermost module, op name, occurrence). After the read-back,
  the ``TRACKED_OPS`` tightest ops whose |x|max is at least ``HIDDEN_GAP_BITS`` above their module's output
  maximum (values the module does not pass on) are *flagged*; so is every op a capture found making inf/NaN from
  finite inputs (a hidden overflow, :class:`~ampdoctor.records.OpOverflow`).
* **The taps** (every step, for flagged ops only): a pre-hook on the op's module pushes a small mode for that
  module's call (popped by an ``always_call`` post-hook, also when the forward raises), which counts that call's
  ops by name (hooks on its children tell their ops apart) and measures the flagged occurrences. Other modules
  run untouched.

An op is named ``"<module>:<op>#<occurrence>"`` (``"blocks.0.attn:matmul#0"``: the first matmul of the call, its
children's ops aside, as :class:`~ampdoctor.records.OpOverflow` counts them); its trend feeds the same
:class:`~.forecast.Forecaster` as the modules'.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..capture.cleanup import uninterrupted
from ..capture.hidden import ARITH, CAST, MAKE, counted_op, op_info
from ..capture.stats import measuring
from ..capture.walk import in_transform
from .forwards import HookTap

LOW = (torch.float16, torch.bfloat16)
# Ops followed every step, from the survey (flagged by captures come on top).
TRACKED_OPS = 2
# An op is worth following when its |x|max is at least this many bits above its module's output maximum.
HIDDEN_GAP_BITS = 1.0
# Steps between surveys (a survey runs on a sampled step).
SURVEY_EVERY = 50
# Ops that make values (the others select, view or fill them: not measured); the watch's own reductions are no
# op of the model's (not numbered).
_MADE = (MAKE, ARITH, CAST)
_OWN = frozenset({"aminmax"})


def op_key(module: str, op: str, occurrence: int) -> str:
    return f"{module}:{op}#{occurrence}"


def is_op_key(name: str) -> bool:
    return ":" in name


def _counted(func: Any, args: Any, out: Any) -> tuple[Optional[str], bool]:
    """The op's name as captures number it (:func:`~ampdoctor.capture.hidden.counted_op`; None: not numbered), and
    whether its output is low-precision values it made (worth measuring)."""
    name = counted_op(func, args, out)
    if name is None or name in _OWN:
        return None, False
    made = isinstance(out, torch.Tensor) and out.dtype in LOW and out.numel() > 0 and op_info(func)[2] in _MADE
    return name, made


class _Survey(TorchFunctionMode):
    """One forward: every op that made low-precision values, by (innermost module, op, occurrence)."""

    def __init__(self, names: dict[int, str], measure: Callable[[str, torch.Tensor], None]) -> None:
        super().__init__()
        self.names, self.measure = names, measure
        self.stack: list[tuple[str, dict[str, int]]] = []  # (module, op counts of its running call)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if self.stack and not measuring() and not in_transform():  # (vmap's ops: values only it can read)
            with torch._C.DisableTorchFunction():  # our reads are no op of the model's for a mode below this one
                self._count(func, args, out)
        return out

    def _count(self, func: Any, args: Any, out: Any) -> None:
        name, made = _counted(func, args, out)
        if name is not None:
            module, counts = self.stack[-1]  # the innermost call: its children's ops aside, as captures count
            n = counts.get(name, 0)
            counts[name] = n + 1
            if made:
                self.measure(op_key(module, name, n), out.detach())

    def pre(self, module: nn.Module, args: Any) -> None:
        name = self.names.get(id(module))
        if name:  # the root's own ops are no module's: its outputs are followed every step anyway
            self.stack.append((name, {}))

    def post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.names.get(id(module)) and self.stack:
            self.stack.pop()


class _Tap(TorchFunctionMode):
    """One module call: its ops counted by name, the flagged occurrences measured."""

    def __init__(self, module: str, wanted: dict[str, set[int]], measure: Callable[[str, torch.Tensor], None]) -> None:
        super().__init__()
        self.module, self.wanted, self.measure = module, wanted, measure
        self.counts: dict[str, int] = {}
        self.depth = 0  # > 0 while one of the module's children runs: its ops are the child's

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if not self.depth and not measuring() and not in_transform():
            with torch._C.DisableTorchFunction():  # our reads are no op of the model's for a mode below this one
                self._count(func, args, out)
        return out

    def _count(self, func: Any, args: Any, out: Any) -> None:
        name, made = _counted(func, args, out)
        if name is not None:
            n = self.counts.get(name, 0)
            self.counts[name] = n + 1
            if made and n in self.wanted.get(name, ()):
                self.measure(op_key(self.module, name, n), out.detach())


class OpTracker:
    """The survey and the taps of one watch (see the module docstring)."""

    def __init__(
        self, root: nn.Module, names: dict[int, str], measure: Callable[[str, torch.Tensor], None],
        gate: Callable[[], bool],
    ) -> None:
        self.root, self.names, self.measure, self.gate = root, names, measure, gate
        self.flagged: dict[str, tuple[str, str, int]] = {}  # key -> (module, op, occurrence)
        self.pinned: set[str] = set()  # flagged by a capture: kept whatever the surveys say
        self.surveyed = False  # the current step was surveyed (its read-back flags ops)
        self.survey: Optional[_Survey] = None
        self.last_survey = -SURVEY_EVERY
        self._survey_handles: list[Any] = []
        self._taps: list[Any] = []
        self._active: list[_Tap] = []  # pushed and not yet popped

    # -- the survey ------------------------------------------------------------------------------------------
    def survey_due(self, step: int) -> bool:
        return step - self.last_survey >= SURVEY_EVERY

    @uninterrupted
    def start_survey(self, step: int) -> None:
        """Before a watched root forward: survey it. Uninterrupted (as every install and removal here), and the
        survey is recorded only once its mode is pushed: a Ctrl-C never leaves a mode or hook that :meth:`close`
        does not know of, nor one it would pop twice."""
        self.last_survey = step
        self.surveyed = True
        survey = _Survey(self.names, self.measure)
        for module in self.root.modules():  # (HookTap: a copy or pickle of the model made meanwhile keeps none)
            self._survey_handles.append(HookTap(module, survey.pre, survey.post, always_call=True))
        survey.__enter__()
        self.survey = survey

    @uninterrupted
    def end_survey(self) -> None:
        """After the surveyed forward (or when it raised: from the step's end, or the watch's close)."""
        survey, self.survey = self.survey, None
        try:
            if survey is not None:
                survey.__exit__(None, None, None)
        finally:
            for handle in self._survey_handles:
                handle.remove()
            self._survey_handles.clear()

    def flag_from_survey(self, maxima: dict[str, float]) -> None:
        """After a surveyed step's read-back (``maxima``: |x|max of module outputs and op keys): follow the
        tightest ops whose values their module does not pass on."""
        self.surveyed = False
        candidates = []
        for key, value in maxima.items():
            if not is_op_key(key) or not (value > 0 and math.isfinite(value)):
                continue
            module = key.rsplit(":", 1)[0]
            out = maxima.get(module, 0.0)
            if out <= 0 or math.log2(value / out) >= HIDDEN_GAP_BITS:
                candidates.append((-value, key))
        keep = {key for _, key in sorted(candidates)[:TRACKED_OPS]}
        kept = {k: v for k, v in self.flagged.items() if k in keep or k in self.pinned}
        for key in keep:
            module, rest = key.rsplit(":", 1)
            op, occurrence = rest.rsplit("#", 1)
            kept[key] = (module, op, int(occurrence))
        if kept != self.flagged:
            self.flagged = kept
            self._install()

    def flag_ops(self, ops: list[tuple[str, str, int]]) -> None:
        """Follow these (module, op, occurrence) too (a capture's hidden overflows), from the next step on."""
        changed = False
        for module, op, occurrence in ops:
            key = op_key(module, op, occurrence)
            self.pinned.add(key)
            if module and key not in self.flagged:
                self.flagged[key] = (module, op, occurrence)
                changed = True
        if changed:
            self._install()

    # -- the taps --------------------------------------------------------------------------------------------
    @uninterrupted
    def _install(self) -> None:
        self.remove_taps()
        modules = dict(self.root.named_modules())
        by_module: dict[str, dict[str, set[int]]] = {}
        for owner, op, occurrence in self.flagged.values():
            by_module.setdefault(owner, {}).setdefault(op, set()).add(occurrence)
        for name, wanted in by_module.items():
            found = modules.get(name)
            if found is None:
                continue
            # HookTap: the taps stay between steps, and a copy or pickle of the model (torch.save of the whole
            # model, an EMA's deepcopy) must carry none of these closures
            self._taps.append(HookTap(found, self._push(name, wanted), self._pop(name), always_call=True))
            for child in found.children():
                self._taps.append(HookTap(child, self._child(name, 1), self._child(name, -1), always_call=True))

    def _push(self, name: str, wanted: dict[str, set[int]]) -> Callable[[nn.Module, Any], None]:
        @uninterrupted
        def push(module: nn.Module, args: Any) -> None:
            if self.gate():
                tap = _Tap(name, wanted, self.measure)
                tap.__enter__()
                self._active.append(tap)  # with the push: a Ctrl-C between the two would leave a mode unknown

        return push

    def _child(self, name: str, step: int) -> Callable[..., None]:
        def child(module: nn.Module, *rest: Any) -> None:
            for tap in reversed(self._active):  # the tap of this module's running call (a flagged child's is above)
                if tap.module == name:
                    tap.depth += step
                    return

        return child

    def _pop(self, name: str) -> Callable[[nn.Module, Any, Any], None]:
        @uninterrupted
        def pop(module: nn.Module, args: Any, output: Any) -> None:
            if self._active and self._active[-1].module == name:
                self._active.pop().__exit__(None, None, None)

        return pop

    @uninterrupted
    def remove_taps(self) -> None:
        while self._active:
            self._active.pop().__exit__(None, None, None)
        for handle in self._taps:
            handle.remove()
        self._taps.clear()

    @uninterrupted
    def close(self) -> None:
        self.end_survey()
        self.remove_taps()
