"""``ampdoctor scan`` and ``ampdoctor diagnose`` through ``ampdoctor.cli.main``: exit codes, output, bad input.

Exit status: 0 healthy (or warnings only), 1 findings, 2 usage or input error with one line on stderr.
Every file lives in tmp_path; the checkpoints are never modified and nothing is written next to them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.cli.main import main
from ampdoctor.demo import DEMO_ORIGIN, make_demo
from ampdoctor.records.scan import SCAN_SCHEMA_VERSION
from ampdoctor.report import Report
from ampdoctor.report.scan_report import ScanReport

DEMO_FACTORY = "ampdoctor.demo:DemoTransformer"


def save(obj: Any, path: Path) -> Path:
    torch.save(obj, path)
    return path


def healthy(path: Path) -> Path:
    torch.manual_seed(0)
    return save(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).state_dict(), path)


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ampdoctor: error: ") and "Traceback" not in err
    return lines[0]


def fingerprint(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Every file's bytes and mtime (ns): a command must leave them all as they were, and add none."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


# -- scan ----------------------------------------------------------------------------------------------------


def test_scan_healthy_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = healthy(tmp_path / "model.pt")
    assert main(["scan", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0] == "ampdoctor scan: HEALTHY - no inf/NaN, nothing out of range"
    assert err == ""  # no progress: stderr is not a terminal


def test_scan_inf_exits_1_with_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = {"fc.weight": torch.tensor([[1.0, float("inf")], [65520.0, 2.0]])}
    path = save(state, tmp_path / "bad.pt")
    assert main(["scan", str(path), "--format", "json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] == "overflow" and data["exit_code"] == 1
    assert data["schema_version"] == SCAN_SCHEMA_VERSION == "1.2"
    report = ScanReport.from_dict(data)
    assert report.tensor("fc.weight").stats.posinf_count == 1
    assert {f.kind for f in report.errors()} == {"nonfinite", "beyond_range"}


def test_scan_markdown_to_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    path = healthy(ckpt_dir / "model.pt")
    out_file = tmp_path / "report.md"
    assert main(["scan", str(path), "--format", "markdown", "-o", str(out_file)]) == 0
    assert capsys.readouterr().out == ""
    assert out_file.read_text().startswith("## ampdoctor scan: healthy\n\n")
    assert [p.name for p in ckpt_dir.iterdir()] == ["model.pt"]


def test_scan_refuses_to_write_over_the_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = healthy(tmp_path / "model.pt")
    before = fingerprint(tmp_path)
    assert main(["scan", str(path), "-o", str(path)]) == 2
    assert "never writes over an input" in one_error_line(capsys.readouterr().err)
    assert fingerprint(tmp_path) == before


def test_scan_training_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = opt.state_dict()
    state["state"][0]["exp_avg_sq"].fill_(float("nan"))
    scaler = {"scale": 2.0**-20, "_growth_tracker": 0, "growth_factor": 2.0, "backoff_factor": 0.5}
    path = save({"model": model.state_dict(), "optimizer": state, "scaler": scaler}, tmp_path / "train.pt")
    assert main(["scan", str(path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("ampdoctor scan: OVERFLOW")
    assert "exp_avg_sq" in out and "persistent overflow" in out and "2**-20" in out


def test_scan_allow_global(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = save(
        {"weight": torch.ones(3), "rng": np.random.RandomState(0).get_state(), "args": argparse.Namespace(lr=0.1)},
        tmp_path / "rng_state.pth",
    )
    before = fingerprint(tmp_path)
    assert main(["scan", str(path)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "argparse.Namespace" in line and "numpy" in line
    allow = line.split("--allow-global ", 1)[1].split(" ", 1)[0]  # the exact list the message offers
    assert main(["scan", str(path), "--allow-global", allow]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("ampdoctor scan: HEALTHY") and err == ""
    assert fingerprint(tmp_path) == before


def test_scan_unsafe_load_warns_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = save({"weight": torch.ones(3), "args": argparse.Namespace(lr=0.1)}, tmp_path / "hp.pt")
    assert main(["scan", str(path), "--unsafe-load"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("ampdoctor: warning: --unsafe-load") and len(err.strip().splitlines()) == 1


class _Hostile:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.mkdir, (str(self.marker),))


def test_scan_malicious_pickle_refused_without_running(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "code-ran"
    path = save({"weight": torch.ones(2), "x": _Hostile(marker)}, tmp_path / "evil.pt")
    assert main(["scan", str(path)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "mkdir" in line and "malicious" in line
    assert not marker.exists()


def test_scan_sharded_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(3):
        save({f"layers.{i}.weight": torch.full((2, 2), 1e-9 if i == 1 else 1.0)}, shards / f"part-{i}.pt")
    before = fingerprint(shards)
    assert main(["scan", str(shards), "--format", "json"]) == 1  # shard 1 flushes to zero in float16
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] == "underflow" and [f["name"] for f in data["files"]] == [f"part-{i}.pt" for i in range(3)]
    assert fingerprint(shards) == before


def test_scan_safetensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file({"w": torch.tensor([1.0, float("nan")])}, str(path))
    assert main(["scan", str(path)]) == 1
    assert capsys.readouterr().out.startswith("ampdoctor scan: NAN")


def _bad_input(tmp_path: Path, case: str) -> Path:
    good = healthy(tmp_path / "good.pt")
    path = tmp_path / case
    if case == "empty_dir":
        path.mkdir()
    elif case == "truncated.pt":
        path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif case == "corrupt.pt":
        path.write_bytes(b"\x80\x02\xb3" + bytes(range(256)) * 4)  # a pickle header, then garbage
    elif case == "notes.txt":
        path.write_text("this is not a checkpoint\n")
    elif case == "no_tensors.pt":
        save({"epoch": 3}, path)
    elif case == "truncated.safetensors":
        pytest.importorskip("safetensors")
        path.write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"w":')
    return path


@pytest.mark.parametrize(
    "case",
    ["missing.pt", "empty_dir", "truncated.pt", "corrupt.pt", "notes.txt", "no_tensors.pt", "truncated.safetensors"],
)
def test_scan_bad_input_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    path = _bad_input(tmp_path, case)
    assert main(["scan", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and str(path) in one_error_line(err)


def test_debug_shows_the_traceback_and_keeps_the_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.pt"
    assert main(["--debug", "scan", str(missing)]) == 2  # it used to re-raise: exit 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert "ampdoctor.errors.InvalidInput" in err
    assert err.splitlines()[-1] == f"ampdoctor: error: {missing}: no such file or directory"


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], ["scan", "--help"], ["diagnose", "--help"]):
        assert main(argv) == 0
    out = capsys.readouterr().out
    assert "scan" in out and "MODULE:FACTORY" in out and "--allow-global" in out


# -- diagnose ------------------------------------------------------------------------------------------------


@pytest.fixture()
def demo_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """The demo transformer's weights in a training checkpoint (as if saved from cuda:0, by DDP, with a
    GradScaler at 1024), and its token batch."""
    model, tokens, _ = make_demo()
    ckpt_dir = tmp_path / "run"
    ckpt_dir.mkdir()
    state = {f"module.{k}": v for k, v in model.state_dict().items()}
    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        save({"model": state, "scaler": {"scale": 1024.0, "_growth_tracker": 12}}, ckpt_dir / "ckpt.pt")
    return {"ckpt": ckpt_dir / "ckpt.pt", "dir": ckpt_dir, "batch": save(tokens, tmp_path / "tokens.pt")}


def test_diagnose_names_the_same_origin_as_the_python_api(
    demo_files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model, tokens, _ = make_demo()
    api = ampdoctor.diagnose(model, tokens, scale=1024.0)
    assert api.forward_origin is not None and api.forward_origin.module == DEMO_ORIGIN
    before = fingerprint(demo_files["dir"])
    argv = ["diagnose", str(demo_files["ckpt"]), "--model", DEMO_FACTORY, "--batch", str(demo_files["batch"])]
    assert main([*argv, "--format", "json"]) == 1  # an overflow is a finding
    report = Report.from_json(capsys.readouterr().out)
    assert report.forward_origin is not None
    assert (report.forward_origin.module, report.forward_origin.call) == (DEMO_ORIGIN, 0)
    assert report.forward_origin.label == api.forward_origin.label
    assert report.verdict == api.verdict
    # The loss scale came from the checkpoint's GradScaler; the CUDA-saved weights are noted.
    assert report.run.scale == 1024.0 and "GradScaler" in report.run.scale_source
    assert any("saved from cuda:0" in note for note in report.run.notes)
    assert fingerprint(demo_files["dir"]) == before


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--model", "no_such_package_xyz.models:build"], "cannot import no_such_package_xyz.models"),
        (["--model", "ampdoctor.demo:NoSuchFactory"], "has no attribute 'NoSuchFactory'"),
        (["--model", DEMO_FACTORY, "--model-kwargs", "{width: 16}"], "is not JSON"),
        (["--model", DEMO_FACTORY, "--model-kwargs", '{"width": 16}'], "shape mismatch"),
        (["--model", "torch.nn:Linear", "--model-kwargs", '{"in_features": 2, "out_features": 2}'], "missing: bias"),
        (["--input-shape", "4x16"], "fits what the model expects"),  # float input into an embedding
        (["--input-shape", "4xsixteen"], "write positive sizes"),
    ],
)
def test_diagnose_bad_input_exits_2_with_one_line(
    demo_files: dict[str, Path], capsys: pytest.CaptureFixture[str], extra: list[str], expected: str
) -> None:
    argv = ["diagnose", str(demo_files["ckpt"])]
    if "--model" not in extra:
        argv += ["--model", DEMO_FACTORY]
    if "--input-shape" not in extra:
        argv += ["--batch", str(demo_files["batch"])]
    before = fingerprint(demo_files["dir"])
    assert main([*argv, *extra]) == 2
    out, err = capsys.readouterr()
    assert out == "" and expected in one_error_line(err)
    assert fingerprint(demo_files["dir"]) == before


def test_diagnose_batch_that_does_not_fit(
    demo_files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wrong = save(torch.randn(2, 5), tmp_path / "wrong.pt")
    argv = ["diagnose", str(demo_files["ckpt"]), "--model", DEMO_FACTORY, "--batch", str(wrong)]
    assert main(argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "forward raised" in line and f"--batch {wrong}" in line


@pytest.mark.parametrize("case", ["missing.pt", "empty_dir", "truncated.pt", "corrupt.pt", "notes.txt"])
def test_diagnose_bad_checkpoint_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    path = _bad_input(tmp_path, case)
    argv = ["diagnose", str(path), "--model", DEMO_FACTORY, "--input-shape", "2x4", "--input-dtype", "int64"]
    assert main(argv) == 2
    assert str(path) in one_error_line(capsys.readouterr().err)


def test_diagnose_missing_batch_file(demo_files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["diagnose", str(demo_files["ckpt"]), "--model", DEMO_FACTORY, "--batch", "nope.npy"]
    assert main(argv) == 2
    assert "--batch nope.npy: no such file" in one_error_line(capsys.readouterr().err)


def test_progress_only_when_stderr_is_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(2):
        save({f"layers.{i}.weight": torch.ones(2)}, shards / f"part-{i}.pt")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["scan", str(shards)]) == 0
    err = capsys.readouterr().err
    assert "ampdoctor: reading 0/2" in err and "part-0.pt" in err and "part-1.pt" in err
    assert main(["scan", str(shards), "--quiet"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the emulation is what a machine without CUDA gets")
def test_diagnose_device_cuda_without_cuda_follows_cudas_policy(
    demo_files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["diagnose", str(demo_files["ckpt"]), "--model", DEMO_FACTORY, "--batch", str(demo_files["batch"])]
    assert main([*argv, "--device", "cuda", "--format", "json"]) == 1  # the demo's attention overflows on CUDA too
    data = json.loads(capsys.readouterr().out)
    assert data["run"]["policy"] == "cuda_emulated" and data["run"]["device_type"] == "cuda"
    assert data["findings"]["forward_origin"]["module"] == "blocks.1.attn"
    assert data["findings"]["forward_origin"]["policy_note"] == ""


def test_review_fixes_wrapper_names_partial_loads_and_bad_inputs(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import torch
    from torch import nn

    from ampdoctor.checkpoint.load_weights import load_weights

    class Wrap(nn.Module):  # a real submodule called "module" (EMA wrappers have one)
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)
            self.head = nn.Linear(2, 1)

    source = Wrap()
    torch.save(source.state_dict(), tmp_path / "wrap.pt")
    target = Wrap()
    load_weights(target, tmp_path / "wrap.pt")
    assert torch.equal(target.module.weight, source.module.weight)

    # a sharded checkpoint whose second shard does not fit leaves the model untouched
    shards = tmp_path / "shards"
    shards.mkdir()
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save({"0.weight": torch.full((3, 3), 100.0), "0.bias": torch.zeros(3)}, shards / "a.pt")
    torch.save({"1.weight": torch.zeros(4, 4), "1.bias": torch.zeros(3)}, shards / "b.pt")
    with pytest.raises(ampdoctor.AmpDoctorError, match="shape mismatch"):
        load_weights(model, shards)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    # bad --input-dtype / --input-shape: one line, exit 2
    ckpt = tmp_path / "demo.pt"
    torch.save(make_demo()[0].state_dict(), ckpt)
    for extra in (["--input-dtype", "complex64"], ["--input-dtype", "uint8"]):
        assert main(["diagnose", str(ckpt), "--model", "ampdoctor.demo:DemoTransformer", "--input-shape", "2x8",
                     *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("ampdoctor: error: ") and err.count("\n") == 1  # never a traceback
    assert main(["diagnose", str(ckpt), "--model", "ampdoctor.demo:DemoTransformer", "--input-shape", "2x8",
                 "--input-dtype", "complex64"]) == 2
    assert "--input-dtype 'complex64' is not a real" in capsys.readouterr().err


@pytest.mark.parametrize("choice", ["auto", "always", "never"])
def test_diagnose_passes_underflow_reference_through(
    demo_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], choice: str
) -> None:
    import ampdoctor.api

    seen: dict[str, object] = {}
    real = ampdoctor.api.diagnose

    def spy(*args: object, **kwargs: object) -> Report:
        seen.update(kwargs)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ampdoctor.api, "diagnose", spy)  # the command imports it when it runs
    argv = ["diagnose", str(demo_files["ckpt"]), "--model", DEMO_FACTORY, "--batch", str(demo_files["batch"])]
    assert main([*argv, "--underflow-reference", choice, "--format", "json"]) == 1
    assert seen["underflow_reference"] == choice
    capsys.readouterr()


def test_diagnose_rejects_an_unknown_underflow_reference(
    demo_files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["diagnose", str(demo_files["ckpt"]), "--model", DEMO_FACTORY, "--underflow-reference", "sometimes"]
    assert main(argv) == 2
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err
