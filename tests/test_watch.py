"""``ampdoctor.watch`` on real CPU float16 training loops: skipped steps, runs, captures, bundles, clean exit."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from helpers import ampdoctor_frames_during
from torch import nn

import ampdoctor
from ampdoctor.training.bundle import is_bundle, load_bundle, write_atomic
from ampdoctor.training.replay import replay_bundle
from ampdoctor.training.runtime import Watch

FP16 = torch.float16


def constant_linear(n_in: int, n_out: int, value: float) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=False)
    with torch.no_grad():
        layer.weight.fill_(value)
    return layer


def overflow_model() -> nn.Sequential:
    """pre: ones(16) * x -> 16 * x / 16 = x per unit; boom: 16 * 5000 * x = 80000 x.

    x = 0.5: boom's output is 40000, finite in float16; x = 1: 80000 >= 65520 rounds to +inf.
    """
    model = nn.Sequential()
    model.add_module("pre", constant_linear(16, 16, 1 / 16))
    model.add_module("boom", constant_linear(16, 16, 5000.0))
    model.add_module("post", constant_linear(16, 4, 1e-4))
    return model


def small_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss with a tiny gradient (1e-7 per output), so that no gradient overflows at the default scale.

    out = 40000 * 16 * 1e-4 = 64 per unit on a good step; d loss / d post.weight = 2 * 1e-7 * 65536 * 40000
    = 524 in float16, finite.
    """
    return (out.float() - target).sum() * 1e-7


