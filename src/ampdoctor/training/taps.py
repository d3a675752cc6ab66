"""The scaler methods a watch listens to: one shared tap per scaler and method, however many watches listen.

A tap replaces ``scaler.scale`` / ``scaler.update`` (and, for a disabled scaler, ``scaler.step``) by an instance
attribute that calls the method the scaler had (its own instance attribute, or the class's) and tells every
listening watch. Watches join and leave in any order; when the last one leaves, the scaler gets back exactly what
it had: its own instance attribute, or none. Nothing of the scaler's behaviour changes.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

# The attribute of a tap's wrapper that leads back to the tap (a second watch finds the first one's tap by it).
_TAP_ATTRIBUTE = "_ampdoctor_tap"


class ScaleListener(Protocol):
    def scaled(self, outputs: Any) -> None:
        """``scaler.scale(outputs)`` just ran."""


class StepListener(Protocol):
    def before_step(self) -> None:
        """``scaler.step(optimizer)`` is about to run the optimizer."""


class UpdateListener(Protocol):
    def before_update(self) -> Any:
        """Called before ``scaler.update``; what it returns comes back to :meth:`after_update`."""

    def after_update(self, before: Any) -> None:
        """``scaler.update`` returned."""

    def update_failed(self) -> None:
        """``scaler.update`` raised (the exception goes on to the caller)."""


class Tap:
    """One scaler method, wrapped once; the listeners are told in the order they joined."""

    def __init__(self, scaler: Any, name: str) -> None:
        self.scaler = scaler
        self.name = name
        self.had_own = name in scaler.__dict__
        self.original: Callable[..., Any] = getattr(scaler, name)
        self.listeners: list[Any] = []
        wrappers = {"scale": self._scale_wrapper, "step": self._step_wrapper}
        self.wrapper = wrappers.get(name, self._update_wrapper)()
        self.wrapper.__wrapped__ = self.original  # type: ignore[attr-defined]
        setattr(self.wrapper, _TAP_ATTRIBUTE, self)
        setattr(scaler, name, self.wrapper)

    def _scale_wrapper(self) -> Callable[..., Any]:
        def scale(outputs: Any) -> Any:
            result = self.original(outputs)
            for listener in list(self.listeners):
                listener.scaled(outputs)
            return result

        return scale

    def _step_wrapper(self) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            for listener in list(self.listeners):
                listener.before_step()
            return self.original(*args, **kwargs)

        return step

    def _update_wrapper(self) -> Callable[..., Any]:
        def update(*args: Any, **kwargs: Any) -> Any:
            listeners = list(self.listeners)
            before = [listener.before_update() for listener in listeners]
            try:
                result = self.original(*args, **kwargs)
            except BaseException:
                for listener in listeners:
                    listener.update_failed()
                raise
            for listener, token in zip(listeners, before):
                listener.after_update(token)
            return result

        return update

    def leave(self, listener: Any) -> None:
        """``listener`` stops listening; the last one out puts the scaler's own method back (when the wrapper is
        still the scaler's: a wrapper someone installed over it stays, calling through this inert tap)."""
        if listener in self.listeners:
            self.listeners.remove(listener)
        if self.listeners or self.scaler.__dict__.get(self.name) is not self.wrapper:
            return
        if self.had_own:
            setattr(self.scaler, self.name, self.original)
        else:
            self.scaler.__dict__.pop(self.name, None)


def join(scaler: Any, name: str, listener: Any) -> Tap:
    """Listen to ``scaler.<name>``: the tap already on it, or a new one."""
    tap: Optional[Tap] = getattr(scaler.__dict__.get(name), _TAP_ATTRIBUTE, None)
    if tap is None or not isinstance(tap, Tap) or tap.scaler is not scaler:
        tap = Tap(scaler, name)
    tap.listeners.append(listener)
    return tap
