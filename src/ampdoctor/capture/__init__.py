"""Capture: hooks and dispatch modes on the live model, turned into plain-number records.

``walk`` (nested inputs/outputs), ``dtypes`` (formats, float32 casts), ``state`` (RNG, buffers, flags: the one
snapshot/restore), ``model`` (wrapper peeling, names), ``stats`` (statistics on the device, one readback per
pass), ``hooks`` (module and gradient hooks), ``zoom`` (op zoom), ``reference`` (per-call float32 re-runs),
``policy`` (autocast op lists), ``passes`` (one instrumented step).
"""
