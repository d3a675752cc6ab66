"""Training-time watch, in the order a step flows through it.

``runtime`` (``watch``/``Watch``: lifecycle, step boundaries) with ``hooks`` (the hooks on the model), ``taps``
(the scaler's shared wrappers) and ``quiet`` (ampdoctor's own passes are never training) -> ``readback`` (what a
step keeps, its one read-back into a ``StepRecord``) -> ``runs`` and ``divergence`` (harmless / persistent /
diverged runs of bad steps; pure) -> ``failures`` (captures, the bundle and the log line per finished step) ->
``replay_step`` (a capture: ``diagnose`` of the failing forward under its RNG state) -> ``bundle`` (bundle files) /
``replay`` (``replay_bundle``) -> ``compose`` (typed per-rank payloads -> ``Report``). ``compiled``
(torch.compile); FSDP's gathered model (:func:`full_model`) lives in ``ampdoctor.capture.sharded``.

Importing this package imports no torch (the command line reads ``bundle_format`` before torch): ``full_model``
is loaded on first use.
"""

from typing import Any

__all__ = ["full_model"]


def __getattr__(name: str) -> Any:
    if name == "full_model":
        from ..capture.sharded import full_model

        return full_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
