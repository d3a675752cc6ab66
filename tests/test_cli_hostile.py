"""Hostile and wrong files (issue 11, items 2 and 6): a shard that runs code on load refuses the whole directory
(scan and diagnose alike), ``--allow-global`` is suggested only for known-harmless data types, and a file that is
not a checkpoint is named for what it looks like. Nothing in these files ever runs: the markers prove it.
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ampdoctor.checkpoint.load_weights import load_weights
from ampdoctor.checkpoint.scan import scan
from ampdoctor.cli.main import main
from ampdoctor.errors import CheckpointError, CheckpointRefused


def small_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


class RunsAShellCommand:
    """Unpickling this runs ``touch MARKER`` through os.system (posix.system): the file would exist."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


class Config:
    """A user's own class: ampdoctor cannot know whether loading it is safe."""

    def __init__(self) -> None:
        self.depth = 2


def sharded_run(tmp_path: Path, hostile: Any) -> Path:
    """A directory whose first shard holds half the model's weights and whose second also holds ``hostile``."""
    state = small_model().state_dict()
    run = tmp_path / "run"
    run.mkdir()
    torch.save({k: v for k, v in state.items() if k.startswith("0.")}, run / "model-1.pt")
    torch.save({**{k: v for k, v in state.items() if k.startswith("2.")}, "extra": hostile}, run / "model-2.pt")
    return run


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("ampdoctor: error: "), err
    return lines[0].removeprefix("ampdoctor: error: ")


# -- a malicious shard in a directory ----------------------------------------------------------------------------


def test_a_malicious_shard_refuses_the_directory_scan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # It used to be HEALTHY (exit 0), suggesting --allow-global posix.system "if you trust the files".
    marker = tmp_path / "code-ran"
    run = sharded_run(tmp_path, RunsAShellCommand(marker))
    assert main(["scan", str(run)]) == 2
    line = error_line(capsys)
    assert line == (
        f"{run / 'model-2.pt'}: refused by torch.load(weights_only=True): it needs posix.system; posix.system can "
        "run code: this file is likely malicious; do not allow it (ampdoctor refuses it even with --unsafe-load)"
    )
    assert "--allow-global" not in line
    assert not marker.exists()


def test_a_malicious_shard_refuses_diagnose_with_the_same_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # diagnose used to skip the shard silently and blame the model: "missing keys; check --model".
    marker = tmp_path / "code-ran"
    run = sharded_run(tmp_path, RunsAShellCommand(marker))
    argv = ["diagnose", str(run), "--model", "torch.nn:Sequential", "--input-shape", "2x4"]
    assert main(argv) == 2
    line = error_line(capsys)
    assert line.startswith(f"{run / 'model-2.pt'}: refused by torch.load(weights_only=True): it needs posix.system")
    assert "likely malicious" in line and "missing" not in line
    with pytest.raises(CheckpointRefused, match="likely malicious"):
        load_weights(small_model(), run)
    assert not marker.exists()


def test_unsafe_load_does_not_run_a_known_shell_call(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": RunsAShellCommand(marker)}, path)
    assert main(["scan", str(path), "--unsafe-load"]) == 2
    assert "likely malicious" in capsys.readouterr().err
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [0, 1])
def test_a_text_protocol_pickle_that_runs_code_is_named_malicious(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], protocol: int
) -> None:
    """A protocol 0/1 pickle is ASCII: it was called "not a checkpoint: a text file" and its globals never read."""
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil.ckpt"
    path.write_bytes(pickle.dumps(RunsAShellCommand(marker), protocol=protocol))
    for argv in (["scan", str(path)], ["scan", str(path), "--unsafe-load"]):
        assert main(argv) == 2
        err = capsys.readouterr().err  # (--unsafe-load warns first)
        assert "it needs posix.system" in err and "likely malicious" in err and "text file" not in err, err
    assert not marker.exists()


@pytest.mark.parametrize("legacy", [False, True])
def test_every_global_of_a_file_is_named_legacy_format_included(tmp_path: Path, legacy: bool) -> None:
    # torch names only the first refused global of a legacy file; ampdoctor reads them all from the pickle.
    path = tmp_path / "mixed.pt"
    torch.save({"w": torch.ones(2), "args": argparse.Namespace(a=1), "cfg": Config()}, path,
               _use_new_zipfile_serialization=not legacy)  # fmt: skip
    with pytest.raises(CheckpointRefused) as info:
        scan(path)
    assert set(info.value.blocking) == {"argparse.Namespace", f"{__name__}.Config"}


