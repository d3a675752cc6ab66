"""Issue 14, items 1 and 3: a capture needs no extra line in the loop, and says so when it happens.

The README's own loop (``loss_fn`` given, no ``doctor.set_targets``) whose middle layer blows up at step 30 must be
reported as an overflow with its origin: the capture replays the step's backward from the gradient the step's own
loss sent into the model's output, and a ``loss_fn`` that cannot run on the replayed batch falls back to it.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ampdoctor

FP16 = torch.float16
BLOWUP_STEP = 30
N_CLASSES = 4


def classifier() -> nn.Sequential:
    """embed -> boom -> head. boom multiplies by 5000: on normal inputs (|x| < 1, so |embed| <= 8 * 1/8) its
    output stays under 5000; at step 30 the batch is 100x larger and boom's output exceeds 65504 (+inf)."""
    model = nn.Sequential()
    model.add_module("embed", nn.Linear(8, 8, bias=False))
    model.add_module("boom", nn.Linear(8, 8, bias=False))
    model.add_module("head", nn.Linear(8, N_CLASSES, bias=False))
    with torch.no_grad():
        model.embed.weight.fill_(1 / 8)
        model.boom.weight.fill_(5000.0 / 8)
        model.head.weight.fill_(1e-4)
    return model


def loader(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    batches = []
    for step in range(steps):
        inputs = torch.rand(4, 8, generator=gen) * (100.0 if step == BLOWUP_STEP else 1.0)
        batches.append((inputs, torch.randint(0, N_CLASSES, (4,), generator=gen)))
    return batches


def readme_loop(
    tmp_path: Path, loss_fn: Any, steps: int = BLOWUP_STEP + 2, set_targets: bool = False,
    scaler_kwargs: Any = None, **watch_kwargs: Any
) -> ampdoctor.Watch:
    """The README's example, as written there (a CPU autocast here); ``set_targets`` adds the optional line."""
    model = classifier()
    criterion = nn.CrossEntropyLoss()
    scaler = torch.amp.GradScaler("cpu", **(scaler_kwargs or {}))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    kwargs = {"loss_fn": loss_fn} if loss_fn is not None else {}
    with ampdoctor.watch(model, scaler, bundle_dir=tmp_path, **kwargs, **watch_kwargs) as doctor:
        for inputs, targets in loader(steps):  # your loop, unchanged
            if set_targets:
                doctor.set_targets(targets)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=FP16):
                loss = criterion(model(inputs), targets)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return doctor


def assert_blowup_explained(report: ampdoctor.Report) -> None:
    """GradScaler first backs off from 65536 to 32 (the head's weight gradient, dlogits x boom's output, is near
    2000 unscaled): a harmless run, and the scaler's expected first back-off, so not captured. Step 30 is the
    blow-up."""
    assert report.verdict == "overflow"
    assert report.forward_origin is not None and report.forward_origin.module == "boom"
    assert len(report.trace.calls) == 4
    failing = report.steps[BLOWUP_STEP]
    assert failing.captured and failing.run == "persistent" and failing.forward_origin == "boom"
    assert [s.step for s in report.steps if s.skipped] == [*range(11), BLOWUP_STEP]
    assert [s.run for s in report.steps[:11]] == ["harmless"] * 11
    assert not any(s.captured for s in report.steps[:11])


def test_the_readme_loop_with_its_loss_fn_and_no_set_targets_names_the_origin(tmp_path: Path) -> None:
    criterion = nn.CrossEntropyLoss()
    doctor = readme_loop(tmp_path, loss_fn=lambda out, y: criterion(out, y))
    report = doctor.report()
    assert_blowup_explained(report)
    # without set_targets the loss_fn got the inputs as targets and raised; the step's own record stood in (here
    # its output gradient was NaN already: the forward overflowed, so only the forward is replayed)
    notes = " ".join(report.run.notes)
    assert "loss_fn raised on the replayed batch" in notes and "doctor.set_targets" in notes
    assert "already non-finite at scale 32" in notes


def test_the_readme_loop_without_loss_fn_names_the_origin(tmp_path: Path) -> None:
    report = readme_loop(tmp_path, loss_fn=None).report()
    assert_blowup_explained(report)


