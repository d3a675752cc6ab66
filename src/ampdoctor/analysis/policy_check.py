"""The CPU-policy note of an origin, checked against a re-run under CUDA's autocast policy (emulated on CPU).

``analyze`` words a note from the origin's op alone (``autocast_ops.cpu_policy_finding_note``: CUDA runs that op
in float32). The op's name is not enough in either direction: softmax of a row that a mask filled with ``-inf``
is NaN in float32 too (the note would blame the CPU policy for a NaN CUDA has as well), and a ``div`` that runs
the same on both policies can divide by a ``pow``/``sum``/norm that only CPU autocast kept in float16 earlier in
the same call (no note, for a NaN CUDA does not have). With the trace of the same step under CUDA's policy, the
note says what that re-run showed: the CPU policy is blamed only when the CUDA-policy step does not make the same
finding at the same call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Optional

from ..autocast_ops import CUDA_POLICY_HINT, short_op
from ..records import ModuleInfo, PassTrace
from .findings import Findings, Origin
from .origin import backward_origin, classify, forward_origin


def _same_call(a: Optional[Origin], b: Origin) -> bool:
    return a is not None and (a.module, a.call) == (b.module, b.call)


def _checked(origin: Optional[Origin], there: Optional[Origin]) -> Optional[Origin]:
    """``origin`` with its note decided by ``there``, the origin of the same step under the CUDA policy."""
    if origin is None:
        return None
    if _same_call(there, origin):
        # CUDA's policy makes the same finding at the same call: nothing here is specific to the CPU policy.
        return dataclasses.replace(origin, policy_note="") if origin.policy_note else origin
    kind = "overflow" if classify(origin.bad, origin.op) == "overflow" else "NaN"
    if there is None:
        seen = f"under the CUDA policy (emulated) the step makes no {origin.direction} inf or NaN"
    else:
        seen = f"under the CUDA policy (emulated) {origin.label} stays finite and the origin is {there.label}"
    note = origin.policy_note
    if note:
        note = note.replace(CUDA_POLICY_HINT, seen)
    elif origin.op is not None:
        note = (
            f"`{short_op(origin.op.op)}` runs the same on both policies, but its input differs: CUDA autocast runs "
            f"pow, sum and the norms in float32 where CPU autocast keeps them in {origin.op.output_dtype} (in this "
            f"call or before it); this {kind} is specific to the CPU policy: {seen}"
        )
    else:
        note = f"this {kind} is specific to the CPU policy: {seen}"
    return dataclasses.replace(origin, policy_note=note)


def checked_policy_notes(findings: Findings, cuda: PassTrace, modules: Iterable[ModuleInfo]) -> Findings:
    """``findings`` of a CPU-policy diagnosis with each origin's policy note decided by ``cuda``, the same step
    re-run under CUDA's policy (forward only when the finding is a forward one)."""
    fwd = _checked(findings.forward_origin, forward_origin(cuda))
    bwd = findings.backward_origin
    if bwd is not None and cuda.backward_ran:
        bwd = _checked(bwd, forward_origin(cuda) or backward_origin(cuda, list(modules)))
    return dataclasses.replace(findings, forward_origin=fwd, backward_origin=bwd)
