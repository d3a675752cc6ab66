"""``watch`` and ``diagnose`` on models sharded with FSDP2 (``fully_shard``): 2 gloo ranks on CPU, as the DDP test.

Rank 1 alone gets a batch that overflows ``boom``'s forward in float16 from step 2 on. FSDP reduce-scatters the
gradients, so both ranks skip; the merged report on rank 0 must say that rank 1 went non-finite first and name
``boom``, found by rank 1's capture on the gathered full model (FSDP's hooks set aside: no collective inside a
capture, so ranks that find different things never wait on each other). Every run has a timeout: a hang fails.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_ddp import BAD_FROM_STEP, BAD_RANK, STEPS, WORLD, free_port, make_model, small_loss, spawn_ranks
from torch import nn

import ampdoctor
from ampdoctor.training import full_model
from ampdoctor.training.replay import replay_bundle

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend here"),
]


def shard(model: nn.Module, mixed: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    policy = MixedPrecisionPolicy(param_dtype=torch.float16) if mixed else MixedPrecisionPolicy()
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + ("__getstate__" in m.__dict__)
               for m in model.modules())


def batch(rank: int, step: int) -> torch.Tensor:
    bad = rank == BAD_RANK and step >= BAD_FROM_STEP
    return torch.ones(2, 16) if bad else torch.full((2, 16), 0.5)


def train(model: nn.Module, scaler: Any, rank: int, autocast: bool = True) -> None:
    """The DDP test's loop: rank 1's batch overflows boom's forward from step 2 on (lr 0: constant weights)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for step in range(STEPS):
        opt.zero_grad()
        # with MixedPrecisionPolicy(param_dtype=float16) the model runs in float16 without autocast
        with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            loss = small_loss(model(batch(rank, step)), None)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def ranks(worker: Any, out_dir: Path, *args: Any) -> list[dict[str, Any]]:
    """Run ``worker(rank, port, out_dir, *args)`` on every rank; what each rank saved with :func:`save`."""
    spawn_ranks(worker, (free_port(), str(out_dir), *args), WORLD)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]


def save(out_dir: str, rank: int, result: dict[str, Any]) -> None:
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def watch_worker(rank: int, port: int, out_dir: str, scaler_kind: str, mixed: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        model = shard(make_model(), mixed)
        scaler = ShardedGradScaler("cpu") if scaler_kind == "sharded" else torch.amp.GradScaler("cpu")
        fsdp_hooks = hook_count(model)  # FSDP's own
        with ampdoctor.watch(model, scaler, bundle_dir=out_dir, stats_every=1) as doctor:
            train(model, scaler, rank, autocast=not mixed)
        report = doctor.report()
        save(out_dir, rank, {
            "text": str(report),
            "verdict": report.verdict,
            "origin": report.forward_origin.module if report.forward_origin else None,
            "dtype": report.run.limits.dtype,
            "steps": [(s.rank, s.step, s.skipped, s.forward_finite, s.nonfinite_outputs) for s in report.steps],
            "boom_out": [s.out_abs_max.get("boom") for s in report.steps if s.rank == rank],
            "weight_norm": report.steps[0].weight_norm.get("boom"),
            "hooks_left": hook_count(model) - fsdp_hooks,
            "params_sharded": all(type(p).__name__ == "DTensor" for p in model.parameters()),
            "taps_left": "update" in scaler.__dict__ or "scale" in scaler.__dict__,
            "bundle": str(doctor.bundle_path) if doctor.bundle_path else None,
        })
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "scaler_kind, mixed",
    [("sharded", False), ("plain", False), ("sharded", True)],
    ids=["ShardedGradScaler+autocast", "GradScaler+autocast", "ShardedGradScaler+MixedPrecisionPolicy(float16)"],
)
def test_fsdp2_names_the_rank_the_step_and_the_module(tmp_path: Path, scaler_kind: str, mixed: bool) -> None:
    results = ranks(watch_worker, tmp_path, scaler_kind, mixed)
    zero, one = results
    assert zero["verdict"] == "overflow" and zero["origin"] == "boom" and zero["dtype"] == "float16"
    assert f"rank {BAD_RANK} first went non-finite, at step {BAD_FROM_STEP}" in zero["text"]
    steps = [tuple(s) for s in zero["steps"]]
    assert [s[2] for s in steps] == [False] * 4 + [True] * 4  # both ranks skip: the gradients are reduced
    assert [(r, st) for r, st, _, finite, _ in steps if not finite] == [(1, 2), (1, 3)]
    assert [s[4] for s in steps if s[0] == 1 and s[1] == 2] == [["boom", "post", ""]]  # rank 1's own statistics
    assert zero["boom_out"] == [40000.0] * STEPS  # 16 * 5000 * 0.5 on rank 0: its own batch, never rank 1's
    # weight norms of the rank's own shard: boom is 16 x 16 of 5000, each rank holds 8 rows (no collective)
    assert zero["weight_norm"] == pytest.approx(5000.0 * (8 * 16) ** 0.5)
    assert "FSDP2 (fully_shard): the capture replayed the failing batch" in zero["text"]
    for r in results:
        assert r["hooks_left"] == 0 and r["params_sharded"] and not r["taps_left"]
    assert zero["bundle"] is None and one["bundle"].endswith(f"step{BAD_FROM_STEP}-rank{BAD_RANK}.pt")
    # the bundle holds the gathered full model: it replays on a plain, unsharded one
    replayed = replay_bundle(one["bundle"], make_model)
    assert replayed.forward_origin is not None and replayed.forward_origin.module == "boom"