def train(
    model: nn.Module,
    scaler: torch.amp.GradScaler,
    inputs: list[torch.Tensor],
    doctor: Optional[Watch] = None,
    accumulate: int = 1,
) -> None:
    """The classic loop (lr 0 keeps the constant weights, so every step's arithmetic is known)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for x in inputs:
        opt.zero_grad(set_to_none=True)
        for _ in range(accumulate):
            target = torch.zeros(x.shape[0], 4)
            if doctor is not None:
                doctor.set_targets(target)
            with torch.autocast("cpu", dtype=FP16):
                out = model(x)
            scaler.scale(small_loss(out, target) / accumulate).backward()
        scaler.step(opt)
        scaler.update()


def assert_no_watch_left(model: nn.Module, scaler: torch.amp.GradScaler) -> None:
    assert "update" not in scaler.__dict__ and "scale" not in scaler.__dict__
    assert type(scaler).update is torch.amp.GradScaler.update
    for name, m in model.named_modules():
        assert not m._forward_hooks and not m._forward_pre_hooks, f"hook left on {name!r}"
        assert not m._backward_hooks
        assert "forward" not in m.__dict__ and "__getstate__" not in m.__dict__, f"forward wrapper left on {name!r}"
    for name, p in model.named_parameters():
        assert not p._backward_hooks, f"tensor hook left on {name}"
    # a later training step runs no ampdoctor code at all (module, tensor or scaler hooks)
    x = torch.full((2, 16), 0.5)
    assert ampdoctor_frames_during(lambda: train(model, scaler, [x])) == []


# -- the scale collapses because a forward layer overflows: persistent, named ------------------------------


def run_forward_overflow(tmp_path: Path, **kwargs: Any) -> tuple[Watch, nn.Module]:
    model = overflow_model()
    scaler = torch.amp.GradScaler("cpu")
    good, bad = torch.full((2, 16), 0.5), torch.ones(2, 16)
    with ampdoctor.watch(model, scaler, loss_fn=small_loss, bundle_dir=tmp_path, **kwargs) as doctor:
        train(model, scaler, [good, good, good, bad, bad, bad], doctor)
    assert_no_watch_left(model, scaler)
    return doctor, model


def test_forward_overflow_is_persistent_and_names_the_layer(tmp_path: Path) -> None:
    doctor, _ = run_forward_overflow(tmp_path)
    report = doctor.report()
    assert isinstance(report, ampdoctor.Report)
    assert report.verdict == "overflow"
    origin = report.forward_origin
    assert origin is not None and origin.module == "boom"
    assert report.exit_code == 1
    steps = report.steps
    assert [s.step for s in steps] == list(range(6))
    assert [s.skipped for s in steps] == [False] * 3 + [True] * 3
    assert [s.scale for s in steps] == [65536.0] * 4 + [32768.0, 16384.0]  # halved after every skip
    assert [s.forward_finite for s in steps] == [True] * 3 + [False] * 3
    assert [s.run for s in steps] == [None] * 3 + ["persistent"] * 3
    assert steps[3].captured and steps[3].forward_origin == "boom"
    assert steps[4].explained_by == 3 and steps[4].forward_origin == "boom"  # not captured again, but explained
    assert steps[0].sampled and not steps[1].sampled  # statistics every 50 steps by default
    assert steps[0].out_abs_max["boom"] == 40000.0  # 16 * 5000 * 0.5, exact in float16
    text = str(report)
    assert "persistent failure from step 3" in text and "boom" in text
    assert ampdoctor.Report.from_json(report.to_json()).to_json() == report.to_json()


def test_the_bundle_replays_to_the_same_origin(tmp_path: Path) -> None:
    doctor, model = run_forward_overflow(tmp_path)
    path = doctor.bundle_path
    assert path is not None and path.parent == tmp_path and path.name == "ampdoctor-bundle-step3.pt"
    assert is_bundle(path) and not is_bundle(tmp_path / "nothing.pt")
    data = torch.load(path, weights_only=True)  # plain tensors, numbers and JSON text only
    assert data["step"] == 3 and data["scale"] == 65536.0 and data["dtype"] == "float16"
    assert torch.equal(data["args"][0], torch.ones(2, 16))
    assert set(data["model_state"]) == {"pre.weight", "boom.weight", "post.weight"}
    assert data["scaler_state"]["scale"] == 32768.0  # after the step's update
    records = json.loads(data["records"])
    assert records["steps"][-1]["forward_origin"] == "boom"

    forward_only = replay_bundle(path, overflow_model)
    assert forward_only.verdict == "overflow" and forward_only.forward_origin is not None
    assert forward_only.forward_origin.module == "boom"
    assert len(forward_only.steps) == 4 and forward_only.steps[-1].step == 3
    with_loss = replay_bundle(path, overflow_model, loss_fn=small_loss)  # called on (output, the saved targets)
    assert with_loss.forward_origin is not None and with_loss.forward_origin.module == "boom"
    assert with_loss.trace.backward_ran
    assert "replayed failure bundle" in str(with_loss)

    # a second failure in the same folder gets a new name: a bundle is never written over
    again, _ = run_forward_overflow(tmp_path)
    assert again.bundle_path == tmp_path / "ampdoctor-bundle-step3-1.pt"
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left


def test_a_bundle_without_an_output_gradient_replays_the_forward_and_says_why(tmp_path: Path) -> None:
    doctor, _ = run_forward_overflow(tmp_path, max_output_grad_bytes=0)  # no output gradient kept
    assert doctor.bundle_path is not None and not load_bundle(doctor.bundle_path).get("output_grads")
    replayed = replay_bundle(doctor.bundle_path, overflow_model)  # and no loss_fn
    assert not replayed.trace.backward_ran and replayed.forward_origin.module == "boom"  # type: ignore[union-attr]
    assert replayed.run.backward_note.startswith("forward only: the bundle holds no gradient")
    assert "backward=False" not in str(replayed)  # nobody set it


def test_without_loss_fn_the_bundle_replays_the_backward_through_the_output_gradient(tmp_path: Path) -> None:
    model = overflow_model()
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, scaler, bundle_dir=tmp_path) as doctor:  # no loss_fn
        train(model, scaler, [torch.full((2, 16), 0.5), torch.ones(2, 16)])
    assert doctor.report().forward_origin.module == "boom"  # type: ignore[union-attr]
    assert doctor.bundle_path is not None
    data = load_bundle(doctor.bundle_path)
    # d small_loss / d out = 1e-7, times the scale 65536, in float16
    assert torch.allclose(data["output_grads"]["out"], torch.full((2, 4), 65536e-7, dtype=FP16))
    replayed = replay_bundle(doctor.bundle_path, overflow_model)
    assert replayed.trace.backward_ran and replayed.forward_origin.module == "boom"  # type: ignore[union-attr]
    assert not replay_bundle(doctor.bundle_path, overflow_model, backward=False).trace.backward_ran


def test_bundle_errors_are_clear(tmp_path: Path) -> None:
    doctor, _ = run_forward_overflow(tmp_path)
    assert doctor.bundle_path is not None
    with pytest.raises(ampdoctor.AmpDoctorError, match="does not fit"):
        replay_bundle(doctor.bundle_path, lambda: nn.Linear(3, 3))
    other = write_atomic({"x": torch.zeros(1)}, tmp_path, "other")
    with pytest.raises(ampdoctor.AmpDoctorError, match="not an ampdoctor failure bundle"):
        load_bundle(other)
    with pytest.raises(ampdoctor.AmpDoctorError, match="no such file"):
        load_bundle(tmp_path / "missing.pt")


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("scale", "abc", "scale is 'abc', not a number"),  # each of these raised ValueError or TypeError raw
        ("version", "2", "version is '2', not an integer"),
        ("world_size", 2.5, "world_size is 2.5, not an integer"),
        ("model_state", None, "model_state is None, not a state dict"),
        ("records", "{", "its step records: Expecting property name"),
        ("records", json.dumps({"steps": [{"step": "x"}]}), "its step records: expected an integer, found str 'x'"),
    ],
)
def test_a_malformed_bundle_is_one_clear_error(tmp_path: Path, key: str, value: Any, says: str) -> None:
    doctor, _ = run_forward_overflow(tmp_path)
    assert doctor.bundle_path is not None
    data = load_bundle(doctor.bundle_path)
    data[key] = value
    crafted = write_atomic(data, tmp_path, "crafted")
    with pytest.raises(ampdoctor.AmpDoctorError, match=f"crafted.pt is a malformed ampdoctor failure bundle: {says}"):
        replay_bundle(crafted, overflow_model)


# -- occasional harmless scale overflows -------------------------------------------------------------------


def square_model() -> nn.Module:
    """x = ones(1, 16): out = 16 * 1/16 = 1 per unit; loss = sum(out**2): d loss / d out = 2 per unit.

    The float16 gradients (of ``out`` and of the weight, one row of x) are 2 * scale: inf at 65536 and 32768
    (>= 65520), finite at 16384. With growth_interval 3 the scaler climbs back to 32768 after 3 good steps.
    """
    return nn.Sequential(constant_linear(16, 4, 1 / 16))


def square_loss(out: torch.Tensor, _: Any) -> torch.Tensor:
    return out.float().pow(2).sum()


def square_steps(model: nn.Module, scaler: Optional[torch.amp.GradScaler], n: int, after_step: Any = None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(n):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=FP16):
            loss = square_loss(model(torch.ones(1, 16)), None)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        if after_step is not None:
            after_step()


def test_occasional_harmless_scale_overflows(tmp_path: Path) -> None:
    model = square_model()
    scaler = torch.amp.GradScaler("cpu", growth_interval=3)
    with ampdoctor.watch(model, scaler, loss_fn=square_loss, stats_every=1, bundle_dir=tmp_path) as doctor:
        square_steps(model, scaler, 11)
    report = doctor.report()
    steps = report.steps
    # 65536 skip, 32768 skip, 16384 x3 good, 32768 skip, 16384 x3 good, 32768 skip, 16384
    assert [s.skipped for s in steps] == [True, True, False, False, False, True, False, False, False, True, False]
    assert [s.run for s in steps if s.skipped] == ["harmless"] * 4
    assert report.verdict == "scale_overflow"
    assert report.forward_origin is None and report.backward_origin is not None
    assert report.findings.scale is not None and report.findings.scale.largest_finite_scale == 16384.0
    assert report.exit_code == 0  # harmless: what GradScaler exists for
    assert doctor.bundle_path is None and not list(tmp_path.iterdir())
    # the scaler's first back-off (steps 0-1, before any good step) is expected: not captured; every later run's
    # first skip is
    assert not steps[0].captured and steps[5].captured and steps[9].captured
    assert steps[1].explained_by is None
    assert steps[5].nonfinite_params == ("0.weight",)
    assert steps[0].nonfinite_grads == ("0", "")  # sampled: the output gradient (of the layer, = the root)
    assert steps[2].grad_abs_max["0"] == 2.0  # unscaled: 2 * 16384 / 16384
    assert "4 skipped in 3 run(s) of skipped steps: 3 harmless, 0 persistent" in str(report)


def test_backward_overflow_at_every_scale_is_persistent() -> None:
    """sqrt'(0) = inf: the forward is finite, the gradient is not at any scale; the scale falls below 1."""

    class Sqrt(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sqrt()

    model = nn.Sequential(constant_linear(4, 4, 0.0), Sqrt())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    with ampdoctor.watch(model, scaler, save_bundle=False) as doctor:
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=FP16):
                loss = model(torch.ones(1, 4)).float().sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    report = doctor.report()
    assert [s.scale for s in report.steps] == [2.0, 1.0, 0.5]
    assert [s.run for s in report.steps] == ["persistent"] * 3
    assert all(s.forward_finite for s in report.steps)
    assert report.steps[1].captured  # the step whose update took the scale below 1
    origin = report.backward_origin
    assert origin is not None and origin.module == "1" and origin.tensor == "grad:args[0]"
    # sqrt's backward divides the incoming gradient by 2 * sqrt(0) = 0: +inf (not 0/0), so an overflow
    assert origin.bad.posinf_count == 4 and origin.bad.nan_count == 0
    assert report.verdict == "overflow"
    assert "the scale fell below 1" in str(report)


