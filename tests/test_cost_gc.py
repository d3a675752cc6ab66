"""The cyclic garbage collector is off while diagnose runs (records by the hundred thousand on a model of many
modules), and the caller's setting is back afterwards, enabled or not, also when the model raises."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import ampdoctor


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


@pytest.mark.parametrize("enabled", [True, False])
def test_gc_off_during_diagnose_and_back_after(enabled: bool) -> None:
    seen: list[bool] = []

    def loss_fn(out: torch.Tensor, _batch: object) -> torch.Tensor:
        return out.float().pow(2).mean()

    def progress(purpose: str, index: int, total: object) -> None:  # called as each pass starts, between passes
        seen.append(gc.isenabled())

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        report = ampdoctor.diagnose(_model(), torch.randn(3, 4), loss_fn=loss_fn, progress=progress)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
    assert len(seen) >= 2 and not any(seen)  # off between passes too, not only inside each
    assert str(report.verdict) == "healthy"


def test_gc_back_after_the_model_raises() -> None:
    def loss_fn(out: torch.Tensor, _batch: object) -> torch.Tensor:
        raise RuntimeError("boom in the loss")

    assert gc.isenabled()
    with pytest.raises(ampdoctor.AmpDoctorError):
        ampdoctor.diagnose(_model(), torch.randn(3, 4), loss_fn=loss_fn, progress=False)
    assert gc.isenabled()


@pytest.mark.parametrize("failing", [False, True], ids=["healthy", "demo-overflow"])
def test_a_pass_leaves_nothing_for_the_cyclic_collector(monkeypatch: pytest.MonkeyPatch, failing: bool) -> None:
    """With the collector off during a diagnosis, what a pass made must go by reference counting as soon as the
    pass is done: a reference cycle through a pass's recorder (its instance-forward wrappers calling its bound
    methods) kept every pass's per-call records alive to the end of the diagnosis (70,000 objects on a model of
    10,000 modules, part of the peak memory, and one collection's time when the caller's setting came back)."""
    import weakref

    from ampdoctor.capture import call_wrappers, hidden, hooks, passes, stats
    from ampdoctor.demo import demo_loss, make_demo

    made: list[weakref.ref[object]] = []
    for cls in (hooks.Recorder, stats.StatsCollector, hidden.HiddenWatch, call_wrappers.PassForwards, passes._Step):
        init = cls.__init__

        def counted(self: object, *args: object, _init=init, **kwargs: object) -> None:  # type: ignore[no-untyped-def]
            _init(self, *args, **kwargs)
            made.append(weakref.ref(self))

        monkeypatch.setattr(cls, "__init__", counted)
    if failing:
        model, batch, targets = make_demo()
        loss_fn = lambda out, _b: demo_loss(out, targets)  # noqa: E731
    else:
        model, batch = _model(), torch.randn(3, 4)
        loss_fn = lambda out, _b: out.float().pow(2).mean()  # noqa: E731
    was = gc.isenabled()
    gc.disable()
    try:
        report = ampdoctor.diagnose(model, batch, loss_fn=loss_fn, progress=False)
        alive = sorted({type(r()).__name__ for r in made if r() is not None})
    finally:
        (gc.enable if was else gc.disable)()
    assert str(report.verdict) == ("overflow" if failing else "healthy")
    assert len(made) >= 5  # every kind was made (a pass each at least)
    assert alive == []


def test_diagnoses_in_two_threads_at_once_give_the_collector_back() -> None:
    """The collector is process-wide: the second diagnosis to start saw it off (the first's pause), and putting
    back what it saw left it off for good once both were done."""
    import threading

    barrier = threading.Barrier(2, timeout=30)

    class Meets(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)
            self.met = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.met:  # both diagnoses are inside their first pass here, at the same time
                self.met = True
                barrier.wait()
            return self.lin(x)

    errors: list[BaseException] = []

    def run() -> None:
        try:
            ampdoctor.diagnose(Meets(), torch.randn(3, 4), loss_fn=lambda o, _b: o.float().mean(), progress=False)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    assert gc.isenabled()
    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert gc.isenabled()