# -- what --allow-global is suggested for ------------------------------------------------------------------------


def test_allow_global_is_suggested_for_harmless_data_types_only(tmp_path: Path) -> None:
    path = tmp_path / "rng.pth"
    torch.save({"w": torch.ones(2), "rng": np.random.RandomState(0).get_state(), "args": argparse.Namespace()}, path)
    with pytest.raises(CheckpointRefused) as info:
        scan(path)
    message = str(info.value)
    assert "these are harmless data types: if you trust the file, allow exactly these with --allow-global " in message
    assert scan(path, allow_globals=info.value.blocking).verdict == "healthy"


def test_an_unknown_class_is_named_without_suggesting_to_allow_it(tmp_path: Path) -> None:
    path = tmp_path / "config.pt"
    torch.save({"w": torch.ones(2), "cfg": Config()}, path)
    with pytest.raises(CheckpointRefused) as info:
        scan(path)
    assert str(info.value) == (
        f"{path}: refused by torch.load(weights_only=True): it needs {__name__}.Config; ampdoctor does not know "
        f"{__name__}.Config and cannot tell whether loading it runs code; save the weights alone (e.g. "
        "model.state_dict()), or load the file yourself if you know what it holds"
    )


def test_a_class_from_the_saving_script_is_unknown_not_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Checkpoints written by a training script hold __main__.SomeClass; __main__ here is another program.
    import __main__

    monkeypatch.setattr(Config, "__module__", "__main__")
    monkeypatch.setattr(__main__, "Config", Config, raising=False)
    path = tmp_path / "script.pt"
    torch.save({"w": torch.ones(2), "cfg": Config()}, path)
    monkeypatch.delattr(__main__, "Config")
    with pytest.raises(CheckpointRefused, match="ampdoctor does not know __main__.Config and cannot tell"):
        scan(path)


def test_a_directory_with_an_unknown_class_is_scanned_with_a_warning(tmp_path: Path) -> None:
    run = sharded_run(tmp_path, Config())
    report = scan(run)
    assert report.verdict == "healthy"
    (finding,) = [f for f in report.findings if f.severity == "warning"]
    assert finding.kind == "refused_unknown" and finding.tensors == ("model-2.pt",)
    assert finding.globals == (f"{__name__}.Config",)
    text = " ".join(str(report).split())
    assert "cannot tell whether loading it runs code, so these files were left out" in text
    assert "--allow-global" not in text
    # diagnose: the model's "2." weights are in the refused file, so the refusal is the error, not "missing keys"
    with pytest.raises(CheckpointRefused, match="cannot tell whether loading it runs code"):
        load_weights(small_model(), run)


# -- not a checkpoint --------------------------------------------------------------------------------------------


def _npz(path: Path) -> None:
    with path.open("wb") as fh:
        np.savez(fh, a=np.ones(3))


def _npy_bytes() -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ones(3))
    return buffer.getvalue()


