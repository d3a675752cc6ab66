"""Report round trip and schema, the demo command, fp32_fallback, one readback per pass, nothing left behind."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ampdoctor_frames_during, pass_spec, plain_amp_step, snapshot
from torch import nn

import ampdoctor
from ampdoctor.capture.options import PassOptions
from ampdoctor.capture.passes import run_pass
from ampdoctor.cli.main import main
from ampdoctor.demo import DEMO_ORIGIN, demo_loss, make_demo


@pytest.fixture(scope="module")
def demo_report() -> ampdoctor.Report:
    model, tokens, targets = make_demo()
    return ampdoctor.diagnose(model, tokens, loss_fn=lambda out, _: demo_loss(out, targets))


# -- report ------------------------------------------------------------------------------------------------


def test_demo_report_names_the_attention_and_its_matmul(demo_report: ampdoctor.Report) -> None:
    origin = demo_report.forward_origin
    assert demo_report.verdict == "overflow"
    assert origin is not None and origin.module == DEMO_ORIGIN and origin.class_name == "DemoAttention"
    assert origin.op is not None and origin.op.op == "aten::bmm"
    assert origin.op.location is not None and "q @ k.transpose" in origin.op.location.code
    assert "blocks.1.attn.proj" in demo_report.findings.propagation  # the child got NaN; it is not the origin
    assert demo_report.recommendations[0].modules == (DEMO_ORIGIN,)


def test_json_round_trip_and_schema(demo_report: ampdoctor.Report) -> None:
    text = demo_report.to_json()
    data = json.loads(text)  # strict JSON: non-finite floats are strings
    assert data["schema_version"] == "1.2"
    again = ampdoctor.Report.from_json(text)
    assert again.to_json() == text  # (== on the dataclasses is False: NaN != NaN)
    assert again.forward_origin is not None and again.forward_origin.label == DEMO_ORIGIN
    assert str(again) == str(demo_report)


def test_newer_schema_is_refused_clearly(demo_report: ampdoctor.Report) -> None:
    data = demo_report.to_dict()
    data["schema_version"] = "2.0"
    with pytest.raises(ampdoctor.AmpDoctorError, match="newer than this ampdoctor reads"):
        ampdoctor.Report.from_dict(data)
    with pytest.raises(ampdoctor.AmpDoctorError, match="not JSON"):
        ampdoctor.Report.from_json("{nope")
    with pytest.raises(ampdoctor.AmpDoctorError, match="not an ampdoctor report"):
        ampdoctor.Report.from_json('{"schema_version": "x"}')


def test_report_states_run_facts(demo_report: ampdoctor.Report) -> None:
    run = demo_report.run
    assert run.torch_version == torch.__version__ and run.device == "cpu"
    assert run.limits.dtype == "float16" and run.scale == 65536.0
    assert "CPU autocast" in run.autocast_note


# -- CLI -----------------------------------------------------------------------------------------------------


def test_demo_command_exits_0_and_prints_the_origin(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"ampdoctor: OVERFLOW - forward origin: {DEMO_ORIGIN}"


def test_demo_json_to_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    target = tmp_path / "r.json"
    assert main(["demo", "--format", "json", "-o", str(target)]) == 0
    assert ampdoctor.Report.from_json(target.read_text()).forward_origin.module == DEMO_ORIGIN  # type: ignore[union-attr]


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["no-such-command"]) == 2
    assert main([]) == 2
    assert main(["demo", "--dtype", "float64"]) == 2
    assert main(["--version"]) == 0
    assert "ampdoctor" in capsys.readouterr().out


def test_cli_error_is_one_line_on_stderr(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    assert main(["demo", "-o", str(tmp_path / "missing-dir" / "r.txt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ampdoctor: error: cannot write") and err.count("\n") == 1


# -- fp32_fallback -------------------------------------------------------------------------------------------


def test_fp32_fallback_fixes_the_demo_and_restores_the_model() -> None:
    model, tokens, targets = make_demo()
    attn = model.get_submodule(DEMO_ORIGIN)
    before = snapshot(model)
    handle = ampdoctor.fp32_fallback(model, [DEMO_ORIGIN])
    assert "forward" in attn.__dict__
    seen_dtypes: list[torch.dtype] = []
    hook = model.get_submodule("blocks.1.mlp.0").register_forward_hook(lambda m, i, o: seen_dtypes.append(o.dtype))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = demo_loss(model(tokens), targets)
    hook.remove()
    assert torch.isfinite(loss)
    assert seen_dtypes == [torch.float16]  # modules outside the fallback still run in float16
    handle.remove()
    assert "forward" not in attn.__dict__  # the class method shows through again
    after = snapshot(model)
    assert after.state == before.state and after.hook_counts == before.hook_counts
    report = ampdoctor.diagnose(model, tokens, loss_fn=lambda out, _: demo_loss(out, targets))
    assert report.verdict == "overflow"  # removed: the overflow is back


def test_fp32_fallback_context_manager_and_instance_forward() -> None:
    layer = nn.Linear(2, 2)

    def custom(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    layer.forward = custom  # type: ignore[method-assign]
    with ampdoctor.fp32_fallback(layer, [""]):
        with torch.autocast("cpu", dtype=torch.float16):
            out = layer(torch.ones(1, 2, dtype=torch.float16))
        assert out.dtype == torch.float32
    assert layer.forward is custom
    with pytest.raises(ampdoctor.AmpDoctorError, match="did you mean 'blocks.1.attn'"):
        ampdoctor.fp32_fallback(make_demo()[0], ["blocks.1.atn"])


# -- capture discipline ------------------------------------------------------------------------------------


def test_one_readback_per_pass_and_no_item_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(5)])
    counts = {"item": 0, "tolist": 0, "cpu": 0}
    order: list[str] = []

    def counting(name, original):  # type: ignore[no-untyped-def]
        def wrapper(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            counts[name] += 1
            order.append(name)
            return original(self, *args, **kwargs)

        return wrapper

    for name in counts:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    trace, _ = run_pass(pass_spec(model, torch.randn(4, 8)), 1024.0)
    # One copy to the host per pass; every conversion to Python numbers runs on that host copy afterwards.
    assert counts["item"] == 0 and counts["cpu"] == 1 and order[0] == "cpu" and counts["tolist"] >= 1
    assert len(trace.calls) == 1 + 5 + 10 and trace.backward_ran  # root, 5 Sequential, 5 Linear + 5 ReLU
    assert len([e for e in trace.grad_events if e.kind == "param"]) == 10


def test_survey_keeps_no_activation_alive() -> None:
    import gc
    import weakref

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    refs: list[weakref.ref[torch.Tensor]] = []
    hook = model[0].register_forward_hook(lambda m, i, o: refs.append(weakref.ref(o)))
    trace, _ = run_pass(pass_spec(model, torch.randn(4, 8)), 1.0, PassOptions(detailed=True))
    hook.remove()
    gc.collect()
    assert refs and all(r() is None for r in refs)
    assert trace.detailed


def test_no_ampdoctor_code_runs_after_diagnose() -> None:
    model, tokens, targets = make_demo()
    ampdoctor.diagnose(model, tokens, loss_fn=lambda out, _: demo_loss(out, targets))
    assert ampdoctor_frames_during(lambda: plain_amp_step(model, tokens)) == []
    # the same holds after a diagnose that failed inside the forward
    with pytest.raises(ampdoctor.AmpDoctorError):
        ampdoctor.diagnose(model, tokens.float())  # Embedding needs integer ids: the forward raises
    assert ampdoctor_frames_during(lambda: plain_amp_step(model, tokens)) == []


def test_demo_html_and_markdown(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from html.parser import HTMLParser

    page = tmp_path / "r.html"
    assert main(["demo", "--format", "html", "-o", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and DEMO_ORIGIN in text and "<script" not in text
    HTMLParser().feed(text)
    md = tmp_path / "r.md"
    assert main(["demo", "--format", "markdown", "-o", str(md)]) == 0
    assert md.read_text().startswith("## ampdoctor: OVERFLOW - forward origin: blocks.1.attn\n")


def test_the_gradient_hooks_keep_no_activation_alive_during_the_pass() -> None:
    import weakref

    class Scale(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2.0 + 1.0  # a result autograd does not save: freed at once in a plain step

    model = nn.Sequential(nn.Linear(8, 8), Scale(), Scale(), Scale())
    refs: list[weakref.ref[torch.Tensor]] = []
    for m in list(model)[1:3]:
        m.register_forward_hook(lambda mod, i, o: refs.append(weakref.ref(o)))
    alive: list[int] = []

    def loss_fn(out: torch.Tensor, _batch: torch.Tensor) -> torch.Tensor:
        alive.append(sum(r() is not None for r in refs))
        return out.float().mean()

    spec = pass_spec(model, torch.randn(4, 8))
    spec.loss_fn = loss_fn
    run_pass(spec, 1.0)
    assert alive == [0]  # the outputs of the first two Scale calls are gone before the backward


def test_lazy_buffers_filled_in_forward_are_undone() -> None:
    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("cache", None)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.cache is None:
                self.cache = torch.ones(4)  # filled lazily, like rotary-embedding caches
            self.register_buffer("extra", torch.zeros(1))  # and one that did not exist before
            return self.lin(x) * self.cache

    model = Cached()
    ampdoctor.diagnose(model, torch.ones(2, 4))
    assert model.cache is None and "extra" not in model._buffers
