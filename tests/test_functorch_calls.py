"""Code inside a ``torch.func`` transform (``vmap`` over ``functional_call``: model ensembles, per-sample gradients)
sees wrapped tensors whose values exist only inside the transform. The survey and the hidden-overflow watch leave
such calls and ops unmeasured (a statistic read after the transform raised "your tensor may have escaped" out of
``diagnose``), say so in the report's notes, and still name the module whose code the overflow leaves the
transform in."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

import ampdoctor

W = 8


def _diagnose(model: nn.Module, batch: torch.Tensor) -> ampdoctor.Report:
    return ampdoctor.diagnose(model, batch, device_type="cpu", progress=False, dtype=torch.float16)


def _transform_notes(report: ampdoctor.Report) -> list[str]:
    return [n for n in report.run.notes if "torch.func transform" in n]


class Ensemble(nn.Module):
    """Three members run as one by ``vmap`` over their stacked parameters (torch.func's model-ensembling recipe)."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.members = nn.ModuleList([nn.Linear(W, W) for _ in range(3)])
        with torch.no_grad():
            for m in self.members:
                m.weight.mul_(scale)
        self.head = nn.Linear(W, 2)
        # not a submodule: the recipe's stateless copy
        self.__dict__["base"] = copy.deepcopy(self.members[0]).to("meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params, buffers = stack_module_state(list(self.members))

        def one(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return functional_call(self.base, (p, b), (x,))

        y = vmap(one, in_dims=(0, 0, None))(params, buffers, x)
        return self.head(y.sum(0))


def test_a_vmapped_ensemble_is_diagnosed_and_the_transform_named_in_the_notes() -> None:
    torch.manual_seed(0)
    model = Ensemble()
    report = _diagnose(model, torch.randn(4, W))  # before: RuntimeError out of the statistics' read-back
    assert str(report.verdict) == "healthy"
    (note,) = _transform_notes(report)
    assert "op(s) ran inside a torch.func transform" in note
    assert [c.module for c in report.trace.calls] == ["", "head"]  # members run only through the stateless copy
    assert "forward" not in vars(model.head)


def test_an_overflow_made_inside_vmap_is_found_where_it_leaves_the_transform() -> None:
    torch.manual_seed(0)
    report = _diagnose(Ensemble(scale=1e4), torch.randn(4, W) * 100)
    assert str(report.verdict) == "overflow"
    assert report.forward_origin is not None and report.forward_origin.module == ""  # the root's code holds vmap
    assert _transform_notes(report)


class VmappedChild(nn.Module):
    """A submodule called by ``vmap`` itself (per-sample work): its call runs inside the transform."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(W, W)
        self.head = nn.Linear(W, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(vmap(self.inner)(x))


def test_a_module_called_by_vmap_is_not_measured_and_the_notes_count_it() -> None:
    torch.manual_seed(0)
    model = VmappedChild()
    report = _diagnose(model, torch.randn(4, 3, W))
    assert str(report.verdict) == "healthy"
    assert "inner" not in [c.module for c in report.trace.calls]
    (note,) = _transform_notes(report)
    assert note.startswith("1 module call(s) and ")
    assert "forward" not in vars(model.inner) and not model.inner._forward_hooks


def test_the_watch_leaves_a_module_called_by_vmap_unmeasured_and_keeps_watching() -> None:
    torch.manual_seed(0)
    model = VmappedChild()
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 3, W)
    with ampdoctor.watch(model, scaler, stats_every=1, save_bundle=False) as doctor:
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    report = doctor.report()
    # before: "watch hook error: RuntimeError: Batching rule not implemented for aten::aminmax.out"
    assert not [n for n in report.run.notes if "error" in n]
    assert all(set(step.out_abs_max) == {"", "head"} for step in report.steps)
    assert "forward" not in vars(model.inner) and "forward" not in vars(model.head)


class HidesInsideVmap(nn.Module):
    """An overflow made and hidden inside ``vmap`` (``r * 1e5`` clamped): the module's outputs stay finite."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y * vmap(lambda r: (r * self.factor).clamp(-1, 1))(y)


def test_a_healthy_verdict_with_unmeasured_transform_ops_says_how_far_it_goes() -> None:
    for factor in (2.0, 1e5):  # a hidden overflow inside the transform cannot be seen: the warning says so
        torch.manual_seed(0)
        report = ampdoctor.diagnose(HidesInsideVmap(factor), torch.randn(4, W), loss_fn=lambda o, _: o.float().mean(),
                                    dtype=torch.float16, progress=False)
        assert report.verdict == "healthy"
        (warning,) = [w for w in report.findings.warnings if w.startswith("healthy as far as measured: ")]
        assert "2 module call(s) and op(s) ran inside a torch.func transform" in warning
        assert report.trace.unmeasured == 2
