"""Every file the command line writes is written atomically and never over an input (issue 11, item 1).

An input is the checkpoint (a file, or every file of a directory), ``--batch``, a bundle. "The same file" means the
same inode: the path itself, a hard link, a symlink. Each test checks the input's bytes, mtime and inode.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from torch import nn

from ampdoctor.cli.main import main
from ampdoctor.demo import make_demo

DEMO_FACTORY = "ampdoctor.demo:DemoTransformer"


def healthy(path: Path) -> Path:
    torch.manual_seed(0)
    torch.save(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).state_dict(), path)
    return path


def state(path: Path) -> tuple[bytes, int, int]:
    """Bytes, mtime (ns) and inode: all three must survive a command that reads the file."""
    st = path.stat()
    return path.read_bytes(), st.st_mtime_ns, st.st_ino


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("ampdoctor: error: "), err
    return lines[0]


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


# -- refused: the output is an input -----------------------------------------------------------------------------


def test_a_hard_link_to_the_checkpoint_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `ln ckpt.pt r.txt; ampdoctor scan ckpt.pt -o r.txt` used to exit 0 with the report written into ckpt.pt.
    ckpt = healthy(tmp_path / "ckpt.pt")
    link = tmp_path / "r.txt"
    os.link(ckpt, link)
    before = state(ckpt)
    assert main(["scan", str(ckpt), "-o", str(link)]) == 2
    assert error_line(capsys) == (
        f"ampdoctor: error: -o {link}: that is a hard link to the input {ckpt}; ampdoctor never writes over an "
        "input, choose another file"
    )
    assert state(ckpt) == before


def test_a_symlink_to_the_checkpoint_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = healthy(tmp_path / "ckpt.pt")
    link = tmp_path / "report.txt"
    link.symlink_to(ckpt)
    before = state(ckpt)
    assert main(["scan", str(ckpt), "-o", str(link)]) == 2
    assert "that is a symlink to the input" in error_line(capsys)
    assert state(ckpt) == before and link.is_symlink()


def test_a_hard_link_to_a_shard_of_a_directory_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    shard = healthy(shards / "part-0.pt")
    link = tmp_path / "out.json"
    os.link(shard, link)
    before = state(shard)
    assert main(["scan", str(shards), "--format", "json", "-o", str(link)]) == 2
    assert f"a hard link to the input {shard}" in error_line(capsys)
    assert state(shard) == before


def test_an_output_inside_the_checkpoint_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    healthy(shards / "part-0.pt")
    assert main(["scan", str(shards), "-o", str(shards / "report.txt")]) == 2
    assert "inside the input directory" in error_line(capsys)
    assert [p.name for p in shards.iterdir()] == ["part-0.pt"]


def test_diagnose_refuses_an_output_that_is_its_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, tokens, _ = make_demo()
    ckpt = tmp_path / "demo.pt"
    torch.save(model.state_dict(), ckpt)
    batch = tmp_path / "tokens.pt"
    torch.save(tokens, batch)
    alias = tmp_path / "report.md"
    os.link(batch, alias)
    before = state(batch)
    argv = ["diagnose", str(ckpt), "--model", DEMO_FACTORY, "--batch", str(batch), "-o", str(alias)]
    assert main(argv) == 2
    assert f"a hard link to the input {batch}" in error_line(capsys)
    assert state(batch) == before


def test_an_output_that_is_a_directory_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = healthy(tmp_path / "ckpt.pt")
    (tmp_path / "out").mkdir()
    assert main(["scan", str(ckpt), "-o", str(tmp_path / "out")]) == 2
    expected = f"ampdoctor: error: cannot write {tmp_path / 'out'}: it is a directory; give a file name"
    assert error_line(capsys) == expected


# -- written: atomically, with the umask, through symlinks ------------------------------------------------------


def test_an_existing_output_is_replaced_by_a_new_inode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Another name for the old report (not an input) keeps the old bytes: the report is a new file, not a rewrite.
    ckpt = healthy(tmp_path / "ckpt.pt")
    report = tmp_path / "report.txt"
    report.write_text("old report\n")
    other_name = tmp_path / "yesterday.txt"
    os.link(report, other_name)
    assert main(["scan", str(ckpt), "-o", str(report)]) == 0
    assert report.read_text().startswith("ampdoctor scan: HEALTHY")
    assert other_name.read_text() == "old report\n"
    assert report.stat().st_ino != other_name.stat().st_ino
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_a_new_output_gets_the_users_umask(tmp_path: Path, umask: int) -> None:
    ckpt = healthy(tmp_path / "ckpt.pt")
    old = os.umask(umask)
    try:
        assert main(["scan", str(ckpt), "-o", str(tmp_path / "r.txt")]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "r.txt").stat().st_mode) == 0o666 & ~umask  # a bare mkstemp file is 0600


def test_an_existing_output_keeps_its_mode(tmp_path: Path) -> None:
    ckpt = healthy(tmp_path / "ckpt.pt")
    report = tmp_path / "r.txt"
    report.write_text("old\n")
    report.chmod(0o640)
    assert main(["scan", str(ckpt), "-o", str(report)]) == 0
    assert stat.S_IMODE(report.stat().st_mode) == 0o640


def test_a_symlink_elsewhere_is_written_through(tmp_path: Path) -> None:
    ckpt = healthy(tmp_path / "ckpt.pt")
    (tmp_path / "reports").mkdir()
    target = tmp_path / "reports" / "latest.json"
    target.write_text("{}")
    link = tmp_path / "latest.json"
    link.symlink_to(target)
    assert main(["scan", str(ckpt), "--format", "json", "-o", str(link)]) == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text())["verdict"] == "healthy"
    assert leftovers(tmp_path) == [] and leftovers(tmp_path / "reports") == []


@pytest.mark.parametrize("name", ["-", "/dev/stdout"])
def test_dash_and_dev_stdout_write_to_standard_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    ckpt = healthy(tmp_path / "ckpt.pt")
    monkeypatch.chdir(tmp_path)
    assert main(["scan", str(ckpt), "-o", name]) == 0
    assert capsys.readouterr().out.startswith("ampdoctor scan: HEALTHY")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # no file called "-"


def test_ctrl_c_while_writing_leaves_the_old_output_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = healthy(tmp_path / "ckpt.pt")
    report = tmp_path / "report.txt"
    report.write_text("the previous report\n")

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt  # Ctrl-C after part of the text was written to the temporary file

    monkeypatch.setattr(os, "fsync", interrupted)
    assert main(["scan", str(ckpt), "-o", str(report)]) == 130
    assert capsys.readouterr().err == "ampdoctor: interrupted; nothing was written\n"
    assert report.read_text() == "the previous report\n"
    assert leftovers(tmp_path) == []


def test_ctrl_c_during_the_scan_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ampdoctor.checkpoint import scan as scan_module

    ckpt = healthy(tmp_path / "ckpt.pt")

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(scan_module, "load_file", interrupted)
    assert main(["scan", str(ckpt), "-o", str(tmp_path / "r.txt")]) == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
    assert capsys.readouterr().err == "ampdoctor: interrupted; nothing was written\n"


def test_write_output_refuses_the_same_path_without_the_cli(tmp_path: Path) -> None:
    from ampdoctor.cli import fileio
    from ampdoctor.errors import InvalidInput

    ckpt = healthy(tmp_path / "ckpt.pt")
    before = state(ckpt)
    with pytest.raises(InvalidInput, match="that is the input"):
        fileio.write_output("text\n", str(ckpt), [ckpt])
    assert state(ckpt) == before


def test_diagnose_refuses_an_output_that_is_the_model_factorys_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "factories_for_output_test.py"
    source.write_text("from torch import nn\n\ndef build():\n    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), "
                      "nn.Linear(4, 2))\n")
    ckpt = healthy(tmp_path / "ckpt.pt")
    before = state(source)
    monkeypatch.chdir(tmp_path)  # the current directory is importable, as the CLI documents
    argv = ["diagnose", str(ckpt), "--model", "factories_for_output_test:build", "--input-shape", "2x4",
            "-o", str(source)]
    assert main(argv) == 2
    assert "factories_for_output_test.py" in error_line(capsys)
    assert state(source) == before
