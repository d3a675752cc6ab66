"""Ctrl-C at any moment leaves nothing behind (issue 23).

Deterministic tests put a real SIGINT (``signal.raise_signal``) exactly into the windows that used to leak: right
after a hook took effect, inside a restore, inside the owner's exit. Sweeps send SIGINT from a timer thread at
moments spread over whole runs of ``diagnose``, ``diagnose`` with the emulated CUDA policy, ``watch`` and the CLI,
and compare everything the user owns afterwards (tests/interrupt_harness.py). scripts/interrupt_sweep.py runs
the long version (20 sweeps in a row).
"""

from __future__ import annotations

import random
import signal
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from interrupt_harness import (
    TRAINING_CHANGES,
    differences,
    interrupt_at,
    model_and_batch,
    state_of,
    sweep,
    timed,
    watched_run,
)
from torch import nn

import ampdoctor
from ampdoctor.capture import cleanup
from ampdoctor.capture.call_wrappers import PassForwards
from ampdoctor.capture.cleanup import Cleanup, on_cleanup, uninterrupted
from ampdoctor.capture.state import RngState
from ampdoctor.cli.main import main

pytestmark = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="SIGINT reaches the main thread only"
)


@pytest.fixture(autouse=True)
def _python_sigint_handler() -> Any:
    """Python's own SIGINT handler, as in a terminal (a run started in the background inherits SIGINT ignored)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _ctrl_c() -> None:
    signal.raise_signal(signal.SIGINT)  # delivered to this (the main) thread's handler at the next bytecode


# -- the mechanism ------------------------------------------------------------------------------------------------


def test_a_ctrl_c_inside_an_uninterrupted_call_is_raised_once_when_it_returns() -> None:
    steps: list[int] = []

    @uninterrupted
    def restore() -> None:
        for i in range(5):
            steps.append(i)
            if i == 1:
                _ctrl_c()

    with pytest.raises(KeyboardInterrupt):
        with Cleanup():
            restore()
            steps.append(99)  # not reached: the held Ctrl-C is raised as restore() returns
    assert steps == [0, 1, 2, 3, 4]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_owner_runs_every_undo_even_when_ctrl_c_arrives_inside_one() -> None:
    undone: list[str] = []

    def undo(name: str) -> Callable[[], None]:
        def run() -> None:
            undone.append(name)
            if name == "b":
                _ctrl_c()
                undone.append("b finished")

        return run

    with pytest.raises(KeyboardInterrupt) as raised:
        with Cleanup():
            for name in "abc":
                on_cleanup(undo(name))
    assert undone == ["c", "b", "b finished", "a"]
    assert raised.value.__context__ is None  # one Ctrl-C, not one raised while handling another


def test_a_second_ctrl_c_during_cleanup_is_not_raised_twice() -> None:
    undone: list[str] = []

    def undo() -> None:
        _ctrl_c()  # the user presses Ctrl-C again while ampdoctor restores
        undone.append("done")

    with pytest.raises(KeyboardInterrupt) as raised:
        with Cleanup():
            on_cleanup(undo)
            raise KeyboardInterrupt("first")
    assert str(raised.value) == "first" and undone == ["done"]


def test_the_owner_puts_the_threads_torch_state_back() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    before = cleanup.TorchState()
    with Cleanup():
        torch.set_grad_enabled(False)
        torch.set_autocast_enabled("cpu", True)
        torch.set_autocast_dtype("cpu", torch.float16)
        torch.autocast_increment_nesting()
        torch.set_anomaly_enabled(True, False)
        TorchDispatchMode().__enter__()  # a mode whose exit never ran
        assert set(before.changed()) == {"grad", "anomaly", "autocast", "nesting", "dispatch"}
    assert before.changed() == []


# -- the windows that leaked --------------------------------------------------------------------------------------


def _interrupt_on_call(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, at: int) -> None:
    """Ctrl-C right after the ``at``-th call of ``owner.name`` took effect (before its caller records it)."""
    original = getattr(owner, name)
    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        calls[0] += 1
        if calls[0] == at:
            _ctrl_c()
        return result

    monkeypatch.setattr(owner, name, wrapped)


@pytest.mark.parametrize(
    ("owner", "name", "at"),
    [
        (PassForwards, "wrap", 7),  # a module's forward wrapped (for the pass), inside the install
        (nn.Module, "register_forward_hook", 7),  # a module hook registered, not yet in the recorder's list
        (nn.Module, "register_forward_pre_hook", 1),
        (torch.Tensor, "register_hook", 3),  # a tensor hook on a parameter
        (torch.Tensor, "clone", 1),  # inside copy-on-write / buffer copies
        (RngState, "restore", 2),  # inside a rewind
        (RngState, "restore", 5),  # inside the final restore
    ],
)
def test_ctrl_c_in_a_window_that_used_to_leak_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, at: int
) -> None:
    import ampdoctor.capture.hooks  # noqa: F401 - bound before the patch: a patched registration is then used as
    # torch's own (the path of module classes with their own registration), so the Ctrl-C lands in the install

    model, batch = model_and_batch(blocks=2)
    global_hook = None
    if name.startswith("register_forward"):  # a global hook: every module gets hooks, none a forward wrapper
        global_hook = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        before = state_of(model)
        _interrupt_on_call(monkeypatch, owner, name, at)
        with pytest.raises(KeyboardInterrupt):
            ampdoctor.diagnose(model, batch, device_type="cpu", progress=False)
        monkeypatch.undo()
        assert differences(before, state_of(model)) == []
    finally:
        if global_hook is not None:
            global_hook.remove()


def test_a_ctrl_c_while_an_owner_enters_leaves_it_again_before_it_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """A with statement calls no __exit__ for an __enter__ that raised: the owner leaves by itself first."""
    _interrupt_on_call(monkeypatch, cleanup, "shield_sigint", 1)  # right after our SIGINT handler went in
    body: list[str] = []
    with pytest.raises(KeyboardInterrupt) as raised:
        with Cleanup():
            body.append("ran")
    assert body == []
    assert raised.value.__context__ is None
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert cleanup.current_owner() is None and cleanup._OWNERS_IN_MAIN[0] == 0


def test_a_ctrl_c_while_a_watch_starts_leaves_nothing_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    from ampdoctor.training.hooks import WatchHooks

    model, batch = model_and_batch(blocks=2)
    scaler = torch.amp.GradScaler("cpu")
    before = state_of(model, scaler)
    _interrupt_on_call(monkeypatch, WatchHooks, "sample", 1)  # the last install of start()
    with pytest.raises(KeyboardInterrupt):
        with ampdoctor.watch(model, scaler, save_bundle=False):
            pytest.fail("the block must not run")
    monkeypatch.undo()
    assert differences(before, state_of(model, scaler)) == []


def test_a_ctrl_c_while_the_watch_installs_its_op_survey_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The survey's hooks go in before its mode is pushed and recorded: a Ctrl-C in between used to leave the hooks
    on every module, our SIGINT handler, and a close() that popped a mode never pushed."""
    from ampdoctor.training import optrack

    run, model, scaler = watched_run(blocks=2, steps=1)
    before = state_of(model, scaler)
    for key in TRAINING_CHANGES:
        del before[key]
    _interrupt_on_call(monkeypatch, optrack, "HookTap", 2)  # in the first watched forward's survey install
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.undo()
    after = state_of(model, scaler)
    assert differences(before, {k: v for k, v in after.items() if k in before}) == []


