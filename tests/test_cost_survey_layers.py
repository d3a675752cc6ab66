"""Fewer Python layers per op and per module call in a pass (issue 22): the hidden-overflow watch runs the
copy-on-write of parameters itself (one torch-function mode per op, not two), the guard's own mode stands in
while the watch is paused, and the forward hooks go in without a handle object per module; every promise kept
(parameters written in place are restored, no hook or dict entry is left behind)."""

from __future__ import annotations

import signal

import pytest
import torch
from helpers import pass_spec
from torch import nn

from ampdoctor.capture.hooks import Recorder
from ampdoctor.capture.options import PassOptions
from ampdoctor.capture.passes import run_pass
from ampdoctor.capture.state import StateGuard, fingerprints
from ampdoctor.capture.stats import StatsCollector


def _modes() -> list[str]:
    depth = torch._C._len_torch_function_stack()
    return [type(torch._C._get_function_stack_at(i)).__name__ for i in range(depth)]


class ClampsItself(nn.Linear):
    """A leaf that clamps its own weight in place in every forward, and notes the torch-function modes it runs
    under. Its weight starts at linspace(-3, 3): the clamp changes 2 * 24 of its 64 values."""

    def __init__(self) -> None:
        super().__init__(8, 8)
        with torch.no_grad():
            self.weight.copy_(torch.linspace(-3, 3, 64).reshape(8, 8))
        self.seen: list[list[str]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(_modes())
        with torch.no_grad():
            self.weight.clamp_(-1, 1)
        return super().forward(x)


def _guarded_pass(options: PassOptions) -> tuple[ClampsItself, StateGuard, torch.Tensor, int]:
    torch.manual_seed(0)
    leaf = ClampsItself()
    model = nn.Sequential(leaf, nn.ReLU())
    original, version = leaf.weight.detach().clone(), leaf.weight._version
    spec = pass_spec(model, torch.randn(3, 8))
    guard = StateGuard(model, spec.params)
    try:
        run_pass(spec, 1.0, options, guard)
        assert id(leaf.weight) in guard.saved  # the write was seen, and the weight copied before it
    finally:
        guard.restore()
    return leaf, guard, original, version


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (PassOptions(), [["HiddenWatch"]]),  # the watch guards writes itself: one mode per op
        (PassOptions(autocast=False), [["_WriteGuard"]]),  # no watch in float32: the guard's own mode
        # The float32 reference re-runs the leaf in its hook with the watch paused: the guard's mode stands in.
        (PassOptions(reference=True), [["HiddenWatch"], ["_WriteGuard"]]),
    ],
    ids=["survey", "float32", "reference"],
)
def test_one_mode_per_op_and_parameters_written_in_place_are_restored(
    options: PassOptions, expected: list[list[str]]
) -> None:
    leaf, guard, original, version = _guarded_pass(options)
    assert leaf.seen == expected
    assert torch.equal(leaf.weight.detach(), original)  # back from the clamp (48 values were outside [-1, 1])
    assert leaf.weight._version == version
    assert any("writes parameters in place (0.weight)" in n for n in guard.notes)
    assert _modes() == []