@pytest.mark.parametrize("how", ["no loss_fn", "README loss_fn", "loss_fn that disagrees"])
def test_a_backward_overflow_is_replayed_from_the_recorded_output_gradient(tmp_path: Path, how: str) -> None:
    """The scale starts at 32 and grows every good step: at 128, step 2 skips in the backward (a run after a good
    step, so captured): the report stands on that capture, whose backward replays the gradient the step's loss sent
    into the output, whatever loss_fn is."""
    criterion = nn.CrossEntropyLoss()
    loss_fn = {
        "no loss_fn": None,
        "README loss_fn": lambda out, y: criterion(out, y),  # gets the inputs as targets: raises
        "loss_fn that disagrees": lambda out, batch: out.float().pow(2).mean(),  # runs, with another value
    }[how]
    grows = {"init_scale": 32.0, "growth_interval": 1}
    report = readme_loop(tmp_path, loss_fn=loss_fn, steps=12, scaler_kwargs=grows).report()
    assert report.verdict == "scale_overflow" and report.trace.backward_ran
    assert [s.step for s in report.steps if s.skipped][0] == 2
    assert report.backward_origin is not None and report.steps[2].captured
    assert "head.weight" in report.steps[2].nonfinite_params
    # step 2's own batch is finite at 64 (the scale it skipped at, 128, halved)
    assert report.findings.scale is not None and report.findings.scale.largest_finite_scale == 64.0
    notes = " ".join(report.run.notes)
    expected = {
        "no loss_fn": "replayed the step's backward from the gradient its loss sent into the model's output",
        "README loss_fn": "loss_fn raised on the replayed batch (",
        "loss_fn that disagrees": "loss_fn on the replayed batch gave",
    }[how]
    assert expected in notes


def test_a_loss_fn_that_matches_the_step_replays_the_loss_itself(tmp_path: Path) -> None:
    """The right loss, targets handed over with set_targets: no fallback, the loss itself is re-run."""
    criterion = nn.CrossEntropyLoss()
    doctor = readme_loop(tmp_path, lambda out, y: criterion(out, y), BLOWUP_STEP + 1, set_targets=True)
    report = doctor.report()
    assert report.forward_origin is not None and report.forward_origin.module == "boom"
    assert report.run.loss_source == "loss_fn"
    assert not any("instead" in n for n in report.run.notes)


def test_an_output_gradient_over_the_cap_is_said_not_kept(tmp_path: Path) -> None:
    doctor = readme_loop(tmp_path, loss_fn=None, max_output_grad_bytes=16)
    report = doctor.report()
    assert report.forward_origin is not None and report.forward_origin.module == "boom"  # the forward says it
    notes = " ".join(report.run.notes)
    # the output is 4 x 4 float16 = 32 bytes, over the 16-byte cap
    assert "not kept: over the size cap of the step (out (0.0 MiB)" in notes
    assert "max_output_grad_bytes" in notes and "surrogate loss" in notes


# -- item 3: one log line when it happens ------------------------------------------------------------------


def test_a_persistent_failure_and_its_bundle_are_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ampdoctor"):
        doctor = readme_loop(tmp_path, loss_fn=None)
    lines = [r.getMessage() for r in caplog.records if r.name == "ampdoctor"]
    assert all(r.levelno == logging.WARNING for r in caplog.records if r.name == "ampdoctor")
    assert len(lines) == 2
    assert lines[0].startswith(f"ampdoctor: step {BLOWUP_STEP}: persistent failure, the forward was non-finite")
    assert "captured: OVERFLOW, forward origin: boom" in lines[0]
    bundle = tmp_path / f"ampdoctor-bundle-step{BLOWUP_STEP}.pt"
    assert doctor.bundle_path == bundle and lines[1].startswith(
        f"ampdoctor: step {BLOWUP_STEP}: failure bundle written to {bundle}"
    )


def test_the_log_line_shows_with_pythons_default_handling(tmp_path: Path) -> None:
    """No logging configured at all: Python's last-resort handler prints WARNING lines to stderr."""
    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_watch_replay import readme_loop
        from pathlib import Path
        readme_loop(Path({str(tmp_path)!r}), loss_fn=None)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("ampdoctor: ")]
    assert len(lines) == 2 and "persistent failure" in lines[0] and "failure bundle written to" in lines[1]
    assert done.stdout == ""
