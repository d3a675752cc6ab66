"""Names from a file cannot spoof a terminal (issue 19, item 4): state-dict keys, file names and globals are shown
with control characters and line breaks escaped, in text and markdown reports, errors and notes; JSON keeps them
exact (escaped by JSON itself).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.checkpoint.load_weights import load_weights
from ampdoctor.cli.main import main
from ampdoctor.errors import InvalidInput
from ampdoctor.report.inert import inert
from ampdoctor.report.markdown import render_markdown

# Clears the screen, homes the cursor and prints a fake verdict on a line of its own.
SPOOF = "\x1b[2J\x1b[Hampdoctor scan: HEALTHY\r\nlayer\u202e"


def test_inert_escapes_control_format_and_undecodable_characters() -> None:
    assert inert("blocks.0.attn.weight") == "blocks.0.attn.weight"
    assert inert("模型.poids.é") == "模型.poids.é"
    assert inert(SPOOF) == "\\x1b[2J\\x1b[Hampdoctor scan: HEALTHY\\r\\nlayer\\u202e"
    assert inert("a\tb\x00c\x7fd\x85e\u2028f") == "a\\tb\\0c\\x7fd\\x85e\\u2028f"
    assert inert(os.fsdecode(b"shard-\xff\xfe.pt")) == "shard-\\xff\\xfe.pt"  # the bytes of a non-UTF-8 name


def _spoofing_checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "spoof.pt"
    torch.save({f"{SPOOF}.weight": torch.tensor([1.0, float("inf")]), "ok.weight": torch.ones(2)}, path)
    return path


@pytest.mark.parametrize("fmt", ["text", "markdown"])
def test_a_crafted_key_cannot_print_a_fake_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    path = _spoofing_checkpoint(tmp_path)
    assert main(["scan", str(path), "--format", fmt]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out and "\u202e" not in out
    lines = out.splitlines()
    assert not any(line.lstrip("#* ").startswith("ampdoctor scan: HEALTHY") for line in lines)
    assert "ampdoctor scan: overflow" in lines[0].lower()
    assert "\\x1b[2J\\x1b[Hampdoctor scan: HEALTHY\\r\\nlayer\\u202e" in out.replace("\\\\", "\\")


def test_json_keeps_the_key_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _spoofing_checkpoint(tmp_path)
    assert main(["scan", str(path), "--format", "json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert f"{SPOOF}.weight" in {t["name"] for t in data["tensors"]}


def test_keys_in_errors_and_file_names_in_errors_are_inert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "keys.pt"
    torch.save({"weight": torch.ones(2, 2), "bias": torch.ones(2), f"{SPOOF}": torch.ones(1)}, path)
    with pytest.raises(InvalidInput) as info:
        load_weights(nn.Linear(2, 2), path)
    assert "1 unexpected: \\x1b[2J\\x1b[Hampdoctor scan: HEALTHY\\r\\nlayer\\u202e" in str(info.value)
    evil_name = tmp_path / "a\x1b[2Jb\nampdoctor scan: HEALTHY.pt"
    evil_name.write_text("not a checkpoint")
    assert main(["scan", str(evil_name)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "\x1b" not in err
    assert "a\\x1b[2Jb\\nampdoctor scan: HEALTHY.pt: not a checkpoint: a text file" in err


def test_a_directory_scan_shows_file_names_and_notes_inert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"w": torch.ones(2)}, run / "good.pt")
    torch.save({"step": 3}, run / "x\x1b]0;owned\x07.pt")  # no tensors: named in a note and the files table
    assert main(["scan", str(run)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "x\\x1b]0;owned\\x07.pt" in out


def test_a_diagnose_report_shows_module_names_inert() -> None:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("\x1b[2Jfake", nn.Linear(4, 4))
    with torch.no_grad():
        model[0].weight.mul_(1e5)
    report = ampdoctor.diagnose(model, torch.full((2, 4), 100.0), dtype=torch.float16, device_type="cpu")
    assert report.verdict == "overflow"
    for rendered in (report.to_text(), render_markdown(report)):
        assert "\x1b" not in rendered
        assert "\\x1b[2Jfake" in rendered.replace("\\\\", "\\").replace("\\[", "[")


def test_progress_on_a_terminal_shows_file_names_inert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    run = tmp_path / "run"
    run.mkdir()
    torch.save({"w": torch.ones(2)}, run / "a\x1b[2Jb.pt")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["scan", str(run)]) == 0
    err = capsys.readouterr().err
    assert "a\\x1b[2Jb.pt" in err and "\x1b[2J" not in err
