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
    # steps with gradient statistics only: step 0 (every 50); the forecast's dense window (from step 8 here, once
    # the trend is significant) measures outputs only
    assert set(got["ampdoctor/underflow_share"]) == {0}
    assert [s.step for s in doctor.steps if s.sampled] == [0, 8, 9, 10, 11]
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


# -- the frameworks' own loggers ------------------------------------------------------------------------------------


def event_dirs(root: Path) -> list[Path]:
    return sorted({Path(p).parent for p in glob.glob(str(root / "**" / "events.out.tfevents.*"), recursive=True)})


@pytest.mark.slow
def test_lightning_logs_into_the_trainers_tensorboard_logger(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    L = pytest.importorskip("lightning")
    from lightning.pytorch.loggers import TensorBoardLogger
    from lightning.pytorch.plugins.precision import MixedPrecision
    from test_integrations_lightning import BATCHES, boom_net, data

    from ampdoctor.integrations import lightning_callback

    callback = lightning_callback(save_bundle=False)
    logger = TensorBoardLogger(save_dir=str(tmp_path), name="tb")
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, callbacks=[callback], logger=logger, log_every_n_steps=2,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path), plugins=[MixedPrecision("16-mixed", "cpu")],
    )
    loader = data(torch.full((4, 4), 1.0))  # a healthy run: boom's output up to 4 x 1.5 x 5000, no overflow
    trainer.fit(boom_net(), loader)
    (directory,) = event_dirs(tmp_path)
    got = read_tensorboard(directory)
    assert got["ampdoctor/loss_scale"] == {s: 65536.0 for s in range(2, BATCHES + 1, 2)}  # log_every_n_steps=2
    assert got["ampdoctor/skipped_steps"] == {s: 0.0 for s in range(2, BATCHES + 1, 2)}
    (x,) = list(loader)[1]  # global step 2 logs what batch 1 measured: boom's output is 5000 x the row sums
    boom_bits = math.log2(FP16_MAX / float(x.sum(1).max() * 5000))
    assert got["ampdoctor/headroom_bits/net.boom"][2] == pytest.approx(boom_bits, abs=1e-3)
    assert got["ampdoctor/headroom_bits_min"][2] == pytest.approx(boom_bits, abs=1e-3)


class Healthy(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((4,), 1.0 + i / 24), "labels": torch.tensor(1.0)}


@pytest.mark.slow
def test_hf_trainer_logs_into_its_report_to_integrations(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    transformers = pytest.importorskip("transformers")
    from test_integrations_hf import LogRegressor

    from ampdoctor.integrations import hf_callback

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, bf16=True, per_device_train_batch_size=4,
        num_train_epochs=1, learning_rate=0.0, report_to=["tensorboard"],
        logging_strategy="steps", logging_steps=2, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=LogRegressor(), args=args, train_dataset=Healthy())
    callback = hf_callback(trainer, save_bundle=False)
    trainer.train()
    assert callback.report is not None and callback.report.verdict == "healthy"
    got: dict[str, dict[int, Any]] = {}
    for directory in event_dirs(tmp_path):
        got.update(read_tensorboard(directory))
    # the Trainer's own TensorBoard callback wrote them, with its own logs ("train/loss", its prefix), every
    # logging_steps
    assert got["train/ampdoctor/loss_scale"] == {2: 1.0, 4: 1.0, 6: 1.0}  # bfloat16: no scaler
    assert got["train/ampdoctor/skipped_steps"] == {2: 0.0, 4: 0.0, 6: 0.0}
    assert set(got["train/ampdoctor/headroom_bits_min"]) == {2, 4, 6} and "train/loss" in got
    assert 120 < got["train/ampdoctor/headroom_bits_min"][2] < 140  # bfloat16: a max of 2**128, outputs near 1


@pytest.mark.slow
def test_accelerate_logs_through_accelerator_log(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        accelerator = Accelerator(mixed_precision="bf16", cpu=True, log_with="tensorboard", project_dir=str(tmp_path))
        accelerator.init_trackers("run")
        net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.0))
        with ampdoctor.watch(model, accelerator.scaler, log_to=accelerator, save_bundle=False) as doctor:
            for step in range(4):
                opt.zero_grad()
                loss = model(torch.full((2, 4), 1.0 + step)).float().pow(2).mean()
                doctor.see_loss(loss)
                accelerator.backward(loss)
                doctor.step()
                opt.step()
        accelerator.end_training()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    got: dict[str, dict[int, Any]] = {}
    for directory in event_dirs(tmp_path):
        got.update(read_tensorboard(directory))
    assert got["ampdoctor/loss_scale"] == {s: 1.0 for s in range(4)}
    assert set(got["ampdoctor/headroom_bits_min"]) == set(range(4))
