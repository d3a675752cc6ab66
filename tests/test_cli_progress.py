"""Progress on stderr for long steps (issue 11, item 4): shown when stderr is a terminal (or forced), never with
``--quiet`` or when stderr is a file or pipe; each shard and each large tensor is named while it is read."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ampdoctor.capture.progress import BarProgress, Progress, progress_on_stderr
from ampdoctor.checkpoint import scan as scan_module
from ampdoctor.checkpoint.scan import scan
from ampdoctor.cli.main import main


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def shards(tmp_path: Path) -> Path:
    folder = tmp_path / "shards"
    folder.mkdir()
    for i in range(3):
        torch.save({f"layers.{i}.weight": torch.ones(64, 64)}, folder / f"part-{i}.pt")
    return folder


def test_progress_is_shown_only_on_a_terminal_and_never_when_quiet() -> None:
    assert isinstance(progress_on_stderr(stream=Terminal()), BarProgress)
    assert type(progress_on_stderr(stream=io.StringIO())) is Progress  # a file or a pipe: the no-op
    assert type(progress_on_stderr(quiet=True, stream=Terminal())) is Progress
    assert isinstance(progress_on_stderr(force=True, stream=io.StringIO()), BarProgress)
    assert type(progress_on_stderr(quiet=True, force=True, stream=io.StringIO())) is Progress


def test_the_no_op_progress_accepts_every_call() -> None:
    with Progress() as progress:
        progress.stage("reading", total=3)
        progress.detail("part-0.pt")
        progress.advance()
    assert not progress.visible


def test_each_shard_and_each_large_tensor_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scan_module, "LARGE_TENSOR_NUMEL", 64 * 64)  # every tensor here counts as large
    stream = io.StringIO()
    with progress_on_stderr(force=True, stream=stream) as progress:
        scan(shards(tmp_path), progress=progress)
    shown = stream.getvalue()
    for i in range(3):
        assert f"part-{i}.pt: layers.{i}.weight (4,096 values)" in shown
    assert re.search(r"ampdoctor: reading 0/3 \[\d\d:\d\d\], part-0.pt", shown) and "ampdoctor: reading 2/3" in shown


def test_the_command_line_shows_progress_on_a_terminal_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = shards(tmp_path)
    assert main(["scan", str(folder)]) == 0
    assert capsys.readouterr().err == ""  # stderr is not a terminal here
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["scan", str(folder)]) == 0
    err = capsys.readouterr().err
    assert "ampdoctor: starting (importing torch)" in err and "ampdoctor: reading 0/3" in err
    assert main(["scan", str(folder), "-q"]) == 0
    assert capsys.readouterr().err == ""


def test_diagnose_names_its_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    ckpt = tmp_path / "mlp.pt"
    torch.save(nn.Linear(4, 2).state_dict(), ckpt)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    argv = [
        "diagnose",
        str(ckpt),
        "--model",
        "torch.nn:Linear",
        "--model-kwargs",
        '{"in_features": 4, "out_features": 2}',
        "--input-shape",
        "2x4",
        "--format",
        "json",
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    steps = [
        "importing the model code",
        "building the model",
        "checking the checkpoint",
        "loading the weights",
        "making the batch",
        "diagnosing",
    ]
    positions = [err.find(f"ampdoctor: {step}") for step in steps]
    assert -1 not in positions and positions == sorted(positions), err
