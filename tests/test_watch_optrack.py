"""Per-op trends (training/optrack.py): an op inside a module that climbs towards the float16 maximum while the
module's output stays bounded (attention scores under a softmax) is forecast by name; a stationary loop says
nothing; nothing of the watch is left on the model."""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampdoctor
from ampdoctor.training import optrack

OP_WARNING = re.compile(r"step (\d+): forecast: op (\S+) in (\S+) is heading for a float16 overflow")


class Attention(nn.Module):
    """Scores ``q @ k.T`` (float16 under autocast) under a softmax whose weights average a fixed table: the
    module's output never exceeds the table's |max| whatever the scores do, until they overflow (inf - inf in the
    softmax: NaN)."""

    def __init__(self, d: int, t: int) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)
        self.table = nn.Parameter(torch.randn(t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        return torch.softmax(scores * 0.125, dim=-1) @ self.table


class Model(nn.Module):
    def __init__(self, d: int = 16, t: int = 8) -> None:
        super().__init__()
        self.attn = Attention(d, t)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x))


def _run(growth: float, steps: int) -> tuple[list[tuple[int, str, str]], int | None, Model]:
    """The loop with inputs scaled by ``growth`` per step; (op warnings, first non-finite loss step, model)."""
    torch.manual_seed(0)
    model = Model()
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    first_bad = None
    handler = _Records()
    log = logging.getLogger("ampdoctor")
    log.addHandler(handler)
    try:
        with ampdoctor.watch(model, scaler, save_bundle=False, max_captures=0) as doctor:
            for step in range(steps):
                x = torch.randn(4, 8, 16) * growth**step
                y = torch.randint(0, 4, (4 * 8,))
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x)
                loss = F.cross_entropy(out.float().flatten(0, 1), y)
                if not math.isfinite(loss.item()):
                    first_bad = step
                    break
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            report = doctor.report()
    finally:
        log.removeHandler(handler)
    warnings = [(int(m[1]), m[2], m[3]) for text in handler.texts if (m := OP_WARNING.search(text))]
    assert all("forecast" not in w or "op " in w for w in report.findings.warnings if "forecast" in w)
    return warnings, first_bad, model


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.texts.append(record.getMessage())


@pytest.fixture(autouse=True)
def one_thread() -> object:
    """One intra-op thread: float16 matmuls on a loaded 2-core CPU crawl when two threads spin for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _no_hooks_left(model: nn.Module) -> None:
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    assert not torch._C._is_torch_function_mode_enabled()


def test_scores_climbing_under_a_softmax_are_forecast_by_module_and_op() -> None:
    """Inputs grow 15 % a step, so the scores grow 32 % a step (0.40 bits) from about 2**4: they overflow float16
    about 30 steps in, while the attention's output stays under the table's maximum all along."""
    warnings, first_bad, model = _run(1.15, 80)
    assert first_bad is not None
    assert warnings, "no forecast for the scores"
    step, op, module = warnings[0]
    assert (module, op) == ("attn", "matmul#0")  # q @ k.T, not the weighted table (matmul#1)
    assert step <= first_bad - 5
    _no_hooks_left(model)


def test_a_stationary_attention_logs_nothing() -> None:
    warnings, first_bad, model = _run(1.0, 200)
    assert first_bad is None and warnings == []
    _no_hooks_left(model)


class Inner(nn.Module):
    """A child with a matmul of its own: the parent's matmuls are numbered without it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.eye(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


class Outer(nn.Module):
    """(capture.hidden's TwoMatmuls under a child) a = x @ 100 (4 x 400 at x = 2); a @ b with b = 200 per unit:
    4 * 400 * 200 = 320000 -> inf, hidden by the clamp. At x = 0.01: a = 2, a @ b = 1600, finite."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x.reshape(2, 2))
        a = y @ torch.full((2, 4), 100.0)  # matmul #0 of this call
        return (a @ torch.full((4, 2), 200.0)).clamp(-1.0, 1.0)  # matmul #1: the hidden overflow


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.outer = Outer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(x)


def test_an_op_a_capture_flagged_is_followed_every_step_under_the_captures_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(optrack, "TRACKED_OPS", 0)  # the survey follows nothing: only the capture's flag counts
    model = Holder()
    report = ampdoctor.diagnose(model, torch.full((4,), 2.0), loss_fn=lambda out, b: out.float().sum(),
                                device_type="cpu", scale=1.0)
    ops = [(o.module, o.op, o.occurrence) for o in report.trace.op_overflows]
    assert ops == [("outer", "matmul", 1)]
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = []
    with ampdoctor.watch(model, scaler, save_bundle=False, max_captures=0) as doctor:
        for step in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(torch.full((4,), 0.01, requires_grad=True))
            scaler.scale(out.float().sum()).backward()
            scaler.step(opt)
            scaler.update()
            seen.append(dict(doctor._lookout.seen))
            if step == 1:
                doctor.hooks.ops.flag_ops(ops)  # what the watch does with a capture's hidden overflows
    with torch.autocast("cpu", dtype=torch.float16):
        a = torch.full((2, 2), 0.01) @ torch.eye(2) @ torch.full((2, 4), 100.0)
        expected = (a.half() @ torch.full((4, 2), 200.0)).abs().max().item()
    # step 0 is surveyed: every made op of the call, numbered as the capture numbers them
    assert seen[0]["outer:matmul#1"] == expected and "outer:matmul#0" in seen[0] and "outer:matmul#2" not in seen[0]
    assert "outer.inner:matmul#0" in seen[0]
    assert "outer:matmul#1" not in seen[1]  # flagged at step 1's end (as after a capture): followed from step 2
    assert seen[2]["outer:matmul#1"] == expected and "outer:matmul#0" not in seen[2]
    assert doctor.hooks.ops.flagged["outer:matmul#1"] == ("outer", "matmul", 1)
    _no_hooks_left(model)


def test_a_model_with_op_taps_pickles_and_copies_without_them() -> None:
    """The taps on a flagged op's module stay between steps: torch.save of the whole model and a deepcopy (an EMA
    copy) made meanwhile must carry none of their closures (pickling them failed before)."""
    import copy
    import io

    model = Holder()
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    with ampdoctor.watch(model, scaler, save_bundle=False, max_captures=0) as doctor:
        doctor.hooks.ops.flag_ops([("outer", "matmul", 1)])
        assert model.outer._forward_hooks and model.outer.inner._forward_pre_hooks  # the tap and its child's
        buffer = io.BytesIO()
        torch.save(model, buffer)
        twin = copy.deepcopy(model)
        assert model.outer._forward_hooks  # the watched model keeps them
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    for other in (twin, loaded, model):
        for m in other.modules():
            assert not m._forward_hooks and not m._forward_pre_hooks
            assert "__getstate__" not in m.__dict__ and "forward" not in m.__dict__
    x = torch.full((4,), 0.01)
    assert torch.equal(loaded(x), model(x)) and torch.equal(twin(x), model(x))