def diagnose_worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        model = shard(make_model(), mixed=False)
        # diagnose gathers the full parameters itself (every rank: one all-gather per parameter, then local
        # passes only); the two ranks find different things and run different passes: nothing waits on the other
        report = ampdoctor.diagnose(model, batch(rank, BAD_FROM_STEP), loss_fn=small_loss)
        with full_model(model) as full:  # the same, spelled out
            again = ampdoctor.diagnose(full, batch(rank, BAD_FROM_STEP), loss_fn=small_loss)
        assert again == report
        sharded_again = all(type(p).__name__ == "DTensor" for p in model.parameters())
        save(out_dir, rank, {
            "verdict": report.verdict, "origin": report.forward_origin.module if report.forward_origin else None,
            "sharded_again": sharded_again, "passes": len(report.run.passes),
        })
    finally:
        dist.destroy_process_group()


def test_diagnose_on_the_gathered_full_model_of_an_fsdp2_model(tmp_path: Path) -> None:
    zero, one = ranks(diagnose_worker, tmp_path)
    assert zero["verdict"] == "healthy" and zero["origin"] is None
    assert one["verdict"] == "overflow" and one["origin"] == "boom"
    assert zero["passes"] != one["passes"]  # different schedules, and no hang
    assert zero["sharded_again"] and one["sharded_again"]


def fsdp1_worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(make_model(), device_id=torch.device("cpu"))
        scaler = torch.amp.GradScaler("cpu")
        with ampdoctor.watch(model, scaler, bundle_dir=out_dir) as doctor:
            train(model, scaler, rank)
        report = doctor.report()
        save(out_dir, rank, {"text": str(report), "bundle": doctor.bundle_path is not None,
                             "captured": any(s.captured for s in report.steps)})
    finally:
        dist.destroy_process_group()


def test_fsdp1_is_recorded_without_captures_and_says_so(tmp_path: Path) -> None:
    zero, one = ranks(fsdp1_worker, tmp_path)
    assert "FullyShardedDataParallel (FSDP1)" in zero["text"] and "ran no capture" in zero["text"]
    assert f"rank {BAD_RANK} first went non-finite, at step {BAD_FROM_STEP}" in zero["text"]
    assert not zero["captured"] and not one["captured"] and not one["bundle"]
