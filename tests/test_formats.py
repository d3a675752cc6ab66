"""Checkpoint formats at scale, each written by the real library (issue 21, item 3): ``torch.distributed.checkpoint``
folders, Accelerate ``save_state`` folders, Lightning ``.ckpt`` files, Hugging Face sharded folders with an index.

``scan`` reports the weights, the optimizer state and the GradScaler state wherever the format keeps them, and
``load_weights`` (what ``ampdoctor diagnose`` uses) puts exactly the saved weights into a fresh model.

The planted values: weight ``0.weight[0, 0] = 1e5`` is beyond float16's range (|x| >= 65520 becomes inf), one
finding naming that tensor; a GradScaler scale of 0.25 is below 1 (persistent overflow): ``scaler_collapsed``.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ampdoctor
from ampdoctor.checkpoint.load_weights import load_weights
from ampdoctor.cli.main import main
from ampdoctor.errors import CheckpointRefused

ROOT = Path(__file__).resolve().parents[1]


def small_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def trained(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return opt


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def kinds(report: Any) -> set[str]:
    return {f.kind for f in report.findings}


# -- torch.distributed.checkpoint --------------------------------------------------------------------------


def save_dcp(folder: Path, scale: float = 0.25) -> nn.Module:
    import torch.distributed.checkpoint as dcp

    model = small_model()
    opt = trained(model)
    with torch.no_grad():
        model[0].weight[0, 0] = 1e5
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "scaler": scaler.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming ... a single process"
        dcp.save(state, checkpoint_id=str(folder))
    assert not dist.is_initialized()
    return model


def test_dcp_folder_scanned_and_loaded_without_a_process_group(tmp_path: Path) -> None:
    folder = tmp_path / "step-100"
    model = save_dcp(folder)
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp"]
    report = ampdoctor.scan(folder)
    assert not dist.is_initialized()
    assert [(f.name, f.format) for f in report.files] == [("step-100", "dcp")]
    names = {t.name for t in report.tensors}
    assert {"model.0.weight", "model.2.bias", "optim.state.0.exp_avg_sq"} <= names
    [scaler] = report.scalers
    assert (scaler.path, scaler.scale, scaler.growth_tracker) == ("scaler", 0.25, 0)
    [optimizer] = report.optimizers
    assert (optimizer.path, optimizer.states, optimizer.param_groups, optimizer.eps) == ("optim", 4, 1, (1e-08,))
    assert optimizer.state_dtypes == ("float32",)
    beyond = [f for f in report.findings if f.kind == "beyond_range"]
    assert len(beyond) == 1 and beyond[0].tensors == ("model.0.weight",)
    assert "scaler_collapsed" in kinds(report)
    weights = {t.name: t for t in report.tensors}["model.0.weight"]
    assert weights.stats.abs_max == 1e5 and weights.stats.shape == (8, 8)
    # diagnose's loading: the model's own weights, the scaler's scale read from the folder
    fresh = small_model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    loaded = load_weights(fresh, folder)
    assert same_weights(fresh, model) and loaded.tensors == 4
    assert (loaded.scaler_scale, loaded.scaler_path) == (0.25, "scaler")
    assert not dist.is_initialized()
    # The command line: the planted 1e5 weight overflows the first Linear's float16 output.
    out = tmp_path / "report.json"
    argv = ["diagnose", str(folder), "--model", "test_formats:small_model", "--input-shape", "4x8", "--format",
            "json", "-o", str(out), "-q"]
    assert main(argv) == 1
    data = json.loads(out.read_text())
    assert data["findings"]["forward_origin"]["module"] == "0" and data["run"]["scale"] == 0.25


class Hostile:
    def __reduce__(self) -> Any:
        return (os.system, ("touch pwned",))


def test_dcp_metadata_goes_through_the_loading_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "ckpt"
    save_dcp(folder)
    monkeypatch.chdir(tmp_path)
    meta = pickle.loads((folder / ".metadata").read_bytes())
    meta.planner_data = {"x": Hostile()}
    (folder / ".metadata").write_bytes(pickle.dumps(meta, protocol=5))
    for unsafe in (False, True):
        with pytest.raises(CheckpointRefused, match=r"(os|posix)\.system.*likely malicious"):
            ampdoctor.scan(folder, unsafe_load=unsafe)
    assert main(["scan", str(folder), "-q", "--unsafe-load"]) == 2
    assert not (tmp_path / "pwned").exists()
    # A harmless type outside the metadata's own classes is refused with the exact --allow-global to copy.
    import argparse

    meta.planner_data = {"x": argparse.Namespace(a=1)}
    (folder / ".metadata").write_bytes(pickle.dumps(meta, protocol=4))
    with pytest.raises(CheckpointRefused, match="--allow-global argparse.Namespace"):
        ampdoctor.scan(folder)
    assert ampdoctor.scan(folder, allow_globals=["argparse.Namespace"]).scalers[0].scale == 0.25


def test_dcp_folder_damaged_or_incomplete_is_never_healthy(tmp_path: Path) -> None:
    import dataclasses

    from ampdoctor.errors import CheckpointError

    folder = tmp_path / "ckpt"
    save_dcp(folder)
    original = (folder / ".metadata").read_bytes()
    meta = pickle.loads(original)
    first = next(iter(meta.storage_data))  # an item the scan never reads (the learning rate)
    meta.storage_data[first] = dataclasses.replace(meta.storage_data[first], relative_path="../outside.distcp")
    (tmp_path / "outside.distcp").write_bytes(b"x")
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointError, match=r"names a data file outside the folder \(\.\./outside\.distcp\)"):
        ampdoctor.scan(folder)
    (folder / ".metadata").write_bytes(original)
    (folder / "__0_0.distcp").rename(folder / "__1_0.distcp")  # the data file the metadata names is absent
    with pytest.raises(CheckpointError, match="incomplete: its metadata names __0_0.distcp"):
        ampdoctor.scan(folder)
    (folder / "__1_0.distcp").rename(folder / "__0_0.distcp")
    (folder / ".metadata").write_bytes(original[: len(original) // 2])
    with pytest.raises(CheckpointError, match="a truncated or corrupt DCP metadata file"):
        ampdoctor.scan(folder)


def fsdp2_save_worker(rank: int, port: int, folder: str) -> None:
    """Two gloo ranks: a model sharded with fully_shard, saved with dcp.save (one chunk of each tensor per rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = small_model()  # the same seed on both ranks: the same full weights
        if rank == 0:
            torch.save(model.state_dict(), Path(folder).parent / "full.pt")
        mesh = init_device_mesh("cpu", (2,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        dcp.save({"model": model.state_dict()}, checkpoint_id=folder)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend here")
def test_dcp_of_an_fsdp2_model_assembles_each_tensor_from_its_chunks(tmp_path: Path) -> None:
    from test_ddp import free_port, spawn_ranks

    folder = tmp_path / "fsdp2"
    spawn_ranks(fsdp2_save_worker, (free_port(), str(folder)), 2)
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    report = ampdoctor.scan(folder)
    measured = {t.name: t for t in report.tensors}
    for key, value in full.items():
        stats = measured[f"model.{key}"].stats
        assert stats.shape == tuple(value.shape) and stats.abs_max == pytest.approx(float(value.abs().max()))
    fresh = small_model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    load_weights(fresh, folder)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in full.items())
    assert not dist.is_initialized()


# -- Accelerate ----------------------------------------------------------------------------------------------


def test_accelerate_save_state_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate import Accelerator

    monkeypatch.chdir(tmp_path)
    accelerator = Accelerator(cpu=True)
    model = small_model()
    opt = torch.optim.Adam(model.parameters())
    model, opt = accelerator.prepare(model, opt)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    # Accelerate makes no GradScaler on the CPU; its save_state writes scaler.pt for the one it holds.
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    accelerator.save_state(str(tmp_path / "state"))
    files = sorted(p.name for p in (tmp_path / "state").iterdir())
    assert {"model.safetensors", "optimizer.bin", "scaler.pt", "random_states_0.pkl"} <= set(files)
    report = ampdoctor.scan(tmp_path / "state")
    assert {f.name for f in report.files} == {"model.safetensors", "optimizer.bin", "scaler.pt"}
    [scaler] = report.scalers
    assert (scaler.file, scaler.scale) == ("scaler.pt", 512.0)
    [optimizer] = report.optimizers
    assert (optimizer.file, optimizer.states) == ("optimizer.bin", 4)
    assert report.verdict == "healthy"
    fresh = small_model()
    with torch.no_grad():
        fresh[0].weight.zero_()
    loaded = load_weights(fresh, tmp_path / "state")
    assert same_weights(fresh, model) and loaded.files == ("model.safetensors",) and loaded.scaler_scale == 512.0


def test_accelerate_fsdp_layout_with_dcp_subfolders(tmp_path: Path) -> None:
    """Accelerate's FSDP save_state (SHARDED_STATE_DICT) writes DCP folders inside the state folder:
    ``pytorch_model_fsdp_0/`` ({"model": ...}) and ``optimizer_0/`` ({"optimizer": ...}), beside ``scaler.pt``.
    Written here with dcp.save and torch.save in that layout (a real FSDP run needs several processes)."""
    import torch.distributed.checkpoint as dcp

    model = small_model()
    opt = trained(model)
    state = tmp_path / "checkpoint_3"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(state / "pytorch_model_fsdp_0"))
        dcp.save({"optimizer": opt.state_dict()}, checkpoint_id=str(state / "optimizer_0"))
    torch.save(torch.amp.GradScaler("cpu", init_scale=0.5).state_dict(), state / "scaler.pt")
    report = ampdoctor.scan(state)
    assert [(f.name, f.format) for f in report.files] == [
        ("optimizer_0", "dcp"), ("pytorch_model_fsdp_0", "dcp"), ("scaler.pt", "torch")
    ]
    assert [(o.file, o.path, o.states) for o in report.optimizers] == [("optimizer_0", "optimizer", 4)]
    assert [(s.file, s.scale) for s in report.scalers] == [("scaler.pt", 0.5)] and "scaler_collapsed" in kinds(report)
    fresh = small_model()
    with torch.no_grad():
        fresh[0].bias.fill_(3.0)
    loaded = load_weights(fresh, state)
    assert same_weights(fresh, model) and loaded.files == ("pytorch_model_fsdp_0",) and loaded.scaler_scale == 0.5


# -- Lightning ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_lightning_ckpt_with_its_scaler_state(tmp_path: Path) -> None:
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = small_model()

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return self.net(batch[0]).float().pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters())

    # precision="16-mixed" on the CPU trains in float16 autocast but makes no GradScaler; the plugin is given
    # one (a real torch.amp.GradScaler), whose state the Trainer writes into the checkpoint.
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    trainer = L.Trainer(
        accelerator="cpu", plugins=[plugin], max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )
    module = Module()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8)), batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data)
    assert trainer.precision == "16-mixed"
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert saved["MixedPrecision"]["_growth_tracker"] == 3  # three good steps at scale 1024
    report = ampdoctor.scan(tmp_path / "last.ckpt")
    [scaler] = report.scalers
    assert (scaler.path, scaler.scale, scaler.growth_tracker) == ("MixedPrecision", 1024.0, 3)
    [optimizer] = report.optimizers
    assert (optimizer.path, optimizer.states) == ("optimizer_states.0", 4)
    assert {t.name for t in report.tensors if t.role == "weights"} == {f"state_dict.net.{k}" for k in
                                                                       ("0.weight", "0.bias", "2.weight", "2.bias")}
    fresh = small_model()  # the bare network: the Lightning module's "net." prefix is dropped
    with torch.no_grad():
        fresh[2].bias.fill_(7.0)
    loaded = load_weights(fresh, tmp_path / "last.ckpt")
    assert same_weights(fresh, module.net) and loaded.scaler_scale == 1024.0


