"""The README's ``watch`` examples run as written (on CPU: ``"cuda"`` becomes ``"cpu"`` with float16 autocast), and
their reports never claim an option the user did not set, nor ask for one the user passed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from test_watch_replay import BLOWUP_STEP, classifier, loader
from torch import nn

import ampdoctor

README = Path(__file__).resolve().parents[1] / "README.md"
SECTION = "## Leave it on while training: `ampdoctor.watch`"
CPU = {
    'torch.amp.GradScaler("cuda")': 'torch.amp.GradScaler("cpu")',
    'torch.autocast("cuda")': 'torch.autocast("cpu", dtype=torch.float16)',
}


def watch_examples() -> list[str]:
    """The python blocks of the README's watch section, in order."""
    text = README.read_text()
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return re.findall(r"```python\n(.*?)```", text[start:end], flags=re.S)


def on_cpu(code: str) -> str:
    for cuda, cpu in CPU.items():
        code = code.replace(cuda, cpu)
    assert "cuda" not in code, code
    return code


def run(code: str, **names: Any) -> dict[str, Any]:
    """Run an example with the objects it expects: a model whose middle layer overflows at BLOWUP_STEP."""
    model = classifier()
    namespace: dict[str, Any] = {
        "torch": torch, "ampdoctor": ampdoctor, "model": model, "loader": loader(BLOWUP_STEP + 2),
        "criterion": nn.CrossEntropyLoss(), "opt": torch.optim.SGD(model.parameters(), lr=0.0),
        "scaler": torch.amp.GradScaler("cpu"), **names,
    }
    exec(compile(on_cpu(code), str(README), "exec"), namespace)
    return namespace


def assert_honest(report: ampdoctor.Report, loss_fn_passed: bool) -> None:
    text = str(report) + " ".join(report.run.notes)
    assert "backward=False" not in text  # nobody set it
    if loss_fn_passed:
        assert "pass loss_fn" not in text


def test_the_first_example_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # the failure bundle goes to the current directory
    code = watch_examples()[0]
    assert "opt.zero_grad()" in code and "loss_fn" not in code
    namespace = run(code)
    report = namespace["doctor"].report()
    assert report.verdict == "overflow" and report.forward_origin is not None
    assert report.forward_origin.module == "boom"
    assert report.steps[BLOWUP_STEP].captured and not report.steps[0].captured  # the first back-off: quiet
    assert_honest(report, loss_fn_passed=False)
    assert "OVERFLOW" in capsys.readouterr().out  # print(doctor.report())
    assert (tmp_path / "ampdoctor-bundles" / f"ampdoctor-bundle-step{BLOWUP_STEP}.pt").exists()


def test_the_loss_fn_example_replays_the_loss_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (code,) = [c for c in watch_examples() if "loss_fn=" in c]
    assert "doctor.set_targets(targets)" in code
    report = run(code)["doctor"].report()
    assert report.forward_origin is not None and report.forward_origin.module == "boom"
    assert report.run.loss_source == "loss_fn"  # the real loss re-ran: no fallback
    assert not any("instead" in n for n in report.run.notes)
    assert_honest(report, loss_fn_passed=True)


def test_the_old_readme_loss_fn_without_targets_never_claims_a_missing_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README used to pass loss_fn=lambda out, y: criterion(out, y) with no set_targets: the capture falls back
    to the recorded gradient and says why, without "pass loss_fn=" or "backward=False"."""
    monkeypatch.chdir(tmp_path)
    code = watch_examples()[0].replace(
        "ampdoctor.watch(model, scaler)", "ampdoctor.watch(model, scaler, loss_fn=lambda out, y: criterion(out, y))"
    )
    report = run(code)["doctor"].report()
    assert report.forward_origin is not None and report.forward_origin.module == "boom"
    notes = " ".join(report.run.notes)
    assert "loss_fn raised on the replayed batch" in notes and "doctor.set_targets" in notes
    assert "the watch's loss_fn could not replay the loss" in notes
    assert_honest(report, loss_fn_passed=True)


def test_the_log_to_example_writes_event_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)
    (code,) = [c for c in watch_examples() if "log_to=" in c]
    run(code)
    assert list((tmp_path / "runs" / "exp1").glob("events.out.tfevents.*"))