# -- clean exit --------------------------------------------------------------------------------------------


def test_everything_is_removed_after_an_exception_inside_the_block(tmp_path: Path) -> None:
    model = overflow_model()
    scaler = torch.amp.GradScaler("cpu")
    original_update = scaler.update
    with pytest.raises(RuntimeError, match="user error"):
        with ampdoctor.watch(model, scaler, stats_every=1, bundle_dir=tmp_path) as doctor:
            assert "update" in scaler.__dict__ and scaler.update.__wrapped__ == original_update  # type: ignore[attr-defined]
            with torch.autocast("cpu", dtype=FP16):
                out = model(torch.full((2, 16), 0.5))  # tensor hooks now hang on the graph
            assert "forward" in model.boom.__dict__  # measured by its forward wrapper (no hook: torch's fast path)
            del out
            raise RuntimeError("user error")
    assert_no_watch_left(model, scaler)
    assert doctor.report().verdict == "healthy"  # usable after the block; no step was completed


class Raising(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad forward")


def test_everything_is_removed_after_an_exception_in_the_forward() -> None:
    model = nn.Sequential(constant_linear(16, 16, 1.0), Raising())
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="bad forward"):
        with ampdoctor.watch(model, scaler, stats_every=1):
            with torch.autocast("cpu", dtype=FP16):
                model(torch.ones(1, 16))
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
        assert "forward" not in m.__dict__ and "__getstate__" not in m.__dict__
    assert "update" not in scaler.__dict__ and "scale" not in scaler.__dict__