class OwnRegistration(nn.Linear):
    """A module class with its own hook registration (as wrappers have): asked through it, as before."""

    registered = 0

    def register_forward_hook(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        OwnRegistration.registered += 1
        return super().register_forward_hook(*args, **kwargs)


def _hook_entries(model: nn.Module) -> list[int]:
    return [
        len(d)
        for m in model.modules()
        for d in (m._forward_pre_hooks, m._forward_pre_hooks_with_kwargs, m._forward_hooks,
                  m._forward_hooks_with_kwargs, m._forward_hooks_always_called)
    ]


def test_forward_hooks_need_no_handle_per_module_and_leave_no_entry_behind() -> None:
    """Under a global module hook no module gets a forward wrapper (call_wrappers): every one gets hooks, in
    torch's own dicts without a handle, except the class with its own registration, which is asked."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), OwnRegistration(4, 2))
    names = {id(m): n for n, m in model.named_modules()}
    global_hook = torch.nn.modules.module.register_module_forward_pre_hook(lambda *args: None)
    recorder = Recorder(names, list(model.modules()), StatsCollector(torch.float16, False), record_grads=True)
    OwnRegistration.registered = 0
    try:
        recorder.install(list(model.named_parameters()))
        try:
            assert len(recorder._module_handles) == 2  # only the class with its own registration got handles
            assert OwnRegistration.registered == 1
            # Every other module holds the same entries torch's registration would make (kwargs passed to the hooks).
            for m in list(model.modules())[:3]:
                assert list(m._forward_pre_hooks.values()) == [recorder._pre]
                assert list(m._forward_hooks.values()) == [recorder._post]
                assert list(m._forward_pre_hooks_with_kwargs) == list(m._forward_pre_hooks)
                assert list(m._forward_hooks_with_kwargs) == list(m._forward_hooks)
                assert "forward" not in vars(m)
            model(torch.randn(2, 4))
            assert [c.module for c in recorder.calls] == ["", "0", "1", "2"]
        finally:
            recorder.remove()
    finally:
        global_hook.remove()
    assert _hook_entries(model) == [0] * len(_hook_entries(model))
    recorder.remove()  # idempotent
    assert all(not p._backward_hooks for p in model.parameters())


def test_a_user_hook_registered_before_still_runs_first_and_stays() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    order: list[str] = []
    handle = model[0].register_forward_hook(lambda *_: order.append("user"))
    names = {id(m): n for n, m in model.named_modules()}
    recorder = Recorder(names, list(model.modules()), StatsCollector(torch.float16, False), record_grads=False)
    recorder.install([])
    original_post = recorder._post
    recorder._post = lambda *a: (order.append("ampdoctor"), original_post(*a))  # type: ignore[method-assign]
    try:
        model[0]._forward_hooks[recorder._hook_ids[1]] = recorder._post
        model(torch.randn(2, 4))
    finally:
        recorder.remove()
    assert order == ["user", "ampdoctor"]
    assert len(model[0]._forward_hooks) == 1
    handle.remove()


class WritesBehindTorch(nn.Module):
    """Writes one element of a small parameter (and of a buffer) through numpy in its first forward: bytes changed
    by no torch op at all, which only the fingerprints can see (as a C++ extension's write). The buffer write goes
    to the pass's working copy of it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(4, 4) for _ in range(40)])
        self.register_buffer("count", torch.zeros(3, dtype=torch.float16))
        self.done = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.done:
            self.done = True
            self.layers[17].bias.detach().numpy()[2] += 1.0
            self.count.numpy()[1] = 5.0
        return self.layers(x)


def _not_restored_notes(model: nn.Module, batch: torch.Tensor) -> tuple[StateGuard, list[str]]:
    """One survey pass under a state guard, restored: the guard and its notes on what it could not restore."""
    spec = pass_spec(model, batch)
    guard = StateGuard(model, spec.params)
    try:
        run_pass(spec, 1.0, PassOptions(), guard)
    finally:
        guard.restore()
    return guard, [n for n in guard.notes if "NOT restored" in n]


def test_fingerprints_name_what_no_python_level_op_wrote() -> None:
    torch.manual_seed(0)
    model = WritesBehindTorch()
    guard, (note,) = _not_restored_notes(model, torch.randn(2, 4))
    assert note.startswith("layers.17.bias changed during the diagnosis")
    assert torch.equal(model.count, torch.zeros(3, dtype=torch.float16))  # the pass wrote a copy of the buffer
    # The numpy write is no torch op: the copy-on-write guard never saw it (the bias keeps its new value).
    assert not guard.saved and model.layers[17].bias[2].item() != 0.0


def test_fingerprints_never_write_what_they_read() -> None:
    # A lone int64 buffer (BatchNorm's num_batches_tracked) flattens to a view of itself and needs no widening.
    alone = torch.tensor(7, dtype=torch.int64)
    many = [torch.arange(3, dtype=torch.int64), torch.ones(2, 2), torch.zeros(5, dtype=torch.float16)]
    versions = [t._version for t in [alone, *many]]
    values = [t.clone() for t in [alone, *many]]
    first = fingerprints([alone]) + fingerprints(many)
    assert fingerprints([alone]) + fingerprints(many) == first
    assert [t._version for t in [alone, *many]] == versions
    assert all(torch.equal(t, v) for t, v in zip([alone, *many], values))


@pytest.mark.parametrize("at", [3, 12])  # a parameter's hook (installed with the pass), a module output's (forward)
def test_ctrl_c_right_after_a_tensor_hook_is_hung_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch, at: int
) -> None:
    from interrupt_harness import differences, model_and_batch, state_of
    from test_interrupt import _ctrl_c

    import ampdoctor
    from ampdoctor.capture import hooks

    model, batch = model_and_batch(blocks=2)
    before = state_of(model)
    original, calls = hooks.hang_tensor_hook, [0]

    def hang(*args, **kwargs):  # type: ignore[no-untyped-def]
        entry = original(*args, **kwargs)
        calls[0] += 1
        if calls[0] == at:
            _ctrl_c()  # the hook is on the tensor, not yet in the recorder's list
        return entry

    monkeypatch.setattr(hooks, "hang_tensor_hook", hang)
    # Python's own SIGINT handler, as in a terminal (a run started in the background inherits SIGINT ignored)
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            ampdoctor.diagnose(model, batch, device_type="cpu", progress=False)
    finally:
        signal.signal(signal.SIGINT, handler)
    monkeypatch.undo()
    assert calls[0] >= at
    assert differences(before, state_of(model)) == []


class SharedThenWritten(nn.Module):
    """Two children register one shared buffer; a third child's buffer is written through a plain attribute that
    aliases it (numpy: no torch op), so the user's own tensor changes and only the fingerprints can tell."""

    def __init__(self) -> None:
        super().__init__()
        shared = torch.ones(2)
        self.a, self.b, self.c = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
        self.a.register_buffer("shared", shared)
        self.b.register_buffer("shared", shared)
        self.c.register_buffer("target", torch.zeros(2))
        self.__dict__["alias"] = self.c.target  # not a registered buffer: the pass does not swap it
        self.done = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.done:
            self.done = True
            self.__dict__["alias"].numpy()[0] = 7.0
        return self.c(self.b(self.a(x)))


def test_a_changed_buffer_is_named_by_its_own_qualified_name_after_a_shared_one() -> None:
    _, (note,) = _not_restored_notes(SharedThenWritten(), torch.randn(2, 2))
    assert note.startswith("buffer c.target changed during the diagnosis")
