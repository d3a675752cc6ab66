"""Memory between the passes of a failing diagnosis (issue 18: <= 1.25x a plain step's peak): each pass starts with
the host heap's free pages handed back, and no pass's tensors outlive it."""

from __future__ import annotations

import sys

import pytest
import torch
from test_api import constant_linear
from torch import nn

import ampdoctor
from ampdoctor.capture import session as session_module
from ampdoctor.capture.memory import trim_host_heap


def _overflowing() -> nn.Sequential:
    model = nn.Sequential()
    model.add_module("pre", constant_linear(16, 16, 1 / 16))
    model.add_module("boom", constant_linear(16, 16, 5000.0))  # 16 * 5000 = 80000 > 65504 in float16
    return model


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_host_heap_works_with_glibc() -> None:
    assert trim_host_heap() is True


def test_every_pass_starts_with_the_heap_trimmed(monkeypatch: pytest.MonkeyPatch) -> None:
    trims: list[int] = []
    monkeypatch.setattr(session_module, "trim_host_heap", lambda: trims.append(1) or True)
    report = ampdoctor.diagnose(_overflowing(), torch.ones(2, 16), device_type="cpu")
    ran = [p for p in report.run.passes if p.status == "ran"]
    assert len(ran) >= 3  # survey, detail and op zoom, verification
    assert len(trims) == len(ran)