def test_a_loss_fn_that_fails_on_the_replayed_batch_falls_back_to_the_recorded_gradient(tmp_path: Path) -> None:
    def broken_loss(out: torch.Tensor, _: Any) -> torch.Tensor:
        raise KeyError("no targets here")

    model = overflow_model()
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, scaler, loss_fn=broken_loss, bundle_dir=tmp_path) as doctor:
        train(model, scaler, [torch.full((2, 16), 0.5), torch.ones(2, 16), torch.full((2, 16), 0.5)])
    report = doctor.report()
    assert [s.skipped for s in report.steps] == [False, True, False]
    assert report.steps[1].captured and report.steps[1].run == "persistent"
    assert report.verdict == "overflow" and report.forward_origin is not None
    assert report.forward_origin.module == "boom" and report.trace.backward_ran
    assert "loss_fn raised on the replayed batch (KeyError" in str(report)
    assert_no_watch_left(model, scaler)


def test_a_capture_that_fails_never_breaks_the_training_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ampdoctor.training.replay_step as replay_step

    def broken_diagnose(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("replay impossible")

    monkeypatch.setattr(replay_step, "diagnose", broken_diagnose)
    model = overflow_model()
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, scaler, bundle_dir=tmp_path) as doctor:
        train(model, scaler, [torch.full((2, 16), 0.5), torch.ones(2, 16), torch.full((2, 16), 0.5)])
    report = doctor.report()
    assert [s.skipped for s in report.steps] == [False, True, False]
    assert not report.steps[1].captured and report.steps[1].run == "persistent"
    assert report.verdict == "overflow" and report.forward_origin is None  # known from training, not located
    assert "could not replay the batch (RuntimeError: replay impossible)" in str(report)
    assert "not captured" in str(report)
    assert doctor.bundle_path is not None  # the failing batch is kept all the same, for a later replay
    monkeypatch.undo()
    assert replay_bundle(doctor.bundle_path, overflow_model).forward_origin.module == "boom"  # type: ignore[union-attr]
    assert_no_watch_left(model, scaler)


