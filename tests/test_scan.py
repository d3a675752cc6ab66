"""``ampdoctor.scan`` on checkpoints written here: the Python API, the records and their JSON round trip.

Each checkpoint carries its expected answer; the arithmetic is in the comments. All files live in tmp_path.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.checkpoint import safe_load
from ampdoctor.checkpoint import scan as scan_module
from ampdoctor.checkpoint.load_weights import load_weights
from ampdoctor.checkpoint.safe_load import UnsafeLoadWarning
from ampdoctor.checkpoint.scan import scan
from ampdoctor.errors import AmpDoctorError, CheckpointRefused
from ampdoctor.records.scan import SCAN_SCHEMA_VERSION, ScanFinding, StorageFormat
from ampdoctor.report.scan_report import ScanReport
from ampdoctor.report.scan_text import finding_message, finding_title

# -- checkpoints ---------------------------------------------------------------------------------------------


def small_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def save(obj: Any, path: Path) -> Path:
    torch.save(obj, path)
    return path


def training_checkpoint(state_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """One Adam step on the small model, then: exp_avg_sq[0][0, 0] = NaN and a GradScaler collapsed to 2**-14."""
    model = small_model()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt_state = opt.state_dict()
    for per_param in opt_state["state"].values():
        for key in ("exp_avg", "exp_avg_sq"):
            per_param[key] = per_param[key].to(state_dtype)
    opt_state["state"][0]["exp_avg_sq"][0, 0] = float("nan")
    scaler = torch.amp.GradScaler("cpu").state_dict()
    scaler["scale"] = 2.0**-14  # 30 backoffs from 2**16: every one of those steps had inf/NaN gradients
    return {"model": model.state_dict(), "optimizer": opt_state, "scaler": scaler, "epoch": 7}


def kinds(report: ScanReport, severity: str = "error") -> set[str]:
    return {f.kind for f in report.findings if f.severity == severity}


# -- healthy, inf, range -------------------------------------------------------------------------------------


def test_healthy_state_dict(tmp_path: Path) -> None:
    model = small_model()
    report = scan(save(model.state_dict(), tmp_path / "healthy.pt"))
    assert report.verdict == "healthy" and report.exit_code == 0
    assert not report.errors()
    assert [t.name for t in report.tensors] == list(model.state_dict())
    weight = report.tensor("0.weight")
    assert weight.stats.abs_max == pytest.approx(float(model.state_dict()["0.weight"].abs().max()))
    assert weight.saved_on == "cpu" and weight.role == "weights"
    assert report.saved_on == {"cpu": 4} and not report.saved_from_cuda
    assert [m.module for m in report.by_module()] == ["0", "2"]
    text = str(report)
    assert text.splitlines()[0] == "ampdoctor scan: HEALTHY - no inf/NaN, nothing out of range"


@pytest.mark.parametrize(
    ("value", "verdict"),
    [(float("inf"), "overflow"), (float("-inf"), "overflow"), (float("nan"), "nan")],
)
def test_non_finite_weights(tmp_path: Path, value: float, verdict: str) -> None:
    state = small_model().state_dict()
    state["2.weight"][1, 3] = value
    report = scan(save(state, tmp_path / "bad.pt"))
    assert report.verdict == verdict and report.exit_code == 1
    (finding,) = [f for f in report.errors() if f.kind == "nonfinite"]
    assert finding.tensors == ("2.weight",)
    assert str(report).splitlines()[0] == "ampdoctor scan: " + verdict.upper() + " - 1 weight tensor(s) hold inf/NaN"
    summary = {m.module: m for m in report.by_module()}["2"]
    assert summary.nan_count + summary.inf_count == 1


def _sparse_coo(values: torch.Tensor) -> torch.Tensor:
    return torch.sparse_coo_tensor(torch.tensor([[0, 3]]), values, (8,))


@pytest.mark.parametrize(
    ("stored", "how"),
    [
        (lambda v: _sparse_coo(v), "1 sparse tensor(s) measured through their stored values"),
        (lambda v: _sparse_coo(v).to_dense().reshape(2, 4).to_sparse_csr(), "1 sparse tensor(s) measured through"),
        (lambda v: torch.complex(torch.zeros(2), v), "1 complex tensor(s) measured through their real and imaginary"),
        (lambda v: _sparse_coo(torch.complex(v, v)), "1 sparse tensor(s) measured through their stored values"),
    ],
)  # fmt: skip
def test_nan_stored_in_a_sparse_or_complex_tensor_is_found(tmp_path: Path, stored: Any, how: str) -> None:
    """They were left unmeasured with no note, and such a checkpoint read HEALTHY (exit 0)."""
    state = small_model().state_dict()
    state["extra"] = stored(torch.tensor([1.0, float("nan")]))
    report = scan(save(state, tmp_path / "odd.pt"))
    assert report.verdict == "nan" and report.exit_code == 1
    (finding,) = [f for f in report.errors() if f.kind == "nonfinite"]
    assert finding.tensors == ("extra",)
    assert any(how in note for note in report.notes)
    healthy = small_model().state_dict()
    healthy["extra"] = stored(torch.tensor([1.0, 2.0]))
    assert scan(save(healthy, tmp_path / "fine.pt")).verdict == "healthy"


def test_quantized_values_are_measured_and_a_meta_tensor_is_noted(tmp_path: Path) -> None:
    state = small_model().state_dict()
    state["q"] = torch.quantize_per_tensor(torch.tensor([1.0, 2.0e6]), 1000.0, 0, torch.qint32)  # 2e6 > 65504
    state["m"] = torch.empty(3, device="meta")
    report = scan(save(state, tmp_path / "q.pt"))
    assert report.verdict == "overflow"
    assert {f.kind for f in report.errors()} == {"beyond_range"}
    assert any("1 quantized tensor(s) measured through their dequantized float32 values" in n for n in report.notes)
    assert any("m (float32) not measured: it is on the meta device and holds no values" in n for n in report.notes)


def test_beyond_fp16_counts_only_values_that_round_to_inf(tmp_path: Path) -> None:
    # float16: 65504 is the max; 65519 rounds down to 65504; from 65520 (half an ulp above) values round to inf.
    values = torch.tensor([65504.0, 65519.0, 65519.99, 65520.0, -65520.0, 1e6, 1.0])
    report = scan(save({"layer.weight": values}, tmp_path / "range.pt"))
    t = report.tensor("layer.weight")
    assert t.stats.cast_overflow_count == 3  # 65520, -65520, 1e6
    assert t.bf16_overflow_count == 0  # bfloat16 has float32's range
    assert report.verdict == "overflow"
    (finding,) = [f for f in report.errors() if f.kind == "beyond_range"]
    assert finding.count == 3 and finding.worst == "layer.weight" and finding.worst_value == 1e6
    assert finding_title(finding, report) == "3 weight value(s) beyond the float16 range (|x| >= 65520)"
    # The same checkpoint is fine for bfloat16.
    assert scan(tmp_path / "range.pt", dtype="bfloat16").verdict == "healthy"


def test_values_that_round_to_max_are_not_counted(tmp_path: Path) -> None:
    report = scan(save({"w": torch.tensor([65504.0, 65519.0, -65519.0])}, tmp_path / "edge.pt"))
    assert report.tensor("w").stats.cast_overflow_count == 0
    assert report.verdict == "healthy" and report.exit_code == 0
    assert "thin_headroom" in kinds(report, "warning")  # log2(65504 / 65519) < 1 bit


def test_tiny_weights_flush_to_zero(tmp_path: Path) -> None:
    # float16's smallest subnormal is 2**-24; 2**-25 is exactly half of it and rounds (to even) to 0.
    tiny = [2.0**-25, -(2.0**-25), 1e-9, 2.0**-26]  # all flush to 0 in float16, none in bfloat16
    kept = [2.0**-24, 2.0**-25 * 1.01, 1.0, 0.0]  # stay nonzero (0.0 is no loss)
    report = scan(save({"emb.weight": torch.tensor(tiny + kept)}, tmp_path / "tiny.pt"))
    t = report.tensor("emb.weight")
    assert t.stats.cast_flush_count == 4 and t.bf16_flush_count == 0
    # 4 of the 7 nonzero values flush: far above the 5 % underflow share.
    assert report.verdict == "underflow" and report.exit_code == 1
    assert "flush_to_zero" in kinds(report)
    assert scan(tmp_path / "tiny.pt", dtype="bfloat16").verdict == "healthy"


def test_few_flushed_values_are_a_warning(tmp_path: Path) -> None:
    values = torch.ones(100)
    values[0] = 1e-9  # 1 of 100 nonzero values: under the 5 % share
    report = scan(save({"w": values}, tmp_path / "few.pt"))
    assert report.verdict == "healthy"
    assert "flush_to_zero" in kinds(report, "warning")


# -- training checkpoints ------------------------------------------------------------------------------------


def test_training_checkpoint_collapsed_scaler_and_nan_optimizer_state(tmp_path: Path) -> None:
    report = scan(save(training_checkpoint(), tmp_path / "train.pt"))
    assert report.verdict == "overflow" and report.exit_code == 1
    assert {"scaler_collapsed", "optimizer_nonfinite"} <= kinds(report)
    (scaler,) = report.scalers
    assert scaler.path == "scaler" and scaler.scale == 2.0**-14 and scaler.collapsed
    assert scaler.growth_tracker == 0
    (opt,) = report.optimizers
    assert opt.path == "optimizer" and opt.states == 4 and opt.eps == (1e-8,) and opt.state_dtypes == ("float32",)
    bad = report.tensor("optimizer.state.0.exp_avg_sq")
    assert bad.role == "optimizer" and bad.stats.nan_count == 1
    nonfinite = next(f for f in report.errors() if f.kind == "optimizer_nonfinite")
    assert nonfinite.tensors == ("optimizer.state.0.exp_avg_sq",) and nonfinite.verdict == "nan"
    assert finding_title(nonfinite, report) == "Adam's second moment (exp_avg_sq) is non-finite for 1 parameter(s)"
    collapsed = next(f for f in report.errors() if f.kind == "scaler_collapsed")
    assert (collapsed.scale, collapsed.growth_tracker, collapsed.tensors) == (2.0**-14, 0, ("scaler",))
    assert finding_title(collapsed, report) == "GradScaler scale collapsed to 6.104e-05 (2**-14): persistent overflow"
    assert "non-finite even unscaled" in finding_message(collapsed, report)
    # eps 1e-8 is below float16's 2**-25 flush edge, but the state is float32, which autocast never runs in
    # float16: no finding at all (it used to be a note on every healthy Adam checkpoint).
    assert not [f for f in report.findings if f.kind == "eps_zero"]
    # Weights are grouped per module; optimizer state is kept out of the module table.
    assert [m.module for m in report.by_module()] == ["model.0", "model.2"]
    text = str(report)
    assert text.startswith("ampdoctor scan: OVERFLOW")
    assert "GradScaler state" in text and "collapsed (persistent overflow)" in text


def test_float16_optimizer_state_with_zero_eps_is_an_error(tmp_path: Path) -> None:
    ckpt = training_checkpoint(state_dtype=torch.float16)
    ckpt["optimizer"]["state"][0]["exp_avg_sq"][0, 0] = 0.0  # keep the NaN out: test eps alone
    del ckpt["scaler"]
    report = scan(save(ckpt, tmp_path / "half.pt"))
    eps = next(f for f in report.errors() if f.kind == "eps_zero")
    assert eps.verdict == "nan" and eps.eps == (1e-8,) and "1.000e-08" in finding_title(eps, report)
    assert "optimizer_fp16_state" in kinds(report, "warning")


def test_low_but_not_collapsed_scale_is_a_warning(tmp_path: Path) -> None:
    scaler = torch.amp.GradScaler("cpu").state_dict()
    scaler["scale"] = 4.0
    report = scan(save({"model": small_model().state_dict(), "scaler": scaler}, tmp_path / "low.pt"))
    assert report.verdict == "healthy" and "scaler_low" in kinds(report, "warning")


# -- refusals and safety -------------------------------------------------------------------------------------


def numpy_checkpoint(path: Path) -> Path:
    """What Hugging Face (rng_state.pth) and Lightning (hyper-parameters) write besides tensors."""
    return save(
        {
            "model": small_model().state_dict(),
            "rng": np.random.RandomState(0).get_state(),
            "hparams": argparse.Namespace(lr=1e-3, depth=2),
            "curve": np.linspace(0, 1, 5, dtype=np.float32),
        },
        path,
    )


def test_numpy_and_namespace_refused_with_globals_named_then_allowed(tmp_path: Path) -> None:
    path = numpy_checkpoint(tmp_path / "rng.pt")
    with pytest.raises(CheckpointRefused) as info:
        scan(path)
    blocking = info.value.blocking
    assert "argparse.Namespace" in blocking
    assert any(name.startswith("numpy") and name.endswith("_reconstruct") for name in blocking)
    assert "--allow-global" in str(info.value) and "\n" not in str(info.value)
    report = scan(path, allow_globals=blocking)
    assert report.verdict == "healthy"
    assert report.tensor("curve").stats.abs_max == 1.0  # float numpy arrays are measured too


def test_unsafe_load_warns(tmp_path: Path) -> None:
    path = numpy_checkpoint(tmp_path / "rng.pt")
    with pytest.warns(UnsafeLoadWarning):
        report = scan(path, unsafe_load=True)
    assert report.verdict == "healthy"


class _Hostile:
    """Unpickling this would create a directory: the marker proves whether its code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.mkdir, (str(self.marker),))


