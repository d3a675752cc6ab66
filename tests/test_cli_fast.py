"""Argument and path errors are answered before torch is imported or a model is built (issue 11, item 4).

Each case runs the command line in a fresh interpreter, which then reports whether ``torch`` was imported. The
answer used to come after 5-8 s of importing torch and building the model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ampdoctor

SRC = Path(ampdoctor.__file__).resolve().parents[1]  # the ampdoctor these tests import
# Runs main(argv) and prints its exit code and whether torch was imported, as JSON on the last line.
PROBE = (
    "import json, sys\n"
    "from ampdoctor.cli.main import main\n"
    "code = main(json.loads(sys.argv[1]))\n"
    "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules}))\n"
)


def run(argv: list[str], cwd: Path) -> tuple[dict[str, object], str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.fixture()
def files(tmp_path: Path) -> Path:
    (tmp_path / "ckpt.pt").write_bytes(b"PK\x03\x04 not read by these checks")
    (tmp_path / "batch.pt").write_bytes(b"not read either")
    return tmp_path


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["diagnose", "ckpt.pt", "--model", "m:f", "--input-shape", "eightx32"],
            "--input-shape 'eightx32': write positive sizes joined by x",
        ),
        (["diagnose", "ckpt.pt", "--model", "m:f", "--batch", "missing.pt"], "--batch missing.pt: no such file"),
        (["diagnose", "missing.pt", "--model", "m:f", "--input-shape", "2x4"], "missing.pt: no such file or directory"),
        (["diagnose", "ckpt.pt", "--model", "no-colon", "--input-shape", "2x4"], "--model 'no-colon': write it as"),
        (["diagnose", "ckpt.pt", "--model", "m:f", "--loss", "pkg:", "--input-shape", "2x4"], "--loss 'pkg:': write"),
        (
            ["diagnose", "ckpt.pt", "--model", "m:f", "--model-kwargs", "{depth: 2}", "--input-shape", "2x4"],
            "--model-kwargs '{depth: 2}' is not JSON",
        ),
        (
            ["diagnose", "ckpt.pt", "--model", "m:f", "--input-shape", "2x4", "--input-dtype", "float8_e4m3fn"],
            "--input-dtype 'float8_e4m3fn' is not a real floating, integer or bool dtype",
        ),
        (["diagnose", "ckpt.pt", "--model", "m:f"], "give the model's input: --batch FILE or --input-shape SHAPE"),
        (["diagnose", "ckpt.pt", "--model", "m:f", "--input-shape", "2x4", "-o", "ckpt.pt"], "never writes over"),
        (["scan", "missing.pt"], "missing.pt: no such file or directory"),
        (["scan", "ckpt.pt", "-o", "ckpt.pt"], "never writes over an input"),
        (["scan", "ckpt.pt", "--max-rows", "0"], "--max-rows must be at least 1"),
        (["scan", "ckpt.pt", "--allow-global", "os.system"], "--allow-global os.system: it can run code"),
        (["scan", "ckpt.pt", "-o", "no/such/dir/r.txt"], "cannot write no/such/dir/r.txt: no such directory"),
    ],
)
def test_argument_errors_come_before_torch(files: Path, argv: list[str], expected: str) -> None:
    result, err = run(argv, files)
    assert result == {"code": 2, "torch": False}, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ampdoctor: error: ") and expected in lines[0], err


def test_the_command_line_imports_no_torch_for_help(files: Path) -> None:
    result, err = run(["scan", "--help"], files)
    assert result == {"code": 0, "torch": False}, err

