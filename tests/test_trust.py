"""Never harm, never lie: the user's state and pending backward stay intact, no false HEALTHY, no lost report.

Each test reproduces a case that went wrong before (issue 10), then asserts the right answer.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_untouched, constant_linear, snapshot
from torch import nn

import ampdoctor
from ampdoctor.errors import InvalidInput

FP16 = torch.float16


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# -- 1. state: parameters written by a forward, and a backward the user built before diagnose ---------------


class ClampsItsWeight(nn.Module):
    """Clamps its own weight in place in every forward (a "weight constraint" written as in-place code)."""

    def __init__(self, through_data: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.through_data = through_data
        with torch.no_grad():
            self.lin.weight.copy_(torch.linspace(-3, 3, 64).reshape(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.through_data:
            self.lin.weight.data.clamp_(-1, 1)  # a write the version counter does not see
        else:
            with torch.no_grad():
                self.lin.weight.clamp_(-1, 1)
        return self.lin(x).relu() * self.lin.weight.sum()


def _bert() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=3, attn_implementation="eager",
    )
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    return transformers.BertForSequenceClassification(config), {"input_ids": ids, "labels": torch.tensor([0, 2])}


def _loss_of(out: Any) -> torch.Tensor:
    return out.loss if hasattr(out, "loss") else out.float().square().mean()


def _models() -> dict[str, Callable[[], tuple[nn.Module, Any]]]:
    def batchnorm() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).train(), torch.randn(6, 8)

    def embedding_max_norm() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        emb = nn.Embedding(20, 4, max_norm=1.0)
        with torch.no_grad():
            emb.weight.mul_(3)  # rows far above max_norm: every looked-up row is renormalised in place
        return nn.Sequential(emb, nn.Flatten(), nn.Linear(12, 2)), torch.tensor([[1, 5, 9], [2, 5, 19]])

    def clamp() -> tuple[nn.Module, Any]:
        return ClampsItsWeight(through_data=False), torch.randn(3, 8)

    def clamp_data() -> tuple[nn.Module, Any]:
        return ClampsItsWeight(through_data=True), torch.randn(3, 8)

    return {
        "batchnorm": batchnorm,
        "embedding_max_norm": embedding_max_norm,
        "clamp": clamp,
        "clamp_through_data": clamp_data,
        "bert": _bert,
    }


def _call(model: nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, dict) else model(batch)


@pytest.mark.parametrize("name", list(_models()))
def test_a_pending_backward_runs_after_diagnose_with_identical_gradients(name: str) -> None:
    model, batch = _models()[name]()
    twin = copy.deepcopy(model)
    results = []
    for m, with_diagnose in ((twin, False), (model, True)):
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=FP16):
            loss = _loss_of(_call(m, batch))  # the user's forward: a graph waiting for its backward
        if with_diagnose:
            before = snapshot(m)
            ampdoctor.diagnose(m, batch, loss_fn=lambda out, _: _loss_of(out), device_type="cpu")
            assert_untouched(m, before)  # parameters (written in place or not) and buffers as they were
        loss.backward()  # used to fail: "modified by an inplace operation"
        results.append({n: _bits(p.grad) for n, p in m.named_parameters() if p.grad is not None})
        results.append({n: _bits(b) for n, b in m.named_buffers()})
    assert results[0] == results[2] and results[1] == results[3]


def test_a_forward_that_renormalises_the_embedding_gives_the_same_report_twice() -> None:
    model, batch = _models()["embedding_max_norm"]()
    before = snapshot(model)
    first = ampdoctor.diagnose(model, batch, device_type="cpu")
    second = ampdoctor.diagnose(model, batch, device_type="cpu")
    assert first == second
    assert_untouched(model, before)
    assert any("writes parameters in place (0.weight)" in n for n in first.run.notes)


# -- 2. activation checkpointing ---------------------------------------------------------------------------


class Checkpointed(nn.Module):
    """Three blocks, each under activation checkpointing; the last one's backward overflows at scale 65536.

    Forward: block outputs stay small. Backward of out.sum(): the last linear's input gradient is 64 * 20 * S =
    1280 * S per value: inf in float16 from S = 64 (81920), finite at 32.
    """

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(
            [nn.Sequential(constant_linear(64, 64, 1e-3), nn.ReLU()) for _ in range(2)]
            + [nn.Sequential(constant_linear(64, 64, 20.0))]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_gradients_are_captured_with_and_without_reentrant(reentrant: bool) -> None:
    model = Checkpointed(reentrant)
    x = torch.full((4, 64), 1e-3, requires_grad=True)  # reentrant checkpointing needs an input with grad
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)  # the user's accumulated gradients: must survive the .backward() path
    before = snapshot(model)
    report = ampdoctor.diagnose(model, x, loss_fn=lambda out, _: out.float().sum(), device_type="cpu")
    assert report.verdict == "scale_overflow", str(report)  # used to be HEALTHY with use_reentrant=True
    assert report.findings.scale is not None and report.findings.scale.largest_finite_scale == 32.0
    assert report.backward_origin is not None and report.backward_origin.module == "blocks.2.0"
    assert [c.label for c in report.trace.calls] == [
        "<root>", "blocks.0", "blocks.0.0", "blocks.0.1", "blocks.1", "blocks.1.0", "blocks.1.1",
        "blocks.2", "blocks.2.0",
    ]  # re-runs are not new calls
    assert report.findings.not_captured == ()
    assert_untouched(model, before)
    assert x.grad is None


def test_a_reentrant_checkpoint_whose_input_needs_no_grad_never_trains_and_is_said() -> None:
    model = Checkpointed(reentrant=True)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        report = ampdoctor.diagnose(model, torch.full((4, 64), 1e-3), loss_fn=lambda out, _: out.float().sum() * 0,
                                    device_type="cpu")
    assert not report.run.backward_checked  # the checkpoints' outputs need no grad: nothing to back-propagate
    warning = next(w for w in report.findings.warnings if "never train" in w)
    assert warning.startswith("blocks.0.0.weight, blocks.1.0.weight, blocks.2.0.weight require grad but got no")


# -- 3. device honesty ------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA (the case under test)")
def test_cuda_autocast_without_a_gpu_is_never_reported_healthy_in_float32() -> None:
    model = nn.Sequential(constant_linear(16, 16, 5000.0))  # overflows in float16: 16 * 5000 = 80000
    report = ampdoctor.diagnose(model, torch.ones(2, 16), device_type="cuda")  # emulates CUDA's policy here
    assert report.verdict == "overflow" and report.run.policy == "cuda_emulated"
    with pytest.raises(InvalidInput, match="no CUDA device"):  # torch's own autocast('cuda') would be off
        ampdoctor.diagnose(model, torch.ones(2, 16), device_type="cuda", policy="native")


def test_autocast_that_changes_nothing_is_not_reported_on() -> None:
    model = nn.Sequential(nn.LayerNorm(8), nn.ReLU())  # no op that CPU autocast runs in float16
    x = torch.randn(2, 8)
    before = snapshot(model)
    with pytest.raises(InvalidInput, match="changed nothing: no module produced float16"):
        ampdoctor.diagnose(model, x, device_type="cpu")
    assert_untouched(model, before)


# -- 4. no backward, said ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["frozen", "detached", "backward_false"])
def test_no_gradient_checked_is_said_in_the_verdict_line(case: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    loss_fn = None
    if case == "frozen":
        model.requires_grad_(False)
    if case == "detached":
        loss_fn = lambda out, _: out.float().sum().detach()  # noqa: E731
    report = ampdoctor.diagnose(model, torch.ones(2, 4), loss_fn=loss_fn, backward=case != "backward_false",
                                device_type="cpu")
    assert report.verdict == "healthy" and not report.run.backward_checked
    first = str(report).splitlines()[0]
    assert first == "ampdoctor: HEALTHY (forward only: no gradient was checked)"
    reason = {"frozen": "all frozen", "detached": "detached", "backward_false": "backward=False"}[case]
    assert reason in report.run.backward_note and reason in str(report).splitlines()[2]
    assert "surrogate" not in str(report)


# -- 6. degrade, never lose the report --------------------------------------------------------------------


class Float16Only(nn.Module):
    """A fused float16 kernel stand-in (flash-attention style): refuses any other dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float16:
            raise RuntimeError(f"Float16Only supports float16 inputs only, got {x.dtype}")
        return x * 2


