"""Reliability, round 2 (issue 19 items 5, 7, 8, 9, 11): two threads on one model, sparse gradients, a failed
refinement pass, a model that prints under the CLI, deeply nested models."""

from __future__ import annotations

import functools
import json
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from helpers import assert_untouched, plain_amp_step, snapshot
from torch import nn
from torch.utils import _python_dispatch

import ampdoctor
from ampdoctor.cli.main import main
from ampdoctor.errors import InvalidInput

# -- item 9: the model's prints never reach stdout under the CLI -------------------------------------------------


def test_json_on_stdout_stays_json_when_the_model_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "printer.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            print("importing the model")

            class Loud(nn.Module):
                def __init__(self):
                    super().__init__()
                    print("building")
                    self.fc = nn.Linear(4, 2)

                def forward(self, x):
                    print("forward", tuple(x.shape))
                    return self.fc(x)

            def build():
                return Loud()
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    torch.save({f"fc.{k}": v for k, v in nn.Linear(4, 2).state_dict().items()}, tmp_path / "loud.pt")
    code = main(["diagnose", "loud.pt", "--model", "printer:build", "--input-shape", "3x4", "--format", "json", "-q"])
    out, err = capsys.readouterr()
    assert code == 0
    report = json.loads(out)  # the whole of stdout is the report
    assert report["verdict"] == "healthy"
    assert "forward (3, 4)" in err and "building" in err and "importing the model" in err
    assert "forward (3, 4)" not in out and "building" not in out


# -- item 7: sparse gradients -------------------------------------------------------------------------------------


class _Recommender(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.fc = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(x))


def test_a_sparse_embedding_is_diagnosed_through_its_gradient_values() -> None:
    torch.manual_seed(0)
    model = _Recommender()
    batch = torch.tensor([[1, 2, 3], [3, 4, 1], [7, 7, 9], [2, 2, 2]])  # 6 distinct rows: 1, 2, 3, 4, 7, 9
    before = snapshot(model)
    report = ampdoctor.diagnose(model, batch, device_type="cpu", verify=False, scale=1.0)
    assert_untouched(model, before)
    assert report.verdict == "healthy"
    (event,) = [e for e in report.trace.grad_events if e.param == "emb.weight"]
    assert event.stats.shape == (6, 8)  # the stored values of the coalesced sparse gradient, one row per index
    # The same step by hand: the sparse gradient's values in float64.
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(batch)
    (grad,) = torch.autograd.grad(out.float().mean(), [model.emb.weight])
    assert grad.layout == torch.sparse_coo  # a later plain step still gets its sparse gradient
    values = grad.coalesce()._values().double()
    assert event.stats.max == pytest.approx(values.max().item(), rel=1e-3)
    assert event.stats.min == pytest.approx(values.min().item(), rel=1e-3)


# -- item 8: a failed refinement pass refines nothing ------------------------------------------------------------


