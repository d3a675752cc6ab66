"""Seeded fuzzing of the command line with damaged checkpoints (issue 11, item 3).

Byte-level mutants and truncations of a real zip checkpoint, a legacy-format pickle and a safetensors file: every
run exits 0, 1 or 2; an exit 2 prints exactly one line and it is never an "internal error"; nothing prints a
traceback or a library warning; the input file keeps its bytes and mtime. ``main(argv)`` runs in-process.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

from ampdoctor.cli.main import main

SEED = 20240611
MUTANTS_PER_FILE = 300  # scan runs per source file (truncations included)
DIAGNOSE_MUTANTS = 40  # diagnose runs per source file (each healthy one runs a whole diagnosis)


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def sources(folder: Path) -> dict[str, bytes]:
    """The three formats, each holding the tiny model (the zip one a whole training checkpoint)."""
    model = tiny_model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    training = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": {"scale": 1024.0,
                "_growth_tracker": 3}, "epoch": 2}  # fmt: skip
    torch.save(training, folder / "zip.pt")
    torch.save(model.state_dict(), folder / "legacy.pt", _use_new_zipfile_serialization=False)
    files = {"zip.pt": (folder / "zip.pt").read_bytes(), "legacy.pt": (folder / "legacy.pt").read_bytes()}
    try:
        from safetensors.torch import save_file
    except ImportError:  # safetensors is an optional extra; CI installs it
        return files
    save_file(dict(model.state_dict()), str(folder / "model.safetensors"))
    files["model.safetensors"] = (folder / "model.safetensors").read_bytes()
    return files


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One of: a truncation, a few random bytes changed anywhere, near the start or near the end (where zip
    directories and safetensors headers live), a run of bytes deleted, or bytes inserted."""
    b = bytearray(data)
    kind = rng.choice(["truncate", "flip", "flip", "head", "tail", "delete", "insert"])
    if kind == "truncate":
        return bytes(b[: rng.randrange(len(b))])
    if kind == "delete":
        start = rng.randrange(len(b))
        del b[start : start + rng.randint(1, 64)]
        return bytes(b)
    if kind == "insert":
        at = rng.randrange(len(b))
        b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        return bytes(b)
    for _ in range(rng.choice([1, 1, 2, 3, 8])):
        if kind == "head":
            i = rng.randrange(min(len(b), 256))
        elif kind == "tail":
            i = len(b) - 1 - rng.randrange(min(len(b), 512))
        else:
            i = rng.randrange(len(b))
        b[i] = rng.randrange(256)
    return bytes(b)


def check_run(argv: list[str], path: Path, capsys: pytest.CaptureFixture[str]) -> int:
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    code = main(argv)
    out, err = capsys.readouterr()
    where = f"{argv} on a mutant of {len(before[0])} bytes"
    assert code in (0, 1, 2), where
    assert "Traceback" not in err and "Warning" not in err, (where, err)
    if code == 2:
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("ampdoctor: error: "), (where, err)
        assert "internal error" not in err, (where, err)
    else:
        assert err == "" and out, (where, err)
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before, where
    return code


@pytest.mark.slow
def test_damaged_checkpoints_never_crash_scan_or_diagnose(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(SEED)
    codes: dict[str, list[int]] = {}
    for name, data in sources(tmp_path).items():
        target = tmp_path / "mutants" / name
        target.parent.mkdir(exist_ok=True)
        scan = ["scan", str(target)]
        diagnose = ["diagnose", str(target), "--model", f"{__name__}:tiny_model", "--input-shape", "2x4"]
        for argv in [scan] * MUTANTS_PER_FILE + [diagnose] * DIAGNOSE_MUTANTS:
            target.write_bytes(mutate(data, rng))
            codes.setdefault(name, []).append(check_run(argv, target, capsys))
    for name, seen in codes.items():
        # Sanity of the fuzzing itself: most mutants are refused (2), and some still read (0 or 1).
        assert seen.count(2) > len(seen) // 2, (name, seen)
        assert any(code in (0, 1) for code in seen), (name, seen)