def test_a_bundle_that_cannot_be_written_is_a_note_not_an_error(tmp_path: Path) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    model = overflow_model()
    scaler = torch.amp.GradScaler("cpu")
    with ampdoctor.watch(model, scaler, loss_fn=small_loss, bundle_dir=not_a_folder) as doctor:
        train(model, scaler, [torch.ones(2, 16), torch.full((2, 16), 0.5)], doctor)
    report = doctor.report()
    assert doctor.bundle_path is None and [s.skipped for s in report.steps] == [True, False]
    assert report.forward_origin is not None and report.forward_origin.module == "boom"  # the capture still ran
    assert any(n.startswith("the failure bundle could not be written (FileExistsError") for n in report.run.notes)


def test_a_hook_that_fails_is_a_note_and_training_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    import ampdoctor.training.runtime as runtime

    def broken(outputs: Any) -> None:
        raise RuntimeError("broken loss read")

    monkeypatch.setattr(runtime, "loss_value", broken)
    model = square_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with ampdoctor.watch(model, scaler) as doctor:
        square_steps(model, scaler, 2)
    report = doctor.report()
    assert [s.step for s in report.steps] == [0, 1] and all(s.loss is None for s in report.steps)
    # each step's scaler.scale hit it; the report says it once
    assert report.run.notes[-1] == "watch hook error: RuntimeError: broken loss read"
    assert report.run.notes.count(report.run.notes[-1]) == 1


def test_an_instance_attribute_on_the_scaler_is_put_back() -> None:
    model = square_model()
    scaler = torch.amp.GradScaler("cpu")
    calls: list[int] = []

    def own_update(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        torch.amp.GradScaler.update(scaler, *args, **kwargs)

    scaler.update = own_update  # type: ignore[method-assign]
    with ampdoctor.watch(model, scaler):
        train(model, scaler, [torch.full((1, 16), 0.1)])
    assert scaler.__dict__["update"] is own_update and calls == [1]


# -- the loops people write --------------------------------------------------------------------------------


def test_accumulation_unscale_clip_and_two_optimizers() -> None:
    model = nn.Sequential(constant_linear(16, 8, 1 / 16), constant_linear(8, 4, 1 / 8))
    # good at 2**16, then grown to 2**17 where the gradients overflow (a run after a good step: captured)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1)
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.0)
    opt_b = torch.optim.SGD(model[1].parameters(), lr=0.0)
    x = torch.ones(1, 16)
    with ampdoctor.watch(model, scaler, stats_every=2) as doctor:
        for _ in range(4):
            opt_a.zero_grad()
            opt_b.zero_grad()
            for _ in range(3):  # gradient accumulation: 3 backwards per update
                with torch.autocast("cpu", dtype=FP16):
                    loss = model(x).float().pow(2).sum() / 3
                scaler.scale(loss).backward()
            scaler.unscale_(opt_a)
            scaler.unscale_(opt_b)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt_a)
            scaler.step(opt_b)
            scaler.update()
    steps = doctor.report().steps
    assert len(steps) == 4 and all(s.micro_batches == 3 for s in steps)
    # out = 1 per unit, loss per micro-batch 4/3; d loss / d out = 2/3 per unit, times the scale in float16
    # (and so is the last weight's gradient, one row of h = 1): 2**17 * 2/3 = 87381 -> inf; 2**16 * 2/3 = 43690
    assert [s.skipped for s in steps] == [False, True, False, True]
    assert [s.scale for s in steps] == [2.0**16, 2.0**17, 2.0**16, 2.0**17]
    assert steps[1].loss == pytest.approx(4 / 3)
    assert steps[1].captured and steps[1].backward_origin is not None
    assert steps[2].sampled and steps[2].grad_abs_max["1"] == pytest.approx(2 / 3, rel=1e-3)
    assert_no_watch_left(model, scaler)


def test_the_failing_micro_batch_is_the_one_captured(tmp_path: Path) -> None:
    """Accumulation over 3 micro-batches; only the middle one overflows boom's forward (x = 1: 80000 -> inf)."""
    model = overflow_model()
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with ampdoctor.watch(model, scaler, loss_fn=small_loss, bundle_dir=tmp_path) as doctor:
        for x in (torch.full((2, 16), 0.5), torch.ones(2, 16), torch.full((2, 16), 0.25)):
            doctor.set_targets(torch.zeros(2, 4))
            with torch.autocast("cpu", dtype=FP16):
                loss = small_loss(model(x), torch.zeros(2, 4)) / 3
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    report = doctor.report()
    assert report.steps[0].micro_batches == 3 and report.steps[0].skipped
    assert report.forward_origin is not None and report.forward_origin.module == "boom"
    assert doctor.bundle_path is not None
    assert torch.equal(load_bundle(doctor.bundle_path)["args"][0], torch.ones(2, 16))


