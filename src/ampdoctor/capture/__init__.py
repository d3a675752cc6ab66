"""Capture: hooks and dispatch modes on the live model, turned into plain-number records.

``walk`` (nested inputs/outputs), ``dtypes`` (formats, float32 casts), ``state`` (RNG, buffers, parameters,
flags: the one snapshot/restore), ``model`` (wrapper peeling, names), ``stats`` (statistics on the device, one
readback per pass), ``hooks`` (module and gradient hooks), ``zoom`` (op zoom; ``zoom_flow`` follows the data,
``zoom_ops`` knows what each op reads), ``reference`` (per-call float32 re-runs), ``emulate`` (CUDA's autocast
policy on CPU, from the torch-free tables in ``ampdoctor.autocast_ops``), ``checks`` (what diagnose refuses),
``passes`` (one instrumented step).
"""
