"""The first call (issue 22): a diagnosis imports nothing heavy it does not need. torch's dynamo machinery (pulled
in by a dispatch mode's first op) and ``torch.distributed.tensor`` (looked up for FSDP2) cost about 2-3 s and
80 MB on the first ``diagnose`` in a process; neither is needed for a model that is neither compiled nor sharded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import sys
import torch
from torch import nn

import ampdoctor

torch.manual_seed(0)
# 16 * 5000 = 80000 > 65504: boom's own matmul overflows in float16; the op zoom (a TorchDispatchMode) runs in it.
model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
with torch.no_grad():
    model[0].weight.fill_(1 / 16); model[0].bias.zero_(); model[1].weight.fill_(5000.0); model[1].bias.zero_()
report = ampdoctor.diagnose(model, torch.ones(2, 16), device_type="cpu")
first = report.trace.op_finding.op, report.forward_origin.module
heavy = sorted(m for m in ("torch._dynamo", "torch.distributed.tensor", "sympy") if m in sys.modules)
import torch._dynamo  # now loaded: the zoom wraps its dispatch in torch._disable_dynamo, as torch would
from ampdoctor.capture.zoom import _Zoom
again = ampdoctor.diagnose(model, torch.ones(2, 16), device_type="cpu")
print(heavy, first, (again.trace.op_finding.op, again.forward_origin.module), "__wrapped_dynamo__" in _Zoom.__dict__)
"""


def test_a_first_diagnosis_with_an_op_zoom_imports_neither_dynamo_nor_dtensor() -> None:
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-2] == "[] ('aten::addmm', '1') ('aten::addmm', '1') True"
