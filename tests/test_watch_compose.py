"""Composing the watch's Report from typed per-rank payloads (``ampdoctor.training.compose``), without a process
group: the payloads are built by hand, as two DDP ranks would send them."""

from __future__ import annotations

import dataclasses
import pickle

import torch
from torch import nn

import ampdoctor
from ampdoctor.records import ModuleInfo, StepRecord
from ampdoctor.training.compose import RankPayload, compose_report
from ampdoctor.training.replay_step import Capture
from ampdoctor.training.runs import track

MODULES = (ModuleInfo("", "Sequential"), ModuleInfo("boom", "Linear"))


def rank_steps(rank: int, bad_forward: bool) -> tuple[StepRecord, ...]:
    """Steps 0-1 good at 65536; steps 2-3 skipped on every rank (DDP reduces the inf into every gradient), with a
    non-finite forward only on the rank that got the bad batch."""
    scales = [65536.0, 65536.0, 65536.0, 32768.0]
    return tuple(
        StepRecord(
            step=i, scale=scale, skipped=i >= 2, rank=rank, forward_finite=not (bad_forward and i >= 2),
            new_scale=scale / 2 if i >= 2 else scale, local_nonfinite=bad_forward and i >= 2,
        )
        for i, scale in enumerate(scales)
    )


def payload(rank: int, bad_forward: bool, **changes: object) -> RankPayload:
    steps = rank_steps(rank, bad_forward)
    base = RankPayload(
        rank=rank, world_size=2, steps=steps, runs=track(steps), failure=None, first_capture=None,
        first_local=2 if bad_forward else None, bundle=None, notes=(), modules=MODULES, model_class="Sequential",
        device_type="cpu", dtype=torch.float16, stats_every=50, scale=16384.0, total_steps=4,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_two_ranks_without_a_capture() -> None:
    report = compose_report([payload(1, True), payload(0, False)], me=0)
    assert report.verdict == "overflow" and report.forward_origin is None  # known from training, not located
    assert [(s.rank, s.step) for s in report.steps] == [(r, s) for s in range(4) for r in (0, 1)]
    # rank 0's run alone is still open; rank 1 made it persistent: the gravest status wins on every rank
    assert [s.run for s in report.steps] == [None] * 4 + ["persistent"] * 4
    assert report.findings.warnings == (
        "persistent failure from step 2: the forward was non-finite (loss or model output); it was not captured "
        "(the capture budget was spent, or the replay failed: see the notes)",
    )
    assert report.run.notes == (
        "watch: 4 step(s), 4 kept, module statistics every 50 step(s); 2 skipped in 1 run(s) of skipped steps: "
        "0 harmless, 1 persistent",
        "loss scale: 65536 at step 0 -> 16384 after step 3 (lowest used 32768)",
        "persistent failure from step 2: the forward was non-finite (loss or model output)",
        "distributed run: 2 ranks merged on rank 0; rank 1 first went non-finite, at step 2: its own forward was "
        "non-finite",
    )
    assert ampdoctor.Report.from_json(report.to_json()) == report


def boom_report(x: float) -> ampdoctor.Report:
    """A capture's report: boom's output is 16 * 5000 * x: 80000 (+inf in float16) for x = 1, 40000 for 0.5."""
    model = nn.Sequential()
    boom = nn.Linear(16, 4, bias=False)
    with torch.no_grad():
        boom.weight.fill_(5000.0)
    model.add_module("boom", boom)
    return ampdoctor.diagnose(model, torch.full((1, 16), x), backward=False, verify=False)


def test_the_capture_of_the_rank_that_went_non_finite_first_is_the_report() -> None:
    captured = Capture(step=2, report=boom_report(1.0), micro=0, local_nonfinite=True)
    bad = payload(1, True, failure=captured, first_capture=captured, bundle="/b/ampdoctor-bundle-step2-rank1.pt",
                  notes=("only rank 1 says this", "both say this"))
    # rank 0 skipped the same steps (reduced gradients) and captured its own, healthy, batch
    healthy = Capture(step=2, report=boom_report(0.5), micro=0, local_nonfinite=False)
    assert healthy.report.verdict == "healthy"
    good = payload(0, False, failure=healthy, first_capture=healthy, notes=("both say this",))
    # what all_gather_object does to a payload: pickle it
    assert pickle.loads(pickle.dumps(bad)) == bad
    report = compose_report([good, bad], me=0)
    assert report.verdict == "overflow"
    assert report.forward_origin is not None and report.forward_origin.module == "boom"
    notes = report.run.notes
    assert "failure bundle (rank 1): /b/ampdoctor-bundle-step2-rank1.pt" in notes
    assert notes[-2:] == ("both say this", "rank 1: only rank 1 says this")  # in rank order, each once
    assert report.findings.warnings == captured.report.findings.warnings  # the capture explains it: no warning


def test_one_rank_alone_reports_only_its_own_steps() -> None:
    report = compose_report([payload(0, False)], me=0)
    assert {s.rank for s in report.steps} == {0}
    assert [s.run for s in report.steps] == [None, None, "open", "open"]
    assert report.verdict == "scale_overflow"  # only a run of skipped steps, still open: no finding yet
    assert report.findings.warnings == (
        "a run of skipped steps from step 2 was still going at report time (2 skipped): not yet harmless (no good "
        "step at a scale >= 1 since)",
    )


def test_a_healthy_distributed_run_says_only_that_it_merged_the_ranks() -> None:
    good = [dataclasses.replace(s, skipped=False, forward_finite=True, local_nonfinite=False, new_scale=s.scale)
            for s in rank_steps(0, False)]
    payloads = [
        dataclasses.replace(payload(r, False), steps=tuple(dataclasses.replace(s, rank=r) for s in good), runs=())
        for r in (0, 1)
    ]
    report = compose_report(payloads, me=0)
    assert report.verdict == "healthy"
    assert "distributed run: 2 ranks merged on rank 0" in report.run.notes  # and nothing about skips
    assert not any("reduced gradients" in n for n in report.run.notes)
