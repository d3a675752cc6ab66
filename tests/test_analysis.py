"""Analysis on hand-built traces: no forward pass, no torch in the code under test."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Optional

from ampdoctor.analysis import (
    ScaleFinding,
    ScaleProbe,
    analyze,
    backward_origin,
    classify,
    forward_origin,
    headroom_bits,
    near_limit,
)
from ampdoctor.analysis.underflow import lost_gradients
from ampdoctor.records import (
    FormatLimits,
    GradEvent,
    ModuleCall,
    ModuleInfo,
    OpFinding,
    ParamRecord,
    PassTrace,
    TensorRecord,
    TensorStats,
)

FP16 = FormatLimits("float16", 65504.0, 2.0**-14, 2.0**-24, 65520.0, 2.0**-25)
INF, NAN = math.inf, math.nan


def s(low: float, high: float, zeros: int = 0, dtype: str = "float16", shape: tuple[int, ...] = (4,)) -> TensorStats:
    return TensorStats(dtype=dtype, shape=shape, min=low, max=high, zero_count=zeros)


FINE = s(-1.0, 1.0)
OVER = s(-1.0, INF)
NANS = s(NAN, NAN)
MASK = s(-INF, 0.0)


def rec(stats: TensorStats, path: str = "args[0]", producer: Optional[int] = None, ref: int = -1) -> TensorRecord:
    return TensorRecord(path, stats, requires_grad=True, producer=producer, ref=ref)


def call(
    index: int, module: str, parent: Optional[int], end: int, inputs: list[TensorRecord], out: TensorStats, n: int = 0
) -> ModuleCall:
    return ModuleCall(index, module, n, "M", parent, end, inputs, [TensorRecord("out", out, True, None, 100 + index)])


def trace(calls: list[ModuleCall], events: Optional[list[GradEvent]] = None, **kw) -> PassTrace:  # type: ignore[no-untyped-def]
    root_out = calls[0].outputs[0].stats if calls else FINE
    defaults = dict(
        scale=1.0,
        detailed=False,
        calls=calls,
        grad_events=events or [],
        batch=[rec(FINE, "batch")],
        output=[TensorRecord("out", root_out)],
        loss=s(1.0, 1.0, dtype="float32", shape=()),
        backward_ran=bool(events),
    )
    defaults.update(kw)
    return PassTrace(**defaults)  # type: ignore[arg-type]


# -- forward origin ----------------------------------------------------------------------------------------


def test_parent_own_code_is_the_origin_not_the_child_that_receives_nan() -> None:
    # root(0) -> attn(1) -> [qkv(2) finite, proj(3) gets NaN]; attn's own q @ k.T made the NaN.
    calls = [
        call(0, "", None, 3, [rec(FINE, ref=1)], NANS),
        call(1, "attn", 0, 2, [rec(FINE, ref=1)], NANS),
        call(2, "attn.qkv", 1, 0, [rec(FINE, ref=1)], FINE),
        call(3, "attn.proj", 1, 1, [rec(NANS, ref=2)], NANS),
    ]
    origin = forward_origin(trace(calls))
    assert origin is not None and origin.module == "attn" and origin.exact


def test_first_creator_in_completion_order_wins() -> None:
    calls = [
        call(0, "", None, 3, [rec(FINE)], OVER),
        call(1, "a", 0, 0, [rec(FINE)], FINE),
        call(2, "b", 0, 1, [rec(FINE, producer=1)], OVER),  # creator
        call(3, "c", 0, 2, [rec(OVER, producer=2)], OVER),  # propagation
    ]
    t = trace(calls)
    origin = forward_origin(t)
    assert origin is not None and origin.module == "b"
    result = analyze(t, [], FP16)
    assert result.verdict == "overflow" and result.propagation == ("c", "<root>")


def test_mask_input_does_not_make_inputs_non_finite() -> None:
    calls = [
        call(0, "", None, 1, [rec(FINE), rec(MASK, "kwargs['mask']")], OVER),
        call(1, "attn", 0, 0, [rec(FINE), rec(MASK, "kwargs['mask']")], OVER),
    ]
    origin = forward_origin(trace(calls))
    assert origin is not None and origin.module == "attn"


def test_minus_inf_produced_by_an_earlier_call_is_not_a_mask() -> None:
    calls = [
        call(0, "", None, 2, [rec(FINE)], MASK),
        call(1, "a", 0, 0, [rec(FINE)], MASK),  # made -inf from finite inputs: the creator
        call(2, "b", 0, 1, [rec(MASK, producer=1)], MASK),
    ]
    origin = forward_origin(trace(calls))
    assert origin is not None and origin.module == "a"


def test_loss_is_the_origin_when_the_output_is_finite() -> None:
    t = trace([call(0, "", None, 0, [rec(FINE)], FINE)], loss=s(NAN, NAN, dtype="float32", shape=()))
    origin = forward_origin(t)
    assert origin is not None and origin.module == "<loss>" and origin.label == "<loss>"
    assert analyze(t, [], FP16).verdict == "nan"


def test_non_finite_batch_stops_there() -> None:
    t = trace([call(0, "", None, 0, [rec(NANS)], NANS)], batch=[rec(NANS, "batch")])
    origin = forward_origin(t)
    assert origin is not None and origin.module == "<batch>"


def test_classify_by_op() -> None:
    def op(name: str, posinf: int, neginf: int, nan: int) -> OpFinding:
        return OpFinding(name, "m", 0, ["float16"], [1.0], "float16", nan, posinf, neginf)

    assert classify(NANS, op("aten::bmm", 3, 0, 0)) == "overflow"  # inf made, NaN after it (softmax)
    assert classify(NANS, op("aten::log", 0, 1, 0)) == "nan"  # a pole, not a range overflow
    assert classify(NANS, op("aten::div", 0, 0, 2)) == "nan"  # 0/0
    assert classify(OVER, None) == "overflow" and classify(NANS, None) == "nan"


# -- backward origin ---------------------------------------------------------------------------------------


def ev(order: int, kind: str, stats: TensorStats, call_index: Optional[int] = None, param: Optional[str] = None,
       path: str = "out") -> GradEvent:
    return GradEvent(order, kind, stats, call_index, path if kind != "param" else "grad", param)


def _three_layer_calls() -> list[ModuleCall]:
    return [
        call(0, "", None, 3, [rec(FINE, ref=1)], FINE),
        call(1, "a", 0, 0, [rec(FINE, ref=1)], FINE),
        call(2, "b", 0, 1, [rec(FINE, producer=1, ref=101)], FINE),
        call(3, "c", 0, 2, [rec(FINE, producer=2, ref=102)], FINE),
    ]


MODULES = [
    ModuleInfo("", "Seq"),
    ModuleInfo("a", "Linear", [ParamRecord("a.weight", FINE)]),
    ModuleInfo("b", "Linear", [ParamRecord("b.weight", FINE)]),
    ModuleInfo("c", "Linear", [ParamRecord("c.weight", FINE)]),
]


def test_backward_origin_is_the_call_whose_input_gradient_goes_inf() -> None:
    # Backward order: root out, c out, c in (=b out), c weight, b in (inf), b weight, a out (inf) ...
    events = [
        ev(0, "output", FINE, 0),
        ev(1, "output", FINE, 3),
        ev(2, "input", FINE, 3, path="args[0]"),
        ev(3, "output", FINE, 2),
        ev(4, "param", FINE, param="c.weight"),
        ev(5, "input", OVER, 2, path="args[0]"),
        ev(6, "output", OVER, 1),
        ev(7, "param", FINE, param="b.weight"),
        ev(8, "param", NANS, param="a.weight"),
    ]
    origin = backward_origin(trace(_three_layer_calls(), events), MODULES)
    assert origin is not None and origin.module == "b" and origin.tensor == "grad:args[0]"


def test_backward_origin_by_parameter_gradient() -> None:
    events = [
        ev(0, "output", FINE, 0),
        ev(1, "output", FINE, 3),
        ev(2, "param", OVER, param="c.weight"),
        ev(3, "output", FINE, 2),
        ev(4, "output", FINE, 1),
    ]
    origin = backward_origin(trace(_three_layer_calls(), events), MODULES)
    assert origin is not None and origin.module == "c" and origin.tensor == "grad:c.weight"


def test_backward_origin_outside_the_model() -> None:
    events = [ev(0, "output", OVER, 0), ev(1, "output", OVER, 3)]
    origin = backward_origin(trace(_three_layer_calls(), events), MODULES)
    assert origin is not None and origin.module == "<loss>"


def test_shared_input_gradient_goes_to_the_common_parent() -> None:
    # b and c both read a's output (ref 101); its summed gradient is inf: neither sibling can be blamed alone.
    calls = [
        call(0, "", None, 3, [rec(FINE, ref=1)], FINE),
        call(1, "a", 0, 0, [rec(FINE, ref=1)], FINE),
        call(2, "b", 0, 1, [rec(FINE, producer=1, ref=101)], FINE),
        call(3, "c", 0, 2, [rec(FINE, producer=1, ref=101)], FINE),
    ]
    events = [
        ev(0, "output", FINE, 0),
        ev(1, "output", FINE, 3),
        ev(2, "output", FINE, 2),
        ev(3, "input", OVER, 3, path="args[0]"),
        ev(4, "input", OVER, 2, path="args[0]"),
        ev(5, "output", OVER, 1),
    ]
    origin = backward_origin(trace(calls, events), MODULES)
    assert origin is not None and origin.module == ""


# -- headroom, underflow, verdicts -------------------------------------------------------------------------


def test_headroom_bits() -> None:
    assert headroom_bits(65504.0, FP16) == 0.0
    assert headroom_bits(65504.0 / 8, FP16) == 3.0
    assert headroom_bits(0.0, FP16) == math.inf
    assert headroom_bits(None, FP16) is None


def test_near_limit_lists_outputs_within_one_bit() -> None:
    calls = [call(0, "", None, 1, [rec(FINE)], s(-1, 40000.0)), call(1, "x", 0, 0, [rec(FINE)], s(-1, 30000.0))]
    found = near_limit(trace(calls), [], FP16)
    assert [(n.module, round(n.headroom_bits, 3)) for n in found] == [("", round(math.log2(65504 / 40000), 3))]


def test_lost_gradients_counts_against_the_best_reference() -> None:
    def pgrad(nonzero: int, finite: bool = True) -> GradEvent:
        stats = s(-1.0, 1.0 if finite else INF, zeros=100 - nonzero, dtype="float32", shape=(100,))
        return GradEvent(0, "param", stats, None, "grad", "a.weight")

    used = trace(_three_layer_calls(), [pgrad(90)])
    ref = trace(_three_layer_calls(), [pgrad(99)])
    broken = trace(_three_layer_calls(), [pgrad(100, finite=False)])  # non-finite passes never count
    found = lost_gradients(used, [ref, broken], MODULES, "test")
    assert found is not None and (found.lost, found.reference_nonzero) == (9, 99)
    assert found.spots[0].module == "a" and math.isclose(found.share, 9 / 99)
    assert analyze(used, MODULES, FP16, underflow=found).verdict == "underflow"  # 9.1 % >= 5 %


def test_scale_overflow_verdict_and_harmlessness() -> None:
    events = [ev(0, "output", FINE, 0), ev(1, "output", FINE, 3), ev(2, "param", OVER, param="c.weight")]
    t = trace(_three_layer_calls(), events)
    harmless = ScaleFinding(65536.0, [ScaleProbe(1.0, True), ScaleProbe(32.0, True)], 32.0, 0.001, 64.0)
    assert harmless.harmless
    assert analyze(t, MODULES, FP16, scale=harmless).verdict == "scale_overflow"
    costly = ScaleFinding(65536.0, [ScaleProbe(1.0, True)], 1.0, 0.2, 2.0)
    result = analyze(t, MODULES, FP16, scale=costly)
    assert result.verdict == "scale_overflow" and not costly.harmless
    assert "useless range" in result.warnings[0]
    defect = ScaleFinding(65536.0, [ScaleProbe(1.0, False)], None, None, 1.0)
    assert analyze(t, MODULES, FP16, scale=defect).verdict == "overflow"


# -- no torch ----------------------------------------------------------------------------------------------


def test_analysis_and_report_import_no_torch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import ampdoctor
    from ampdoctor.demo import demo_loss, make_demo

    model, tokens, targets = make_demo()
    report = ampdoctor.diagnose(model, tokens, loss_fn=lambda out, _: demo_loss(out, targets))
    path = tmp_path / "report.json"
    path.write_text(report.to_json())
    code = (
        "import sys, json\n"
        "sys.modules['torch'] = None  # any import of torch now fails loudly\n"
        "import ampdoctor.analysis, ampdoctor.report.text\n"
        "from ampdoctor import Report\n"
        f"r = Report.from_json(open({str(path)!r}).read())\n"
        "text = str(r)\n"
        "assert r.forward_origin.module == 'blocks.1.attn', r.forward_origin\n"
        "print(json.dumps({'verdict': r.verdict, 'first': text.splitlines()[0]}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result == {"verdict": "overflow", "first": "ampdoctor: OVERFLOW - forward origin: blocks.1.attn"}
