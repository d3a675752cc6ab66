"""``watch(..., log_to=...)``: the watch's scalars and forecasts reach a callable, TensorBoard event files (read back
with tensorboard's own reader) and a W&B run (offline, read back from its run file); bad targets are refused."""

from __future__ import annotations

import glob
import json
import math
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from torch import nn

import ampdoctor
from ampdoctor.errors import AmpDoctorError, InvalidInput
from ampdoctor.training.sinks import make_sink

FP16_MAX = 65504.0
GROWTH = 1.3
START = 2000.0  # the layer's |x|max at step 0: log2(65504 / 2000) = 5.03 bits of headroom
STEPS = 12  # the last one at 2000 * 1.3**11 = 35840: still finite (1.3**14 overflows)


def drift_loop(log_to: Any, steps: int = STEPS) -> tuple[ampdoctor.Watch, list[float]]:
    """One Linear (8 -> 8, weights 1): its output is 8 x the input, which grows 30 % a step from 250. Returns the
    watch and the scale after each step."""
    model = nn.Sequential(nn.Linear(8, 8, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scales = []
    with ampdoctor.watch(model, scaler, log_to=log_to, max_captures=0, save_bundle=False) as doctor:
        for step in range(steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.full((2, 8), START / 8 * GROWTH**step)).float().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
    return doctor, scales


def expected_headroom(step: int) -> float:
    value = float(torch.tensor(START * GROWTH**step, dtype=torch.float16))  # what float16 holds
    return math.log2(FP16_MAX / value)


def check_scalars(got: dict[str, dict[int, Any]], scales: list[float], doctor: ampdoctor.Watch) -> None:
    """Every step's loss scale, skips so far and headroom; the forecast named the layer once."""
    assert got["ampdoctor/loss_scale"] == dict(enumerate(scales))
    skipped = [s.skipped for s in doctor.steps]
    assert got["ampdoctor/skipped_steps"] == {i: float(sum(skipped[: i + 1])) for i in range(STEPS)}
    for step in range(STEPS):
        assert got["ampdoctor/headroom_bits_min"][step] == pytest.approx(expected_headroom(step), abs=1e-4)
        assert got["ampdoctor/headroom_bits/root"][step] == pytest.approx(expected_headroom(step), abs=1e-4)
    # layer "0" is tracked from step 1 on (the tightest module of the sampled step 0)
    assert sorted(got["ampdoctor/headroom_bits/0"]) == list(range(STEPS))
    assert 0 in got["ampdoctor/underflow_share"]  # sampled steps only
    assert set(got["ampdoctor/underflow_share"]) == {s.step for s in doctor.steps if s.sampled}
    forecasts = got["ampdoctor/forecast"]
    assert len(forecasts) == 1
    (step, text), = forecasts.items()
    assert text.startswith("forecast: 0 is heading for a float16 overflow") and "bits/step" in text
    assert any(w == text for w in doctor.report().findings.warnings)


def test_a_callable_receives_every_scalar_and_the_forecast() -> None:
    seen: list[tuple[str, Any, int]] = []
    doctor, scales = drift_loop(lambda tag, value, step: seen.append((tag, value, step)))
    got: dict[str, dict[int, Any]] = {}
    for tag, value, step in seen:
        assert isinstance(value, str if tag == "ampdoctor/forecast" else float), (tag, value)
        got.setdefault(tag, {})[step] = value
    check_scalars(got, scales, doctor)


def read_tensorboard(directory: Path) -> dict[str, dict[int, Any]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    got: dict[str, dict[int, Any]] = {}
    for tag in acc.Tags()["scalars"]:
        got[tag] = {e.step: e.value for e in acc.Scalars(tag)}
    for tag in acc.Tags()["tensors"]:  # add_text: "<tag>/text_summary"
        texts = {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)}
        got[tag.removesuffix("/text_summary")] = texts
    return got


def test_tensorboard_event_files_hold_the_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    doctor, scales = drift_loop(writer)
    writer.close()
    got = read_tensorboard(tmp_path)
    for step, value in got["ampdoctor/headroom_bits_min"].items():  # stored as float32
        assert value == pytest.approx(expected_headroom(step), abs=1e-4)
    got["ampdoctor/headroom_bits_min"] = {s: float(v) for s, v in got["ampdoctor/headroom_bits_min"].items()}
    check_scalars(got, scales, doctor)


def test_a_directory_gets_a_new_summary_writer(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    doctor, scales = drift_loop(str(tmp_path / "runs"))
    got = read_tensorboard(tmp_path / "runs")
    assert got["ampdoctor/loss_scale"] == dict(enumerate(scales))


def test_a_directory_without_tensorboard_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(AmpDoctorError, match="needs tensorboard: pip install tensorboard"):
        make_sink(tmp_path)


@pytest.mark.parametrize("bad", [42, object()])
def test_a_target_that_cannot_log_is_refused_naming_log_to(bad: Any) -> None:
    with pytest.raises(InvalidInput, match=r"log_to must be .*SummaryWriter.*callable \(tag, value, step\)"):
        ampdoctor.watch(nn.Linear(2, 2), log_to=bad)


# -- W&B, offline ---------------------------------------------------------------------------------------------------


def wandb_records(path: str) -> Iterator[bytes]:
    """The records of a W&B run file (a LevelDB-style log: 32 KiB blocks of chunks with a 7-byte header)."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # padding
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, or last chunk
            yield pending
            pending = b""


def read_wandb_history(directory: Path) -> list[dict[str, Any]]:
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(str(directory / "wandb" / "offline-run-*" / "run-*.wandb"))
    rows = []
    for data in wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


@pytest.mark.slow
def test_a_wandb_run_offline_holds_the_scalars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="ampdoctor-test", dir=str(tmp_path), mode="offline")
    try:
        doctor, scales = drift_loop(run)
    finally:
        run.finish()
    deadline = time.monotonic() + 60
    rows = read_wandb_history(tmp_path)
    while len(rows) < STEPS and time.monotonic() < deadline:  # W&B's service may still be writing the file
        time.sleep(0.5)
        rows = read_wandb_history(tmp_path)
    assert len(rows) == STEPS, (rows[:3], doctor.report().run.notes)
    got: dict[str, dict[int, Any]] = {}
    for row in rows:
        step: Optional[int] = row.get("ampdoctor/step")
        assert step is not None  # the watch's own step axis
        for tag, value in row.items():
            if tag.startswith("ampdoctor/") and tag != "ampdoctor/step":
                got.setdefault(tag, {})[step] = value
    check_scalars(got, [float(s) for s in scales], doctor)
