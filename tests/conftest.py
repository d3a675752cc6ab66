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