def test_a_float16_only_module_costs_the_float32_passes_not_the_report() -> None:
    # boom overflows (16 * 5000 = 80000); its float32 fallback hands float32 to the float16-only module.
    model = nn.Sequential()
    model.add_module("pre", constant_linear(16, 16, 1 / 16))
    model.add_module("boom", constant_linear(16, 16, 5000.0))
    model.add_module("fused", Float16Only())
    before = snapshot(model)
    report = ampdoctor.diagnose(model, torch.ones(2, 16), device_type="cpu", reference=True)
    assert report.verdict == "overflow" and report.forward_origin is not None
    assert report.forward_origin.module == "boom"
    failed = {p.purpose for p in report.run.passes if p.status == "failed"}
    assert "survey with float32 references" in failed and "verification" in failed
    fallback = next(r for r in report.recommendations if r.action == "fp32_fallback")
    assert not fallback.verified and "Float16Only supports float16 inputs only" in fallback.evidence
    assert "optional pass(es) failed" in str(report)
    assert_untouched(model, before)


Case = tuple[nn.Module, torch.Tensor, Callable[[Any, Any], torch.Tensor]]


def _harmless_scale_overflow() -> Case:
    # big's input gradient is 1280 * scale: finite up to scale 32, so the survey at 65536 is non-finite.
    model = nn.Sequential()
    model.add_module("pre", constant_linear(64, 64, 1e-4))
    model.add_module("big", constant_linear(64, 64, 20.0))
    return model, torch.full((4, 64), 1e-3), lambda out, _: out.float().sum()


