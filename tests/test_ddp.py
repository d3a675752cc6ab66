"""``ampdoctor.watch`` on a 2-rank DistributedDataParallel run (gloo, 2 CPU processes, 127.0.0.1).

Rank 1 alone gets a batch that overflows the ``boom`` layer's forward in float16. DDP averages the gradients,
so both ranks see non-finite gradients and both skip the step; the merged report on rank 0 must still say that
rank 1 went non-finite first and name ``boom`` (without DDP's ``module.`` prefix).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import ampdoctor

WORLD = 2
BAD_RANK = 1
BAD_FROM_STEP = 2
STEPS = 4


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# A run of ranks that is not done by then is a hang: its processes are killed and the test fails.
SPAWN_TIMEOUT_S = 300


def spawn_ranks(
    fn: Callable[..., None], args: tuple[Any, ...], world: int = 2, timeout: float = SPAWN_TIMEOUT_S
) -> None:
    """Run ``fn(rank, *args)`` on ``world`` spawned processes; fail (never hang) when they take over ``timeout``."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    context = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=2):  # raises when a rank failed
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {world} ranks were still running after {timeout:.0f} s: a hang")


def make_model() -> nn.Sequential:
    """boom's output is 16 * 5000 * x: 40000 for x = 0.5 (finite), 80000 for x = 1 (inf in float16)."""
    model = nn.Sequential()
    for name, n_in, n_out, value in (("pre", 16, 16, 1 / 16), ("boom", 16, 16, 5000.0), ("post", 16, 4, 1e-4)):
        layer = nn.Linear(n_in, n_out, bias=False)
        with torch.no_grad():
            layer.weight.fill_(value)
        model.add_module(name, layer)
    return model


def small_loss(out: torch.Tensor, _: object) -> torch.Tensor:
    return out.float().sum() * 1e-7  # a tiny gradient: nothing overflows in the backward on a good step


def worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        model = nn.parallel.DistributedDataParallel(make_model())
        scaler = torch.amp.GradScaler("cpu")
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        logged: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("ampdoctor").addHandler(handler)
        with ampdoctor.watch(model, scaler, loss_fn=small_loss, bundle_dir=out_dir, stats_every=1) as doctor:
            for step in range(STEPS):
                bad = rank == BAD_RANK and step >= BAD_FROM_STEP
                x = torch.ones(2, 16) if bad else torch.full((2, 16), 0.5)
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = small_loss(model(x), None)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        report = doctor.report()  # every rank calls it: one all_gather at report time
        hooks_left = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + ("forward" in m.__dict__)
                         + ("__getstate__" in m.__dict__) for m in model.modules())
        result = {
            "text": str(report),
            "verdict": report.verdict,
            "origin": report.forward_origin.module if report.forward_origin else None,
            "steps": [(s.rank, s.step, s.skipped, s.forward_finite, s.local_nonfinite) for s in report.steps],
            "hooks_left": hooks_left,
            "update_restored": "update" not in scaler.__dict__,
            "bundle": str(doctor.bundle_path) if doctor.bundle_path else None,
            "scale": scaler.get_scale(),
            "logged": logged,
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend in this torch")
def test_two_rank_gloo_run_names_the_rank_and_the_origin(tmp_path: Path) -> None:
    spawn_ranks(worker, (free_port(), str(tmp_path)), WORLD)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    zero = results[0]
    assert zero["verdict"] == "overflow" and zero["origin"] == "boom"
    assert f"rank {BAD_RANK} first went non-finite, at step {BAD_FROM_STEP}" in zero["text"]
    assert "module.boom" not in zero["text"]
    steps = [tuple(s) for s in zero["steps"]]
    assert len(steps) == WORLD * STEPS  # both ranks' records, merged on rank 0
    # DDP averaged rank 1's inf into everyone's gradients: both ranks skip from step 2 on ...
    assert [s[2] for s in steps] == [False] * 4 + [True] * 4
    # ... but only rank 1's own forward was non-finite
    assert [(r, st) for r, st, _, finite, _ in steps if not finite] == [(1, 2), (1, 3)]
    assert all(r["hooks_left"] == 0 and r["update_restored"] for r in results)
    assert all(r["scale"] == 2.0**14 for r in results)  # 65536 halved by the two skipped steps on both ranks
    assert results[1]["bundle"] is not None and results[1]["bundle"].endswith("step2-rank1.pt")
    # said when it happened, by the rank that failed, with its rank: the failure, then its bundle
    failure, bundle = results[1]["logged"]
    assert failure.startswith("[rank 1] ampdoctor: step 2: persistent failure, the forward was non-finite")
    assert "captured: OVERFLOW, forward origin: boom" in failure
    assert bundle.startswith(f"[rank 1] ampdoctor: step 2: failure bundle written to {results[1]['bundle']} ")
    assert results[0]["logged"] == []  # rank 0 only skipped the reduced gradients: nothing persistent of its own