def test_after_an_interrupt_the_model_runs_no_ampdoctor_code() -> None:
    from helpers import ampdoctor_frames_during

    model, batch = model_and_batch(blocks=2)
    for offset in (0.05, 0.2, 0.4):
        interrupt_at(lambda: ampdoctor.diagnose(model, batch, device_type="cpu", progress=False), model, offset)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(batch)
        out.float().sum().backward()
        model.zero_grad(set_to_none=True)

    assert ampdoctor_frames_during(step) == []


# -- sweeps over whole runs ---------------------------------------------------------------------------------------


def _check(outcomes: list[Any]) -> None:
    bad = [(round(o.offset, 3), o.result, o.left_behind) for o in outcomes if o.left_behind]
    assert bad == []
    unexpected = [o.result for o in outcomes if o.result not in ("interrupted", "finished")]
    assert unexpected == []
    assert any(o.result == "interrupted" for o in outcomes)


@pytest.mark.slow
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])  # "cuda" on a CPU machine: CUDA's policy, emulated
def test_ctrl_c_at_moments_across_a_diagnosis(device_type: str) -> None:
    if device_type == "cuda" and torch.cuda.is_available():
        pytest.skip("the emulated policy is what runs without a GPU")
    model, batch = model_and_batch(blocks=3)

    def run() -> Any:
        return ampdoctor.diagnose(model, batch, device_type=device_type, progress=False)

    _check(sweep(run, model, moments=10, duration=timed(run) * 1.1, rng=random.Random(1)))


@pytest.mark.slow
def test_ctrl_c_at_moments_across_a_watched_loop() -> None:
    run, model, scaler = watched_run(blocks=2, steps=3)
    run()  # the process's first watch imports and warms up (seconds): timed from it, the moments would miss the steps
    _check(sweep(run, model, 10, timed(run) * 1.1, random.Random(2), scaler, TRAINING_CHANGES))


def test_ctrl_c_early_and_late_in_a_diagnosis() -> None:
    """The short version of the sweep, for every run of the suite."""
    model, batch = model_and_batch(blocks=2)

    def run() -> Any:
        return ampdoctor.diagnose(model, batch, device_type="cpu", progress=False, verify=False)

    _check(sweep(run, model, moments=3, duration=timed(run)))


# -- the command line ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_cli_exits_130_and_writes_nothing_when_interrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "interrupted_model.py").write_text(
        "from interrupt_harness import model_and_batch\n\ndef build():\n    return model_and_batch(blocks=2)[0]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    model, batch = model_and_batch(blocks=2)
    torch.save(model.state_dict(), tmp_path / "ckpt.pt")
    torch.save(batch, tmp_path / "batch.pt")
    out = tmp_path / "report.json"
    argv = ["diagnose", "ckpt.pt", "--model", "interrupted_model:build", "--batch", "batch.pt", "--format", "json",
            "-o", str(out), "-q"]
    codes: list[int] = []
    duration = timed(lambda: codes.append(main(argv)))
    assert len(codes) == 1 and codes[0] in (0, 1) and out.exists()  # a verdict: the report is written
    out.unlink()
    seen: list[int] = []
    for offset in (0.1 * duration, 0.4 * duration, 0.7 * duration):
        code: list[int] = []
        outcome = interrupt_at(lambda: code.append(main(argv)), model, offset)  # noqa: B023
        capsys.readouterr()
        assert outcome.left_behind == []
        if code == [130]:
            assert not out.exists()  # nothing was written
        else:  # the run ended before the timer fired
            assert code == codes and out.exists()
            out.unlink()
        seen += code
    assert 130 in seen
