"""A scan never reports weights it did not see (issue 19, items 6 and 10): dangling links, absent shards an index
names, FIFOs and devices named like shards make the scan incomplete (never HEALTHY, exit 2) and are named; stray
files that are not checkpoints are listed as skipped while the rest is scanned; file names that are not UTF-8
load like any other.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from ampdoctor.checkpoint.load_weights import load_weights
from ampdoctor.checkpoint.scan import scan
from ampdoctor.cli.main import main
from ampdoctor.errors import CheckpointError, InvalidInput
from ampdoctor.report.scan_report import ScanReport


def sharded(tmp_path: Path, suffix: str = ".bin", index: bool = True, shards: int = 2) -> Path:
    """``shards`` files of a Linear(2, 2)'s weights (weight in the first, bias in the second), with an index."""
    run = tmp_path / "run"
    run.mkdir()
    torch.manual_seed(0)
    state = nn.Linear(2, 2).state_dict()
    stem = "model" if suffix == ".safetensors" else "pytorch_model"
    names = [f"{stem}-{i + 1:05d}-of-{shards:05d}{suffix}" for i in range(shards)]
    weight_map = {}
    for i, (key, value) in enumerate(state.items()):
        name = names[i % shards]
        weight_map[key] = name
        if suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file({key: value.contiguous()}, str(run / name))
        else:
            torch.save({key: value}, run / name)
    if index:
        (run / f"{stem}{suffix}.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return run


def in_time(fn: Callable[[], Any], seconds: float = 20.0) -> Any:
    """``fn()``, failing the test (instead of hanging it) when it blocks, e.g. on a FIFO."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed back to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "blocked"
    if "error" in box:
        raise box["error"]
    return box["value"]


def assert_incomplete(report: ScanReport, name: str, reason: str) -> None:
    assert report.verdict == "incomplete" and report.exit_code == 2
    unread = [f for f in report.files if f.unread]
    assert [(f.name, f.missed) for f in unread] == [(name, True)]
    assert reason in unread[0].skipped, unread[0].skipped
    assert "this scan is incomplete" in report.to_text() and name in report.to_text()


@pytest.mark.parametrize("suffix", [".bin", ".safetensors"])
def test_a_dangling_shard_link_makes_the_scan_incomplete(tmp_path: Path, suffix: str) -> None:
    if suffix == ".safetensors":
        pytest.importorskip("safetensors")
    run = sharded(tmp_path, suffix)
    second = sorted(p for p in run.iterdir() if p.suffix == suffix)[1]
    second.unlink()
    second.symlink_to("../blobs/0123abcd.incomplete")  # a Hugging Face cache mid-download
    assert_incomplete(scan(run), second.name, "a dangling symbolic link (its target ../blobs/0123abcd.incomplete")


@pytest.mark.parametrize("suffix", [".bin", ".safetensors"])
def test_an_absent_shard_the_index_names_makes_the_scan_incomplete(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str
) -> None:
    if suffix == ".safetensors":
        pytest.importorskip("safetensors")
    run = sharded(tmp_path, suffix)
    second = sorted(p for p in run.iterdir() if p.suffix == suffix)[1]
    second.unlink()
    assert_incomplete(scan(run), second.name, "absent, although an index names it")
    assert main(["scan", str(run)]) == 2
    out = capsys.readouterr().out
    assert out.startswith("ampdoctor scan: INCOMPLETE - 1 checkpoint file(s) could not be read")
    assert main(["scan", str(run), "--format", "json"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] == "incomplete" and data["exit_code"] == 2
    assert ScanReport.from_json(json.dumps(data)) == scan(run)


def test_a_fifo_named_like_a_shard_is_named_and_never_blocks(tmp_path: Path) -> None:
    run = sharded(tmp_path, index=False)
    os.mkfifo(run / "pytorch_model-00003-of-00003.bin")
    report = in_time(lambda: scan(run))
    assert_incomplete(report, "pytorch_model-00003-of-00003.bin", "a FIFO (named pipe), not a regular file")
    fifo = tmp_path / "alone.pt"
    os.mkfifo(fifo)
    with pytest.raises(InvalidInput, match="a FIFO"):
        in_time(lambda: scan(fifo))


def test_a_link_to_dev_zero_is_named_not_read(tmp_path: Path) -> None:
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    run = sharded(tmp_path)
    (run / "extra.pt").symlink_to("/dev/zero")
    report = in_time(lambda: scan(run))
    # the index does not name it: listed as skipped, and the scan is whole
    assert report.verdict == "healthy" and report.exit_code == 0
    (skipped,) = [f for f in report.files if f.unread]
    assert skipped.name == "extra.pt" and not skipped.missed
    assert skipped.skipped == "a character device (a link to /dev/zero), not a regular file: not read"
    (run / "pytorch_model.bin.index.json").unlink()
    assert_incomplete(in_time(lambda: scan(run)), "extra.pt", "a character device")


def test_a_stray_text_file_does_not_fail_the_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for index in (False, True):
        (tmp_path / str(index)).mkdir()
        run = sharded(tmp_path / str(index), index=index)
        (run / "notes.pt").write_text("lr 3e-4, warmup 1000\n")
        report = scan(run)
        assert report.verdict == "healthy" and report.exit_code == 0
        assert [t.name for t in report.tensors] == ["weight", "bias"]
        (skipped,) = [f for f in report.files if f.unread]
        assert (skipped.name, skipped.missed, skipped.skipped) == ("notes.pt", False, "not a checkpoint: a text file")
        assert main(["scan", str(run)]) == 0
        assert "1 file(s) skipped: notes.pt: not a checkpoint: a text file: left out" in capsys.readouterr().out


def test_a_damaged_shard_without_an_index_makes_the_scan_incomplete(tmp_path: Path) -> None:
    run = sharded(tmp_path, index=False)
    second = sorted(run.iterdir())[1]
    second.write_bytes(second.read_bytes()[:100])
    report = scan(run)
    assert_incomplete(report, second.name, "a truncated or corrupt PyTorch")


@pytest.mark.parametrize("suffix", [".bin", ".safetensors"])
@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda p: p.write_bytes(b""), "an empty file (0 bytes; the copy failed?)"),
        (lambda p: p.write_bytes(bytes(range(7, 256)) * 3), "binary data of an unknown kind"),
    ],
)
def test_an_empty_or_unrecognisable_shard_without_an_index_makes_the_scan_incomplete(
    tmp_path: Path, suffix: str, damage: Any, reason: str
) -> None:
    """Both were skipped as "not a checkpoint", and the folder read HEALTHY with half its weights unseen."""
    if suffix == ".safetensors":
        pytest.importorskip("safetensors")
    run = sharded(tmp_path, suffix, index=False)
    second = sorted(run.iterdir())[1]
    damage(second)
    report = scan(run)
    assert report.verdict == "incomplete" and report.exit_code == 2
    (unread,) = [f for f in report.files if f.unread]
    assert unread.name == second.name and unread.missed
    if suffix == ".bin":  # a .safetensors file of unknown bytes is read as safetensors, and fails as one
        assert reason in unread.skipped


def test_an_incomplete_scan_with_an_overflow_keeps_the_verdict_and_exits_2(tmp_path: Path) -> None:
    run = sharded(tmp_path)
    torch.save({"weight": torch.full((2, 2), 1e6)}, run / "pytorch_model-00001-of-00002.bin")
    (run / "pytorch_model-00002-of-00002.bin").unlink()
    report = scan(run)
    assert report.verdict == "overflow" and report.exit_code == 2
    assert [f.kind for f in report.errors()] == ["beyond_range", "unread"]
    assert report.to_text().startswith("ampdoctor scan: OVERFLOW - 4 weight value(s) beyond the float16 range")


def test_an_unreadable_shard_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = sharded(tmp_path)
    second = sorted(p for p in run.iterdir() if p.suffix == ".bin")[1]
    second.chmod(0)
    if os.geteuid() == 0:  # root reads files whatever their mode: the permission check answers as for a user
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if os.fsdecode(p) == str(second) else real(p, mode))
    try:
        assert_incomplete(scan(run), second.name, "cannot be read: permission denied")
    finally:
        second.chmod(0o644)


def test_diagnose_names_the_shard_it_could_not_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = sharded(tmp_path)
    second = sorted(p for p in run.iterdir() if p.suffix == ".bin")[1]
    second.unlink()
    second.symlink_to(tmp_path / "gone")
    with pytest.raises(CheckpointError, match=f"{second.name}: a dangling symbolic link"):
        load_weights(nn.Linear(2, 2), run)
    argv = ["diagnose", str(run), "--model", "torch.nn:Linear", "--model-kwargs", '{"in_features": 2, '
            '"out_features": 2}', "--input-shape", "2x2"]  # fmt: skip
    assert main(argv) == 2
    assert "could not be read" in capsys.readouterr().err


# -- item 10: file names that are not UTF-8 --------------------------------------------------------------------


def _non_utf8(tmp_path: Path, write: Callable[[Path], None], suffix: str = ".pt") -> Path:
    plain = tmp_path / f"plain{suffix}"
    write(plain)
    raw = os.fsencode(tmp_path) + b"/poids-\xe9t\xe9" + suffix.encode()  # latin-1 bytes: not UTF-8
    os.rename(os.fsencode(plain), raw)
    return Path(os.fsdecode(raw))


@pytest.mark.parametrize("kind", ["zip", "legacy", "safetensors"])
def test_a_non_utf8_file_name_loads_like_any_other(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    tensor = torch.tensor([1.0, float("inf")])
    if kind == "safetensors":
        st = pytest.importorskip("safetensors.torch")
        path = _non_utf8(tmp_path, lambda p: st.save_file({"w": tensor}, str(p)), ".safetensors")
    else:
        path = _non_utf8(tmp_path, lambda p: torch.save({"w": tensor}, p, _use_new_zipfile_serialization=kind == "zip"))
    report = scan(path)
    assert report.verdict == "overflow" and [t.name for t in report.tensors] == ["w"]
    assert main(["scan", str(path)]) == 1
    out = capsys.readouterr().out
    assert "poids-\\xe9t\\xe9" in out  # the name's own bytes, shown as escapes
    assert main(["scan", str(tmp_path)]) == 1  # in a directory too
    capsys.readouterr()
    assert main(["scan", str(path), "--format", "json"]) == 1
    assert json.loads(capsys.readouterr().out)["verdict"] == "overflow"
    model = nn.Linear(2, 1)
    target = _non_utf8(tmp_path / "sub" if (tmp_path / "sub").mkdir() is None else tmp_path,
                       lambda p: torch.save(nn.Linear(2, 1).state_dict(), p))  # fmt: skip
    load_weights(model, target)


def test_a_name_problem_is_called_a_name_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Without /proc/self/fd a non-UTF-8 name cannot be handed to torch's reader: the name is the problem, not the
    # file ("truncated or corrupt ... copy it again" was the answer before).
    path = _non_utf8(tmp_path, lambda p: torch.save({"w": torch.ones(2)}, p))
    real_isdir = os.path.isdir
    monkeypatch.setattr(os.path, "isdir", lambda p: False if p == "/proc/self/fd" else real_isdir(p))
    with pytest.raises(CheckpointError) as info:
        scan(path)
    message = str(info.value)
    assert message.startswith(str(path).replace("\udce9", "\\xe9") + ": its file name is not valid UTF-8")
    assert "rename it" in message and "corrupt" not in message


def test_a_refused_shard_the_index_names_makes_the_scan_incomplete(tmp_path: Path) -> None:
    import argparse

    run = sharded(tmp_path)
    second = sorted(p for p in run.iterdir() if p.suffix == ".bin")[1]
    torch.save({"bias": torch.ones(2), "args": argparse.Namespace()}, second)  # refused by weights_only
    report = scan(run)
    assert report.verdict == "incomplete" and report.exit_code == 2
    assert [f.kind for f in report.findings] == ["unread", "refused_file"]
    assert f"{second.name}: refused" in report.to_text()
    (run / "pytorch_model.bin.index.json").unlink()  # no index: a refused file stays a warning (last round)
    assert scan(run).verdict == "healthy"