class _Overflowing(nn.Module):
    """Overflows by its own code: ``fc(x) * 1e5`` passes 65504 (inf), and ``y - y`` turns those infs into NaN in
    the same output, so min and max of that output are NaN: only a NaN-ignoring look sees the inf."""

    def __init__(self, refuse: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.refuse = refuse
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.refuse == "second call" and self.calls > 1:
            raise RuntimeError("this forward runs once")
        if self.refuse == "dispatch modes" and _python_dispatch._get_current_dispatch_mode() is not None:
            raise RuntimeError("this custom op refuses dispatch modes")
        y = self.fc(x) * 1e5
        return torch.cat([y, y - y], -1)


class _Host(nn.Module):
    def __init__(self, refuse: str) -> None:
        super().__init__()
        self.block = _Overflowing(refuse)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


@pytest.mark.parametrize("refuse", ["nothing", "second call", "dispatch modes"])
def test_the_verdict_comes_from_the_pass_that_saw_the_overflow(refuse: str) -> None:
    torch.manual_seed(0)
    model = _Host(refuse)
    batch = torch.randn(3, 4) * 10
    before = snapshot(model)
    report = ampdoctor.diagnose(model, batch, device_type="cpu", verify=False)
    assert_untouched(model, before)
    assert report.verdict == "overflow"
    assert report.findings.forward_origin is not None and report.findings.forward_origin.module == "block"
    detail = [p for p in report.run.passes if p.purpose == "detail and op zoom"]
    assert [p.status for p in detail] == (["ran"] if refuse == "nothing" else ["failed"])
    if refuse == "nothing":  # the op zoom names the very multiplication
        assert report.findings.forward_origin.op is not None
        assert report.findings.forward_origin.op.op == "aten::mul.Tensor"


# -- item 11: a deeply nested model that runs plain runs under diagnose -----------------------------------------


def _nested(depth: int, weight_scale: float = 1.0) -> nn.Module:
    torch.manual_seed(0)
    leaf = nn.Linear(4, 4)
    with torch.no_grad():
        leaf.weight.mul_(weight_scale)
    model: nn.Module = leaf
    for _ in range(depth):
        model = nn.Sequential(model)
    return model


@functools.cache
def _deepest_plain() -> int:
    """About as deep as a plain AMP step runs from a test function."""
    x = torch.randn(2, 4)
    deepest = 0
    for depth in range(200, 1000, 40):
        try:
            plain_amp_step(_nested(depth), x)
        except RecursionError:
            break
        deepest = depth
    assert deepest >= 200
    return deepest


def test_a_model_nested_as_deep_as_a_plain_step_allows_is_diagnosed() -> None:
    x = torch.randn(2, 4)
    deepest = _deepest_plain()
    limit = sys.getrecursionlimit()
    model = _nested(deepest, weight_scale=1e5)  # its leaf overflows: the detailed re-run and op zoom run too
    before = snapshot(model)
    report = ampdoctor.diagnose(model, x, device_type="cpu", verify=False, memory_limit=1 << 40)  # none skipped
    assert_untouched(model, before)
    assert sys.getrecursionlimit() == limit
    assert report.verdict == "overflow"
    origin = report.findings.forward_origin
    assert origin is not None and origin.module == ".".join(["0"] * deepest)
    assert [p.reason for p in report.run.passes if p.status != "ran"] == []


def test_a_model_nested_as_deep_as_a_plain_step_allows_trains_watched() -> None:
    deepest = _deepest_plain()
    model, x = _nested(deepest), torch.randn(2, 4)
    limit = sys.getrecursionlimit()
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with ampdoctor.watch(model, scaler, stats_every=1) as doctor:
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
    assert sys.getrecursionlimit() == limit
    steps = doctor.steps
    assert len(steps) == 2 and all(s.sampled and s.out_abs_max for s in steps)  # the module hooks ran each step


# -- item 5: two threads, one model ------------------------------------------------------------------------------


class _Renormed(nn.Module):
    """``Embedding(max_norm=1)`` renormalises its rows in place in every forward; the forward notes which thread
    ran it and when."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, max_norm=1.0)
        with torch.no_grad():
            self.emb.weight.mul_(4.0)  # every row above max_norm
        self.fc = nn.Linear(8, 2)
        self.calls: list[tuple[str, float]] = []
        self.first_forward = threading.Event()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls.append((threading.current_thread().name, time.perf_counter()))
        self.first_forward.set()
        time.sleep(0.01)  # long enough for the other thread to try to start meanwhile
        return self.fc(self.emb(ids).mean(1))


def test_a_second_thread_diagnosing_the_same_model_waits_and_nothing_changes() -> None:
    torch.manual_seed(0)
    model = _Renormed()
    batch = torch.randint(0, 20, (6, 4))
    before = snapshot(model)
    reports: dict[str, Any] = {}

    def run(name: str) -> None:
        reports[name] = ampdoctor.diagnose(model, batch, device_type="cpu", verify=False, progress=False)

    first = threading.Thread(target=run, args=("first",), name="first")
    second = threading.Thread(target=run, args=("second",), name="second")
    first.start()
    assert model.first_forward.wait(30)
    second.start()  # while the first diagnosis runs its forward
    first.join(60)
    second.join(60)
    assert set(reports) == {"first", "second"}
    # The second waited for the first to put everything back: no forward of theirs interleaved.
    order = [name for name, _ in sorted(model.calls, key=lambda call: call[1])]
    assert order == sorted(order) and "second" in order and order[0] == "first"
    first_report, second_report = reports["first"], reports["second"]
    assert first_report.trace == second_report.trace  # the same passes on the same weights (timings aside)
    assert first_report.modules == second_report.modules and first_report.findings == second_report.findings
    assert first_report.run.notes == second_report.run.notes
    assert_untouched(model, before)


class _Reentrant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.error: Optional[BaseException] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.error is None:
            try:
                ampdoctor.diagnose(self, x, device_type="cpu")
            except BaseException as exc:  # what a diagnose from inside the forward gets
                self.error = exc
        return self.fc(x)


def test_a_diagnosis_from_inside_the_models_own_forward_is_refused() -> None:
    torch.manual_seed(0)
    model = _Reentrant()
    x = torch.randn(3, 4)
    report = ampdoctor.diagnose(model, x, device_type="cpu", verify=False)
    assert report.verdict == "healthy"
    assert isinstance(model.error, InvalidInput)
    assert "already being diagnosed in this thread" in str(model.error)