# -- Hugging Face sharded folders ---------------------------------------------------------------------------


def tiny_gpt2(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16))


@pytest.mark.parametrize("layout", ["safetensors", "bin"])
def test_hugging_face_sharded_folder_with_index(tmp_path: Path, layout: str) -> None:
    model = tiny_gpt2()
    folder = tmp_path / "shards"
    if layout == "safetensors":  # transformers' own save_pretrained
        model.save_pretrained(folder, max_shard_size="50KB")
        index = "model.safetensors.index.json"
    else:  # huggingface_hub's writer of .bin shards (transformers 5 writes safetensors only)
        from huggingface_hub import save_torch_state_dict

        folder.mkdir()
        save_torch_state_dict(model.state_dict(), folder, max_shard_size="50KB", safe_serialization=False)
        index = "pytorch_model.bin.index.json"
    shards = sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))
    assert len(shards) >= 3 and (folder / index).is_file()
    report = ampdoctor.scan(folder)
    assert sorted(f.name for f in report.files) == shards
    saved = {t.name for t in report.tensors}
    assert "transformer.h.1.attn.c_attn.weight" in saved and report.verdict == "healthy"
    fresh = tiny_gpt2(seed=1)
    assert not same_weights(fresh, model)
    loaded = load_weights(fresh, folder)
    assert same_weights(fresh, model) and sorted(loaded.files) == shards


# -- memory: a DCP folder read tensor by tensor --------------------------------------------------------------


@pytest.mark.slow
def test_dcp_scan_memory_is_bounded_by_the_largest_tensor(tmp_path: Path) -> None:
    """12 tensors of 16 MiB (192 MiB in all): the scan's peak RSS grows by a few largest tensors, not by the
    checkpoint (the benchmark prints the numbers; benchmarks/dcp_memory.py for larger cases)."""
    script = ROOT / "benchmarks" / "dcp_memory.py"
    done = subprocess.run(
        [sys.executable, str(script), "--tensors", "12", "--mib", "16", "--folder", str(tmp_path / "big")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert done.returncode == 0, done.stderr
    numbers = dict(line.split("=", 1) for line in done.stdout.split() if "=" in line)
    checkpoint, largest, peak = (int(numbers[k]) for k in ("checkpoint_bytes", "largest_bytes", "peak_growth_bytes"))
    assert checkpoint >= 12 * largest * 0.99
    assert peak < 4 * largest < checkpoint / 2, done.stdout