def _zip_without_pickle(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("readme.txt", "hello")


@pytest.mark.parametrize(
    ("name", "make", "looks_like"),
    [
        ("notes.pt", lambda p: p.write_text("epoch,loss\n1,0.5\n"), "a text file"),  # was "KeyError: 101"-like
        ("config.pt", lambda p: p.write_text('{"lr": 0.1, "depth": [1, 2]}'), "a JSON document"),
        ("image.pt", lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64)), "a PNG image"),
        ("photo.pt", lambda p: p.write_bytes(b"\xff\xd8\xff\xe0" + bytes(64)), "a JPEG image"),
        ("archive.pt", _zip_without_pickle, "a zip archive without data.pkl"),
        ("arrays.pt", _npz, "a NumPy .npz archive (diagnose takes it as --batch)"),
        ("array.pt", lambda p: p.write_bytes(_npy_bytes()), "a NumPy array file (.npy; diagnose takes it as --batch)"),
        ("plain.pt", lambda p: p.write_bytes(pickle.dumps({"a": 1}, protocol=2)),
         "a Python pickle without torch.save's header (not written by torch.save, or damaged)"),
        ("plain0.pt", lambda p: p.write_bytes(pickle.dumps({"a": [1, 2.5]}, protocol=0)),
         "a Python pickle without torch.save's header (not written by torch.save, or damaged)"),
        ("noise.pt", lambda p: p.write_bytes(bytes(range(7, 256)) * 3), "binary data of an unknown kind"),
        ("empty.pt", lambda p: p.write_bytes(b""), "an empty file (0 bytes; the copy failed?)"),
        ("model.gz", lambda p: p.write_bytes(b"\x1f\x8b\x08" + bytes(40)),
         "a gzip-compressed file (decompress it first)"),
    ],
)  # fmt: skip
def test_a_file_that_is_not_a_checkpoint_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, make: Any, looks_like: str
) -> None:
    path = tmp_path / name
    make(path)
    before = path.read_bytes()
    assert main(["scan", str(path)]) == 2
    assert error_line(capsys) == f"{path}: not a checkpoint: {looks_like}"
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        load_weights(small_model(), path)
    assert path.read_bytes() == before


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_a_torchscript_archive_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "scripted.pt"
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(small_model()), buffer)
    path.write_bytes(buffer.getvalue())
    assert main(["scan", str(path)]) == 2
    assert error_line(capsys) == (
        f"{path}: not a checkpoint: a TorchScript archive (torch.jit.save); scan a state_dict saved with torch.save"
    )


def test_diagnose_loads_a_trainer_directory_whose_rng_state_is_refused(tmp_path: Path) -> None:
    # A Hugging Face Trainer directory: the weights, plus rng_state.pth (numpy RNG state: a harmless refusal).
    run = tmp_path / "checkpoint-500"
    run.mkdir()
    source = small_model()
    torch.save(source.state_dict(), run / "pytorch_model.bin")
    torch.save({"python": np.random.RandomState(0).get_state()}, run / "rng_state.pth")
    target = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    loaded = load_weights(target, run)
    assert loaded.files == ("pytorch_model.bin",) and loaded.tensors == 4
    assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), source.state_dict().values()))


def test_a_global_whose_name_is_computed_at_load_is_refused_even_with_unsafe_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # STACK_GLOBAL on str("posix"), str("system"): no literal names to check, so ampdoctor cannot tell what it
    # imports. Before the fix, --unsafe-load ran os.system.
    import torch

    def unicode(text: str) -> bytes:
        raw = text.encode()
        return b"X" + len(raw).to_bytes(4, "little") + raw

    marker = tmp_path / "PWNED"
    payload = b"\x80\x02"
    payload += b"cbuiltins\nstr\n" + unicode("posix") + b"\x85R"
    payload += b"cbuiltins\nstr\n" + unicode("system") + b"\x85R"
    payload += b"\x93" + unicode(f"touch {marker}") + b"\x85R."
    base = tmp_path / "base.pt"
    torch.save({"w": torch.zeros(2)}, base)
    evil = tmp_path / "evade.pt"
    with zipfile.ZipFile(base) as zin, zipfile.ZipFile(evil, "w", compression=zipfile.ZIP_STORED) as zout:
        for item in zin.infolist():
            data = payload if item.filename.endswith("data.pkl") else zin.read(item.filename)
            zout.writestr(item, data)
    for extra in ([], ["--unsafe-load"]):
        assert main(["scan", str(evil), *extra]) == 2
        err = capsys.readouterr().err
        assert "computed while loading" in err and "likely malicious" in err, err
    assert not marker.exists()


def test_an_output_path_that_cannot_exist_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A symlink loop or an over-long name was 'internal error: OSError ... report it'."""
    path = tmp_path / "w.pt"
    torch.save(small_model().state_dict(), path)
    (tmp_path / "loop_a").symlink_to(tmp_path / "loop_b")
    (tmp_path / "loop_b").symlink_to(tmp_path / "loop_a")
    for output, why in ((tmp_path / "loop_a", "Too many levels of symbolic links"),
                        (tmp_path / ("x" * 300), "File name too long")):
        assert main(["scan", str(path), "-o", str(output)]) == 2
        assert error_line(capsys) == f"cannot write {output}: {why}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop_a", "loop_b", "w.pt"]