def test_malicious_pickle_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = save({"weight": torch.ones(2), "payload": _Hostile(marker)}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointRefused) as info:
        scan(path)
    assert not marker.exists()
    assert any(name.endswith(".mkdir") for name in info.value.blocking)
    assert "malicious" in str(info.value)


# -- shards, safetensors, devices ----------------------------------------------------------------------------


def write_shards(directory: Path, count: int = 3) -> dict[str, torch.Tensor]:
    directory.mkdir()
    state = {}
    for i in range(count):
        shard = {f"layers.{i}.weight": torch.full((4, 4), float(i + 1))}
        torch.save(shard, directory / f"model-{i + 1:05d}-of-{count:05d}.bin")
        state.update(shard)
    (directory / "config.json").write_text("{}")  # not a checkpoint file: left alone
    return state


def test_sharded_directory_loads_one_shard_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_shards(tmp_path / "shards")
    real_load = safe_load.load_file
    alive: list[weakref.ref[torch.Tensor]] = []
    loaded_names: list[str] = []

    def watched_load(path: Path, *args: Any, **kwargs: Any) -> safe_load.LoadedFile:
        # Every tensor of the previous shard must be gone before the next shard is opened.
        assert all(ref() is None for ref in alive), "a previous shard is still in memory"
        loaded = real_load(path, *args, **kwargs)
        alive[:] = [weakref.ref(t) for t in loaded.obj.values()]
        loaded_names.append(path.name)
        return loaded

    monkeypatch.setattr(scan_module, "load_file", watched_load)
    report = scan(tmp_path / "shards")
    assert loaded_names == [f"model-0000{i}-of-00003.bin" for i in (1, 2, 3)]
    assert [f.name for f in report.files] == loaded_names and all(f.memory_mapped for f in report.files)
    assert [m.abs_max for m in report.by_module()] == [1.0, 2.0, 3.0]
    assert report.verdict == "healthy"


