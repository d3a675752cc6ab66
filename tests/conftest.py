"""Shared fixtures and the CI rule: a test skipped for any reason other than a missing GPU is a failure."""

from __future__ import annotations

import os

import pytest

_GPU_WORDS = ("cuda", "gpu")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    # An expected failure (``xfail(strict=True)``: a known defect, written down as a test) reports as skipped too;
    # it is not a skip.
    if not os.environ.get("CI") or not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr).lower()
    if not any(word in reason for word in _GPU_WORDS):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI for a reason other than a missing GPU: {reason}"


@pytest.fixture(autouse=True)
def _compiler_stance_put_back():  # type: ignore[no-untyped-def]
    """Every test leaves torch's compiler stance as it found it (ampdoctor sets "force_eager" while it diagnoses;
    a stance left behind makes every later compiled call eager)."""
    import sys

    def stance() -> object:
        frames = sys.modules.get("torch._dynamo.eval_frame")
        found = getattr(frames, "_stance", None)
        return getattr(found, "stance", None)

    before = stance()
    yield
    after = stance()
    assert after in (None, before or "default"), f"compiler stance left at {after!r} (was {before or 'default'!r})"
