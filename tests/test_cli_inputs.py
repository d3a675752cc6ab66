"""The inputs a user really has, through the installed ``ampdoctor`` command (issue 21, items 1 and 2).

A random ``--input-shape`` batch is said in every rendering ("HEALTHY on random input"); a batch with targets
(a file holding ``(inputs, targets)`` or a dict, or ``--batch MODULE:FUNCTION``) reaches ``--loss`` whole, while
the model gets the API's rule or the part ``--model-inputs`` names; batch files are loaded under the checkpoint
loading policy.

The model (``inputmodels.py``, written into the test's folder) is ``Linear(16, 4)`` with weights 8.0: on random
N(0, 1) inputs its outputs are about 8 * 4 = 32 (healthy in float16), while the real batch (values 1000) gives
16 * 1000 * 8 = 128000 > 65504: an overflow in the forward.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ampdoctor

SRC = Path(ampdoctor.__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # each case runs the installed command (a fresh interpreter, torch imported)

MODELS = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(x)


def build():
    return Net()


SEEN = []


def ce_loss(output, batch):
    # the whole batch, targets included: (inputs, targets) or {"x": ..., "y": ...}
    targets = batch["y"] if isinstance(batch, dict) else batch[1]
    assert targets.dtype == torch.int64 and targets.shape == (8,), f"targets not received: {type(batch)}"
    return nn.functional.cross_entropy(output.float(), targets)


def make_batch():
    return {"x": torch.full((8, 16), 1000.0), "y": torch.arange(8) % 4}


def small_batch():
    return [torch.full((8, 16), 0.5), torch.arange(8) % 4]
'''


def ampdoctor_command() -> str:
    """The console script installed next to this interpreter (the one a user runs)."""
    found = shutil.which("ampdoctor", path=str(Path(sys.executable).parent)) or shutil.which("ampdoctor")
    assert found, "the ampdoctor console script is not installed"
    return found


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [ampdoctor_command(), *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.fixture()
def work(tmp_path: Path) -> Path:
    (tmp_path / "inputmodels.py").write_text(MODELS)
    sys.path.insert(0, str(tmp_path))
    try:
        import inputmodels

        model = inputmodels.build()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("inputmodels", None)
    with torch.no_grad():
        model.fc.weight.fill_(8.0)
        model.fc.bias.zero_()
    torch.save(model.state_dict(), tmp_path / "ckpt.pt")
    torch.save((torch.full((8, 16), 1000.0), torch.arange(8) % 4), tmp_path / "xy.pt")
    return tmp_path


def test_random_input_is_said_in_every_format(work: Path) -> None:
    base = ["diagnose", "ckpt.pt", "--model", "inputmodels:build", "--input-shape", "8x16", "-q"]
    done = run(base, work)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "ampdoctor: HEALTHY on random input"
    assert lines[2].strip().startswith("The batch was random (--input-shape 8x16, float32, seed 0), not your data")
    data = json.loads(run([*base, "--format", "json"], work).stdout)
    assert data["verdict"] == "healthy" and data["on_random_input"] is True
    assert data["run"]["random_input"] == "--input-shape 8x16, float32, seed 0"
    markdown = run([*base, "--format", "markdown"], work).stdout
    assert "HEALTHY on random input" in markdown.splitlines()[0] and "The batch was random" in markdown
    html = run([*base, "--format", "html"], work).stdout
    assert '<span class="ad-verdict">HEALTHY on random input</span>' in html
    assert "<title>ampdoctor: healthy on random input" in html and "The batch was random" in html
    # The same checkpoint on the real batch: the overflow the random batch could not show, and no random note.
    real = run(["diagnose", "ckpt.pt", "--model", "inputmodels:build", "--batch", "xy.pt", "--model-inputs", "0",
                "-q"], work)
    assert real.returncode == 1, real.stderr
    assert real.stdout.splitlines()[0] == "ampdoctor: OVERFLOW - forward origin: fc"
    assert "random" not in real.stdout


def test_targets_file_reaches_the_loss_whole(work: Path) -> None:
    argv = ["diagnose", "ckpt.pt", "--model", "inputmodels:build", "--batch", "xy.pt", "--model-inputs", "0",
            "--loss", "inputmodels:ce_loss", "--format", "json", "-q"]
    done = run(argv, work)
    assert done.returncode == 1, done.stderr
    data = json.loads(done.stdout)
    assert data["verdict"] == "overflow" and data["findings"]["forward_origin"]["module"] == "fc"
    assert "ce_loss" in data["run"]["loss_source"] or "loss_fn" in data["run"]["loss_source"]
    assert [b["path"] for b in data["trace"]["batch"]] == ["batch"]  # the model got x alone: model(x)


def test_batch_function_with_dict_keys(work: Path) -> None:
    argv = ["diagnose", "ckpt.pt", "--model", "inputmodels:build", "--batch", "inputmodels:make_batch",
            "--model-inputs", "x", "--loss", "inputmodels:ce_loss", "-q"]
    done = run(argv, work)
    assert done.returncode == 1, done.stderr
    assert done.stdout.splitlines()[0] == "ampdoctor: OVERFLOW - forward origin: fc"
    # A list from the function, small values: healthy, the targets reached the loss (it asserts on them).
    argv[5] = "inputmodels:small_batch"
    argv[7] = "0"
    healthy = run(argv, work)
    assert healthy.returncode == 0, healthy.stderr
    assert healthy.stdout.splitlines()[0] == "ampdoctor: HEALTHY"


def test_api_rule_without_selection_and_the_hint(work: Path) -> None:
    done = run(["diagnose", "ckpt.pt", "--model", "inputmodels:build", "--batch", "xy.pt", "-q"], work)
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]
    assert "a tuple of 2 (Tensor [8, 16], Tensor [8])" in line and "--model-inputs 0" in line
    wrong = run(["diagnose", "ckpt.pt", "--model", "inputmodels:build", "--batch", "xy.pt", "--model-inputs", "2",
                 "-q"], work)
    assert wrong.returncode == 2
    assert "is a tuple of 2 element(s); give positions 0 to 1" in wrong.stderr


class Hostile:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("touch pwned",))


def test_batch_files_follow_the_loading_policy(work: Path) -> None:
    torch.save({"x": torch.ones(8, 16), "boom": Hostile()}, work / "evil.pt")
    for extra in ([], ["--unsafe-load"]):
        done = run(["diagnose", "ckpt.pt", "--model", "inputmodels:build", "--batch", "evil.pt", "-q", *extra], work)
        assert done.returncode == 2
        assert "likely malicious" in done.stderr and "evil.pt" in done.stderr
    assert not (work / "pwned").exists()
    import argparse

    torch.save((torch.ones(8, 16), argparse.Namespace(lr=1.0)), work / "ns.pt")
    done = run(["diagnose", "ckpt.pt", "--model", "inputmodels:build", "--batch", "ns.pt", "-q"], work)
    assert done.returncode == 2 and "--allow-global argparse.Namespace" in done.stderr