def test_directory_skips_refused_and_tensorless_files(tmp_path: Path) -> None:
    # A Hugging Face Trainer checkpoint directory: shards, rng_state.pth (numpy), scheduler.pt (no tensors).
    write_shards(tmp_path / "run")
    numpy_checkpoint(tmp_path / "run" / "rng_state.pth")
    save({"last_epoch": 3, "_step_count": 4, "base_lrs": [0.1]}, tmp_path / "run" / "scheduler.pt")
    report = scan(tmp_path / "run")
    assert report.verdict == "healthy" and report.exit_code == 0
    skipped = {f.name: f for f in report.files if f.skipped}
    assert set(skipped) == {"rng_state.pth", "scheduler.pt"}
    assert "argparse.Namespace" in skipped["rng_state.pth"].refused and not skipped["scheduler.pt"].refused
    assert "refused_file" in kinds(report, "warning") and "no_tensors" in kinds(report, "note")


def test_directory_with_only_refused_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    numpy_checkpoint(tmp_path / "run" / "rng_state.pth")
    with pytest.raises(CheckpointRefused, match="argparse.Namespace"):
        scan(tmp_path / "run")


def test_safetensors(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(
        {"a.weight": torch.tensor([1.0, float("inf")]), "b.weight": torch.tensor([1e-9, 1.0], dtype=torch.bfloat16)},
        str(path),
    )
    report = scan(path)
    assert report.files[0].format == "safetensors"
    assert report.tensor("a.weight").stats.posinf_count == 1
    b = report.tensor("b.weight")
    assert b.stats.dtype == "bfloat16" and b.stats.cast_flush_count == 1
    assert report.verdict == "overflow"


def test_records_whether_tensors_were_saved_from_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The storage location is written in the file; pretend the tensors lived on cuda:0 when saved.
    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        path = save(small_model().state_dict(), tmp_path / "cuda.pt")
    report = scan(path)
    assert report.saved_from_cuda and report.saved_on == {"cuda:0": 4}
    assert report.tensor("0.weight").saved_on == "cuda:0"
    assert not report.findings  # where tensors were saved is a fact of the report, not a note
    assert "Saved on: cuda:0 (4 tensors)" in str(report)


# -- records, JSON, API --------------------------------------------------------------------------------------


def test_json_round_trip_and_schema_version(tmp_path: Path) -> None:
    report = scan(save(training_checkpoint(), tmp_path / "train.pt"))
    data = json.loads(report.to_json())
    assert data["schema_version"] == SCAN_SCHEMA_VERSION
    assert data["verdict"] == "overflow" and data["kind"] == "ampdoctor.scan"
    assert {m["module"] for m in data["modules"]} == {"model.0", "model.2"}
    again = ScanReport.from_json(report.to_json())
    assert again.to_dict() == report.to_dict()  # NaN statistics: compare the encoded form
    assert again.to_text() == report.to_text()
    data["schema_version"] = "99.0"
    with pytest.raises(AmpDoctorError, match="newer"):
        ScanReport.from_dict(data)


def test_scan_is_a_top_level_name(tmp_path: Path) -> None:
    report = ampdoctor.scan(save({"w": torch.ones(3)}, tmp_path / "w.pt"))
    assert isinstance(report, ScanReport) and "scan" in ampdoctor.__all__


@pytest.mark.parametrize("case", ["missing", "empty_dir", "truncated", "empty_file", "text", "no_tensors"])
def test_bad_inputs_raise_one_line(tmp_path: Path, case: str) -> None:
    good = save(small_model().state_dict(), tmp_path / "good.pt")
    path = tmp_path / case
    if case == "empty_dir":
        path.mkdir()
    elif case == "truncated":
        path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    elif case == "empty_file":
        path.write_bytes(b"")
    elif case == "text":
        path.write_text("epoch,loss\n1,0.5\n")
    elif case == "no_tensors":
        save({"epoch": 3, "note": "no tensors here"}, path)
    with pytest.raises(AmpDoctorError) as info:
        scan(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message


def test_load_weights_from_training_checkpoint_with_ddp_prefix(tmp_path: Path) -> None:
    source = small_model()
    with torch.no_grad():
        source.state_dict()["0.weight"].add_(1.0)
    state = {f"module.{k}": v for k, v in source.state_dict().items()}  # saved from a DDP wrapper
    path = save({"model": state, "scaler": {"scale": 512.0, "_growth_tracker": 3}}, tmp_path / "ddp.pt")
    target = small_model()
    loaded = load_weights(target, path)
    assert torch.equal(target.state_dict()["0.weight"], source.state_dict()["0.weight"])
    assert loaded.tensors == 4 and loaded.scaler_scale == 512.0 and loaded.scaler_path == "scaler"


def test_load_weights_from_shards(tmp_path: Path) -> None:
    state = write_shards(tmp_path / "shards")
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(4, 4, bias=False) for _ in range(3))
    loaded = load_weights(model, tmp_path / "shards")
    assert loaded.tensors == 3 and len(loaded.files) == 3
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_load_weights_names_missing_unexpected_and_mismatched_keys(tmp_path: Path) -> None:
    state = small_model().state_dict()
    state["0.weight"] = torch.zeros(3, 8)  # shape mismatch
    del state["2.bias"]  # missing
    state["extra.weight"] = torch.zeros(1)  # unexpected
    path = save(state, tmp_path / "wrong.pt")
    with pytest.raises(AmpDoctorError) as info:
        load_weights(small_model(), path)
    message = str(info.value)
    assert "1 missing: 2.bias" in message
    assert "1 unexpected: extra.weight" in message
    assert "0.weight (checkpoint [3, 8], model [8, 8])" in message


def test_load_weights_accepts_a_tied_weight_stored_once(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied, as in most language models
    state = {"0.weight": torch.randn(10, 4)}  # "1.weight" is not stored
    loaded = load_weights(model, save(state, tmp_path / "tied.pt"))
    assert loaded.tensors == 1 and torch.equal(model.state_dict()["1.weight"], state["0.weight"])


def test_saved_scan_report_renders_without_torch(tmp_path: Path) -> None:
    import subprocess
    import sys

    saved = tmp_path / "scan.json"
    saved.write_text(scan(save(training_checkpoint(), tmp_path / "train.pt")).to_json())
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any import of torch now fails
        "from ampdoctor.report.scan_report import ScanReport\n"
        f"print(ScanReport.from_json(open({str(saved)!r}).read()).to_text().splitlines()[0])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.startswith("ampdoctor scan: OVERFLOW")


# -- float8 checkpoints: judged against their own format ---------------------------------------------------------


def test_float8_e4m3fn_is_read_and_judged_against_its_own_max(tmp_path: Path) -> None:
    # e4m3fn: max 448, no inf. 3 of the 8 values sit at +-448 (clipped when quantized): 37.5 % >= 1 %.
    values = torch.tensor([0.5, 1.0, 448.0, -448.0, 448.0, 2.0, 0.0, 3.0]).to(torch.float8_e4m3fn)
    report = scan(save({"q.weight": values, "b.bias": torch.ones(2)}, tmp_path / "fp8.pt"))
    t = report.tensor("q.weight")
    assert t.stats.dtype == "float8_e4m3fn" and t.stats.numel == 8
    assert (t.stats.abs_max, t.at_max_count, t.stats.zero_count) == (448.0, 3, 1)
    assert t.stats.cast_overflow_count == 0 and t.bf16_flush_count == 0  # float8 values always fit float16
    assert report.storage_formats == (StorageFormat("float8_e4m3fn", 448.0, 2.0**-6, has_inf=False),)
    assert report.headroom(t) == 0.0  # against 448, not against float16's 65504
    assert report.verdict == "healthy"
    (saturated,) = report.findings
    assert (saturated.kind, saturated.severity, saturated.count, saturated.worst) == (
        "float8_saturated",
        "warning",
        3,
        "q.weight",
    )
    assert saturated.worst_value == pytest.approx(3 / 8)
    assert finding_title(saturated, report) == "3 float8 value(s) sit at their format's max (float8_e4m3fn max 448)"
    assert "1 tensor(s) stored in float8_e4m3fn: judged against its own max 448 (no inf" in str(report)


def test_float8_nan_and_inf_are_findings(tmp_path: Path) -> None:
    nan8 = torch.tensor([1.0, float("nan"), 2.0]).to(torch.float8_e4m3fn)  # e4m3fn's only non-finite value
    inf8 = torch.tensor([1.0, float("-inf")]).to(torch.float8_e5m2)  # e5m2 has inf
    report = scan(save({"a.weight": nan8}, tmp_path / "nan8.pt"))
    assert report.verdict == "nan" and report.tensor("a.weight").stats.nan_count == 1
    message = finding_message(report.errors()[0], report)
    assert message.startswith("a.weight (float8_e4m3fn): 1 NaN of 3 values; float8_e4m3fn has no inf")
    report = scan(save({"b.weight": inf8}, tmp_path / "inf8.pt"))
    assert report.verdict == "overflow" and report.tensor("b.weight").stats.neginf_count == 1
    assert report.storage_format("float8_e5m2") == StorageFormat("float8_e5m2", 57344.0, 2.0**-14, has_inf=True)


def test_float8_safetensors(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = tmp_path / "fp8.safetensors"
    safetensors_torch.save_file({"w": torch.tensor([1.0, -2.0, 0.25]).to(torch.float8_e5m2)}, str(path))
    report = scan(path)
    assert report.tensor("w").stats.dtype == "float8_e5m2" and report.tensor("w").stats.abs_max == 2.0
    assert report.verdict == "healthy" and not report.findings


# -- notes only when they matter ---------------------------------------------------------------------------------


def test_a_healthy_adam_checkpoint_has_no_notes(tmp_path: Path) -> None:
    # Twenty Adam steps with small gradients: exp_avg_sq holds values below float16's subnormals, and eps 1e-8 is 0
    # in float16. Both used to be notes on every such checkpoint; with float32 optimizer state neither matters.
    model = small_model()
    opt = torch.optim.Adam(model.parameters())
    for _ in range(20):
        opt.zero_grad()
        (model(torch.randn(4, 8)).sum() * 1e-3).backward()
        opt.step()
    scaler = torch.amp.GradScaler("cpu").state_dict()
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler}
    report = scan(save(ckpt, tmp_path / "adam.pt"))
    sq = [t for t in report.tensors if t.key == "exp_avg_sq"]
    assert sum(t.flush_count("float16") for t in sq) > 0  # the values a float16 optimizer would lose exist
    assert report.findings == () and report.notes == ()
    assert "Notes" not in str(report) and "Warnings" not in str(report)


# -- records: tuples, Literal names, data not prose, equality after JSON ------------------------------------------


def test_findings_carry_data_and_the_json_keeps_the_words(tmp_path: Path) -> None:
    state = {"fc.weight": torch.tensor([[1.0, float("inf")], [70000.0, 2.0]]), "fc.bias": torch.ones(2)}
    report = scan(save(state, tmp_path / "bad.pt"))
    fields = {f.name for f in dataclasses.fields(ScanFinding)}
    assert not fields & {"title", "message"}  # analysis writes no prose
    nonfinite, beyond = report.errors()
    assert (nonfinite.kind, nonfinite.tensors, nonfinite.verdict, nonfinite.role) == (
        "nonfinite",
        ("fc.weight",),
        "overflow",
        "weights",
    )
    assert (beyond.kind, beyond.count, beyond.worst, beyond.worst_value) == ("beyond_range", 1, "fc.weight", 70000.0)
    data = json.loads(report.to_json())
    assert data["exit_code"] == 1 and data["verdict"] == "overflow"
    assert data["findings"][1]["title"] == "1 weight value(s) beyond the float16 range (|x| >= 65520)"
    assert data["findings"][1]["message"].startswith("they become inf when autocast casts them: fc.weight")


def test_a_report_equals_itself_after_a_json_round_trip_and_is_hashable(tmp_path: Path) -> None:
    ckpt = {
        "model": {"w": torch.tensor([1.0, float("inf"), float("nan")]), "q": torch.ones(4).to(torch.float8_e4m3fn)},
        "optimizer": training_checkpoint()["optimizer"],  # NaN in exp_avg_sq
        "scaler": {"scale": 0.5, "_growth_tracker": 0},
    }
    report = scan(save(ckpt, tmp_path / "r.pt"))
    assert report.verdict == "overflow" and report.tensor("model.w").stats.nan_count == 1
    again = ScanReport.from_json(report.to_json())
    assert again == report and hash(again) == hash(report)
    assert isinstance(again.findings, tuple) and isinstance(again.tensors[0].stats.shape, tuple)
    assert again.files[0].saved_on == {"cpu": report.files[0].tensors}
    assert again.to_markdown() == report.to_markdown()
    data = json.loads(report.to_json())
    data["findings"][0]["kind"] = "no_such_kind"  # Literal names are checked on the way in
    with pytest.raises(AmpDoctorError, match="malformed ampdoctor scan report: 'no_such_kind' is not one of"):
        ScanReport.from_dict(data)


# -- markdown ----------------------------------------------------------------------------------------------------


def test_markdown_is_real_markdown(tmp_path: Path) -> None:
    report = scan(save(training_checkpoint(), tmp_path / "train.pt"))
    md = report.to_markdown()
    lines = md.splitlines()
    assert lines[0] == "## ampdoctor scan: overflow" and "```text" not in md
    assert "### Findings" in lines and "### GradScaler state" in lines and "### Modules (worst first, 2 shown)" in lines
    header = lines.index(
        "| module | tensors | values | NaN | inf | >float16 max | flush fp16 | flush bf16 | \\|x\\|max "
        "| headroom bits |"
    )
    assert lines[header + 1] == "|---|---|---|---|---|---|---|---|---|---|"
    assert lines[header + 2].startswith("| `model.2` | 2 | 18 | 0 | 0 | 0 | 0 | 0 |")  # worst (least headroom) first
    assert "| `optimizer.state.0.exp_avg_sq` | float32 | 8x8 | 1 |" in md
    assert "1. **GradScaler scale collapsed to 6.104e-05 (2\\*\\*-14): persistent overflow**  " in lines
    assert lines[-3:] == [
        "```bash",
        f"ampdoctor diagnose {tmp_path / 'train.pt'} --model MODULE:FACTORY --input-shape SHAPE   # where the first "
        "inf/NaN is made",
        "```",
    ]
    cells = [len(re.findall(r"(?<!\\)\|", line)) for line in lines[header : header + 4]]
    assert cells == [11, 11, 11, 11]  # every row of the table has the header's 10 cells


def test_a_file_that_references_one_list_twice_at_every_level_is_read_in_linear_time(tmp_path: Path) -> None:
    # a = [a, a] thirty levels deep: 1.7 KB on disk, 2**30 paths; walked naively it never finished.
    nested: Any = [torch.ones(2)]
    for _ in range(30):
        nested = [nested, nested]
    report = scan(save(nested, tmp_path / "dag.pt"))
    assert report.verdict == "healthy" and len(report.tensors) == 1


def _adam_state(tiny: float, poison: bool) -> dict[str, Any]:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), eps=1e-10)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    for state in opt.state.values():
        state["exp_avg_sq"].fill_(tiny)  # float32 moments below float16's flush threshold
    if poison:
        next(iter(opt.state.values()))["exp_avg"][0] = float("nan")
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def test_tiny_float32_optimizer_moments_are_not_listed_but_nan_in_them_is(tmp_path: Path) -> None:
    quiet = ampdoctor.scan(save(_adam_state(4e-11, poison=False), tmp_path / "adam.pt"))
    assert quiet.verdict == "healthy"
    assert "values the format cannot hold" not in quiet.to_text()  # autocast never casts optimizer state
    poisoned = ampdoctor.scan(save(_adam_state(4e-11, poison=True), tmp_path / "nan.pt"))
    assert poisoned.verdict == "nan"
    table = poisoned.to_text().split("values the format cannot hold", 1)[1]
    assert "optimizer.state.0.exp_avg " in table and "exp_avg_sq" not in table