def test_a_layer_losing_headroom_is_warned_about() -> None:
    """boom's output is 80000 * x; x doubles each step from 1/64: 1250, 2500, ... 20000 (5.7 to 1.7 bits)."""
    model = overflow_model()
    scaler = torch.amp.GradScaler("cpu")
    inputs = [torch.full((2, 16), 2.0**k / 64) for k in range(5)]
    with ampdoctor.watch(model, scaler, stats_every=1) as doctor:
        train(model, scaler, inputs)
    trend = doctor.headroom_trends()["boom"]
    assert [step for step, _ in trend] == [0, 1, 2, 3, 4]
    assert trend[0][1] == pytest.approx(5.711, abs=1e-3) and trend[-1][1] == pytest.approx(1.711, abs=1e-3)
    report = doctor.report()
    assert report.verdict == "healthy"
    assert any(w.startswith("boom is losing headroom") for w in report.findings.warnings)
    assert not any(w.startswith("pre ") for w in report.findings.warnings)  # pre's output is x: 16 bits and more


def test_a_skip_on_an_unsampled_step_is_still_explained() -> None:
    model = square_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_interval=1)
    with ampdoctor.watch(model, scaler, loss_fn=square_loss, stats_every=1000) as doctor:
        square_steps(model, scaler, 3)  # 16384 good, 32768 skipped (unsampled), 16384 good
    steps = doctor.report().steps
    assert [s.skipped for s in steps] == [False, True, False]
    assert not steps[1].sampled and steps[1].captured
    assert steps[1].backward_origin is not None and steps[1].nonfinite_params == ("0.weight",)
    assert steps[1].run == "harmless"


def test_without_loss_fn_the_gradient_reaching_the_output_is_replayed() -> None:
    """No loss_fn, and the output is no loss: the capture back-propagates the recorded output gradient.

    Here that gradient (2 * 32768 = 65536 in float16) is already inf: the origin is the loss, outside the model.
    """
    model = square_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_interval=1)  # good, then grown: overflows
    with ampdoctor.watch(model, scaler) as doctor:
        square_steps(model, scaler, 3)
    report = doctor.report()
    assert [s.skipped for s in report.steps] == [False, True, False]
    assert report.steps[1].backward_origin == "<loss>"
    assert report.backward_origin is not None and report.backward_origin.tensor == "grad:out"
    assert "already non-finite at scale 32768" in str(report)


def test_history_is_a_ring_buffer_and_the_report_round_trips() -> None:
    model = square_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with ampdoctor.watch(model, scaler, history=3, stats_every=2) as doctor:
        train(model, scaler, [torch.full((1, 16), 0.1)] * 7)
    report = doctor.report()
    assert [s.step for s in report.steps] == [4, 5, 6]
    assert report.verdict == "healthy" and "7 step(s), 3 kept" in str(report)
    assert ampdoctor.Report.from_json(report.to_json()).steps == report.steps
    assert set(doctor.headroom_trends()) == {"", "0"}  # the root and its layer


