"""Training-time watch, in the order a step flows through it.

``runtime`` (``watch``/``Watch``: hooks, the wrapped scaler, step boundaries) -> ``readback`` (what a step keeps,
its one read-back into a ``StepRecord``) -> ``runs`` (harmless / persistent / open runs of bad steps; pure)
-> ``failures`` (captures and the bundle per finished step) -> ``replay_step`` (a capture: ``diagnose`` of the
failing forward under its RNG state) -> ``bundle`` (bundle files) / ``replay`` (``replay_bundle``) ->
``compose`` (typed per-rank payloads -> ``Report``).
"""