def _forward_overflow() -> Case:
    # 16 * 5000 = 80000: inf in float16; the fallback and bfloat16 recommendations are verified by re-runs.
    model = nn.Sequential(constant_linear(16, 16, 5000.0), nn.Linear(16, 4))
    return model, torch.ones(2, 16), lambda out, _: out.float().mean()


def _healthy() -> Case:
    # The loss gradient reaching the output is 65536 / 8 = 8192 per value: finite in float16, and so is the rest.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, torch.randn(4, 8) * 1e-3, lambda out, _: out.float().mean()


@pytest.mark.parametrize(
    ("purpose", "make"),
    [
        ("scale probe", _harmless_scale_overflow),
        ("detail and op zoom", _harmless_scale_overflow),
        ("underflow reference", _healthy),
        ("loss-scale window", _healthy),
        ("verification", _forward_overflow),
    ],
)
def test_out_of_memory_in_an_optional_pass_is_recorded(
    purpose: str, make: Callable[[], Case], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ampdoctor.capture.session as api

    real_run, real_stage = api.run_pass, api.Session.stage
    current = [""]

    def failing(spec: Any, scale: float, *args: Any, **kwargs: Any) -> Any:
        if current[0] == purpose:
            raise torch.OutOfMemoryError("injected: out of memory")
        return real_run(spec, scale, *args, **kwargs)

    @contextlib.contextmanager
    def stage(self: Any, name: str) -> Iterator[None]:
        before, current[0] = current[0], name
        try:
            with real_stage(self, name):
                yield
        finally:
            current[0] = before

    monkeypatch.setattr(api, "run_pass", failing)
    monkeypatch.setattr(api.Session, "stage", stage)
    model, x, loss_fn = make()
    before = snapshot(model)
    report = ampdoctor.diagnose(model, x, loss_fn=loss_fn, device_type="cpu")
    failed = [p for p in report.run.passes if p.status == "failed"]
    assert failed and {p.purpose for p in failed} == {purpose}
    assert failed[0].reason == "OutOfMemoryError: injected: out of memory"
    assert f"{purpose} (" in str(report)  # the text report lists the failed pass
    if purpose == "scale probe":
        assert report.findings.scale is None and report.verdict == "overflow"  # the survey alone: non-finite
    elif make is _harmless_scale_overflow:
        assert report.verdict == "scale_overflow" and report.findings.scale is not None
    if purpose == "detail and op zoom":
        assert report.trace.detailed is False  # the report stands on the survey
    if purpose == "underflow reference":
        assert report.findings.underflow is None
    if purpose == "loss-scale window":
        assert report.findings.window is None
    if purpose == "verification":
        assert report.verdict == "overflow"
        checked = [r for r in report.recommendations if r.action == "fp32_fallback"]
        assert checked and not any(r.verified for r in checked)
        assert "the verification re-run failed (OutOfMemoryError" in checked[0].evidence
    assert_untouched(model, before)


# -- 7. environments ----------------------------------------------------------------------------------------


def test_the_users_anomaly_mode_stays_on_and_does_not_break_the_diagnosis() -> None:
    model = nn.Sequential()
    model.add_module("pre", constant_linear(64, 64, 1e-4))
    model.add_module("big", constant_linear(64, 64, 2000.0))  # backward overflows even at scale 1
    with torch.autograd.detect_anomaly(check_nan=True):
        report = ampdoctor.diagnose(model, torch.ones(4, 64), loss_fn=lambda out, _: out.float().sum(),
                                    device_type="cpu")
        assert torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()
    assert report.verdict == "overflow" and report.backward_origin is not None
    assert report.backward_origin.module == "big"


def test_inside_inference_mode() -> None:
    model = nn.Sequential(constant_linear(16, 16, 5000.0))
    with torch.inference_mode():
        x = torch.ones(2, 16)  # an inference tensor
        report = ampdoctor.diagnose(model, x, device_type="cpu")
        assert torch.is_inference_mode_enabled()
    assert report.verdict == "overflow" and report.forward_origin is not None and report.run.backward_checked


def test_torchscript_lazy_and_empty_inputs_get_one_clear_error() -> None:
    scripted = torch.jit.script(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(InvalidInput, match="TorchScript"):
        ampdoctor.diagnose(scripted, torch.ones(2, 4), device_type="cpu")
    lazy = nn.Sequential(nn.LazyLinear(4)).eval()
    with pytest.raises(InvalidInput, match="uninitialized lazy parameter"):
        ampdoctor.diagnose(lazy, torch.ones(2, 4), device_type="cpu")
    assert not any(m.training for m in lazy.modules())
    for empty in (torch.ones(0, 4), (), {}, (torch.ones(0, 4),)):
        with pytest.raises(InvalidInput, match="the batch is empty"):
            ampdoctor.diagnose(nn.Linear(4, 4), empty, device_type="cpu")


def test_float8_weights_are_measured_not_refused() -> None:
    class Float8Weight(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.full((4, 4), 0.5).to(torch.float8_e4m3fn), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, self.weight.float())

    model = nn.Sequential(Float8Weight(), nn.Linear(4, 2))
    report = ampdoctor.diagnose(model, torch.ones(2, 4), device_type="cpu")
    (param,) = next(m for m in report.modules if m.name == "0").params
    assert param.stats.dtype == "float8_e4m3fn" and param.stats.max == 0.5 and param.stats.is_finite


# -- cases an adversarial review found --------------------------------------------------------------------


def test_a_neginf_in_the_data_is_the_batch_not_the_first_layer() -> None:
    # log-mel of silence: -inf in the features. A Linear mixes it into NaN; the cause is the batch.
    x = torch.ones(2, 4)
    x[0, 1] = float("-inf")
    report = ampdoctor.diagnose(nn.Sequential(nn.Linear(4, 4)), x, device_type="cpu")
    origin = report.forward_origin
    assert origin is not None and origin.module == "<batch>" and origin.tensor == "batch"
    assert report.recommendations[0].action == "fix_batch"


def test_a_result_object_ampdoctor_walks_and_no_false_finite_claim() -> None:
    class Box:  # a plain result object, as torch_geometric Data or detectron2 Instances
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    class Head(nn.Module):
        def forward(self, x: torch.Tensor) -> Box:
            return Box(torch.log(x - x))  # -inf made by the head itself

    model = nn.Sequential()
    model.add_module("lin", nn.Linear(4, 4))
    model.add_module("head", Head())
    report = ampdoctor.diagnose(model, torch.ones(2, 4), loss_fn=lambda out, _: out.t.float().mean(),
                                device_type="cpu")
    origin = report.forward_origin
    assert origin is not None and origin.module == "head" and origin.tensor == "out.t"


def test_devices_without_autocast_get_a_clear_error() -> None:
    for device in ("meta", "tpu"):
        with pytest.raises(InvalidInput, match=f"device_type='{device}'"):
            ampdoctor.diagnose(nn.Linear(4, 4), torch.ones(2, 4), device_type=device)


def test_a_weight_beyond_the_float16_range_is_not_called_near_it() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    with torch.no_grad():
        model[0].weight[0, 0] = 1e6
    report = ampdoctor.diagnose(model, torch.zeros(2, 4), device_type="cpu")
    assert not any(n.tensor.startswith("param:") for n in report.findings.near_limit)
    assert any("0.weight (|x| up to 1e+06)" in w and "beyond the float16 range" in w for w in report.findings.warnings)


@pytest.mark.parametrize("outer", [torch.float16, torch.bfloat16])
def test_diagnose_inside_the_users_own_autocast_region_gives_the_same_report(outer: torch.dtype) -> None:
    # "One added line, anywhere in the loop" puts diagnose inside `with torch.autocast(...)`.
    model = nn.Sequential(constant_linear(16, 16, 5000.0), nn.Linear(16, 4))
    x = torch.ones(2, 16)
    outside = ampdoctor.diagnose(model, x, device_type="cpu")
    with torch.autocast("cpu", dtype=outer):
        model(x).float().sum()  # the user's forward fills the weight-cast cache
        inside = ampdoctor.diagnose(model, x, device_type="cpu")
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == outer  # still the user's
    assert inside == outside and not [p for p in inside.run.passes if p.status != "ran"]


def test_a_forward_that_assigns_a_new_parameter_or_writes_through_aten_ops_is_undone() -> None:
    class Reassigns(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.lin.weight = nn.Parameter(self.lin.weight.detach() * 0.5)  # a new object, half the values
            return self.lin(x)

    class AtenWrite(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                torch.ops.aten.mul_.Tensor(self.lin.weight, torch.tensor(0.5))
            return self.lin(x)

    for model in (Reassigns(), AtenWrite()):
        weight = model.lin.weight
        before = snapshot(model)
        report = ampdoctor.diagnose(model, torch.ones(2, 4), device_type="cpu")
        assert model.lin.weight is weight  # the original object, with its values
        assert_untouched(model, before)
        assert not any("NOT restored" in n for n in report.run.notes)