def test_manual_steps_without_a_scaler_in_bfloat16() -> None:
    model = overflow_model()
    with ampdoctor.watch(model, save_bundle=False) as doctor:
        for x in (torch.full((2, 16), 0.5), torch.full((2, 16), 1e36)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            out.float().sum().backward()
            doctor.step()
    report = doctor.report()
    assert [s.forward_finite for s in report.steps] == [True, False]
    assert [s.skipped for s in report.steps] == [False, False]
    assert report.verdict == "overflow" and report.forward_origin is not None
    assert report.forward_origin.module == "boom"  # 5000 * 16 * 1e36 > bfloat16 max 3.4e38


def test_usage_errors() -> None:
    with pytest.raises(ampdoctor.AmpDoctorError, match="GradScaler"):
        ampdoctor.watch(nn.Linear(2, 2), object())
    with pytest.raises(ampdoctor.AmpDoctorError, match="dtype"):
        ampdoctor.watch(nn.Linear(2, 2), dtype=torch.float32)


def test_watch_function_survives_importing_the_watch_modules() -> None:
    # The runtime module has its own name: importing it never rebinds ``ampdoctor.watch`` to a module.
    import ampdoctor.training.runtime  # noqa: F401

    assert callable(ampdoctor.watch) and not isinstance(ampdoctor.watch, type(ampdoctor))
    with ampdoctor.watch(copy.deepcopy(square_model())) as doctor:
        pass
    assert isinstance(doctor, Watch) and isinstance(doctor, ampdoctor.Watch)


# -- framework adapters ------------------------------------------------------------------------------------


def test_lightning_callback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in ``lightning.pytorch`` (the adapter only subclasses its Callback and reads the trainer)."""
    from types import ModuleType, SimpleNamespace

    from ampdoctor.integrations import lightning_callback

    class Callback:
        pass

    fake = ModuleType("lightning.pytorch")
    fake.Callback = Callback  # type: ignore[attr-defined]
    package = ModuleType("lightning")
    package.pytorch = fake  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lightning", package)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", fake)
    callback = lightning_callback(loss_fn=square_loss, stats_every=1)
    assert isinstance(callback, Callback)
    model = square_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**15)
    trainer = SimpleNamespace(strategy=SimpleNamespace(precision_plugin=SimpleNamespace(scaler=scaler)))
    callback.on_fit_start(trainer, model)
    square_steps(model, scaler, 2)
    callback.on_fit_end(trainer, model)
    assert [s.skipped for s in callback.report.steps] == [True, False]
    assert_no_watch_left(model, scaler)


def test_lightning_callback_without_lightning(monkeypatch: pytest.MonkeyPatch) -> None:
    from ampdoctor.integrations import lightning_callback

    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):  # imports fail as if not installed
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ampdoctor.AmpDoctorError, match="pip install lightning"):
        lightning_callback()


def test_hf_trainer_callback() -> None:
    from types import SimpleNamespace

    from transformers import TrainerCallback

    from ampdoctor.integrations import hf_callback

    model = square_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**15)
    added: list[Any] = []
    trainer = SimpleNamespace(accelerator=SimpleNamespace(scaler=scaler), model=model, add_callback=added.append)
    callback = hf_callback(trainer, loss_fn=square_loss)
    assert isinstance(callback, TrainerCallback) and added == [callback]
    callback.on_train_begin(None, None, None, model=model)
    square_steps(model, scaler, 2)
    callback.on_train_end(None, None, None)
    assert [s.skipped for s in callback.report.steps] == [True, False]
    assert_no_watch_left(model, scaler)

    # bfloat16 without a scaler: the callback closes each step itself
    plain = square_model()
    manual = hf_callback()
    manual.on_train_begin(None, None, None, model=plain)
    square_steps(plain, None, 3, after_step=lambda: manual.on_pre_optimizer_step(None, None, None))
    manual.on_train_end(None, None, None)
    assert [s.step for s in manual.report.steps] == [0, 1, 2]


def test_the_cli_replays_a_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ampdoctor.cli.main import main

    doctor, _ = run_forward_overflow(tmp_path)
    path = str(doctor.bundle_path)
    before = (Path(path).read_bytes(), Path(path).stat().st_mtime_ns)
    code = main(["diagnose", path, "--model", "test_watch:overflow_model", "--loss", "test_watch:small_loss"])
    out = capsys.readouterr().out
    assert code == 1 and out.splitlines()[0] == "ampdoctor: OVERFLOW - forward origin: boom"
    assert "replayed failure bundle" in out
    assert (Path(path).read_bytes(), Path(path).stat().st_mtime_ns) == before  # never modified
    assert main(["diagnose", path, "--model", "test_watch:overflow_model", "--input-shape", "2x16"]) == 2
    assert "failure bundle with its own batch" in capsys.readouterr().err
    assert main(["diagnose", path, "--model", "test_watch:overflow_model", "--loss", "test_watch:nope"]) == 2
    assert "--loss test_watch:nope" in capsys.readouterr().err


def test_a_bfloat16_step_closed_after_the_optimizer_says_the_weights_moved(tmp_path: Path) -> None:
    class Sqrt(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt(x)  # NaN from negative inputs

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Sqrt(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    with ampdoctor.watch(model, None, dtype=torch.bfloat16, bundle_dir=tmp_path, loss_fn=small_loss) as doctor:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().mean()
        loss.backward()
        opt.step()  # applies the NaN gradients before the step is closed
        doctor.step()
    notes = " ".join(doctor.report().run.notes)
    assert "the weights changed between the failing forward and this capture" in notes
