"""Whether a re-run of the step saw what the survey saw: a diagnosis rewinds the RNG streams, buffers and
parameters before every pass, so the same step runs again bit for bit, unless the model draws on state it does
not rewind (a Python attribute its forward changes, a hook that removes itself, the time). A report built on
a re-run that no longer shows the survey's inf/NaN would call the step healthy."""

from __future__ import annotations

from ..records import PassTrace


def unreproduced(survey: PassTrace, rerun: PassTrace, same_scale: bool) -> str:
    """A note naming what the re-run did not reproduce of the survey, or "" when it did (the forward's health and
    its first non-finite call; the gradients' finiteness when both ran a backward at the same loss scale)."""
    differences = []
    if survey.forward_healthy() != rerun.forward_healthy() or _first_bad(survey) != _first_bad(rerun):
        differences.append(f"forward: {_forward(survey)} in the survey, {_forward(rerun)} in the re-run")
    if same_scale and survey.backward_ran and rerun.backward_ran and (
        survey.gradients_finite() != rerun.gradients_finite()
    ):
        differences.append(
            f"gradients: {_finite(survey.gradients_finite())} in the survey, {_finite(rerun.gradients_finite())} in "
            "the re-run"
        )
    if not differences:
        return ""
    return (
        f"the step is not the same twice: a re-run did not reproduce the survey ({'; '.join(differences)}). The "
        "model draws on state ampdoctor does not rewind between passes (a Python attribute its forward changes, a "
        "hook that removes itself when it fires, the clock); this report stands on the survey, the step as it "
        "first ran, and what re-runs prove (remedies, scales) may not hold for it"
    )


def _first_bad(trace: PassTrace) -> tuple[str, int] | None:
    bad = trace.bad_output_calls()
    return (bad[0].module, bad[0].call) if bad else None


def _forward(trace: PassTrace) -> str:
    first = _first_bad(trace)
    if first is None:
        return "finite" if trace.forward_healthy() else "non-finite loss or output"
    return f"inf/NaN from {first[0] or '<root>'}"


def _finite(finite: bool) -> str:
    return "finite" if finite else "inf/NaN"
