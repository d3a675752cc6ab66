"""report.to_dataframe(): one row per module call and tensor, statistics as columns."""

from __future__ import annotations

import math
import sys

import pandas as pd
import pytest
from notebook_reports import DEMO_ORIGIN, backward_report, healthy_report, long_report, overflow_report

from ampdoctor import AmpDoctorError
from ampdoctor.report import Report
from ampdoctor.report.frames import COLUMNS, STAT_COLUMNS, to_dataframe


def expected_counts(report: Report) -> dict[str, int]:
    trace = report.trace
    counts = {
        "input": sum(len(c.inputs) for c in trace.calls),
        "output": sum(len(c.outputs) for c in trace.calls),
        "param": sum(len(m.params) for m in report.modules),
    }
    for kind in ("output", "input", "param"):
        counts[f"grad_{kind}"] = sum(1 for e in trace.grad_events if e.kind == kind)
    return {k: v for k, v in counts.items() if v}


@pytest.mark.parametrize("make", [overflow_report, healthy_report, backward_report])
def test_one_row_per_call_and_tensor(make) -> None:  # type: ignore[no-untyped-def]
    report = make()
    frame = report.to_dataframe()
    assert list(frame.columns) == list(COLUMNS)
    assert frame["kind"].value_counts().to_dict() == expected_counts(report)
    assert len(frame) == sum(expected_counts(report).values())
    forward = frame[frame.section == "forward"]
    assert forward["call_index"].nunique() == len(report.trace.calls)
    assert (frame[frame.section == "backward"]["grad_order"].tolist()) == [e.order for e in report.trace.grad_events]


def test_demo_counts() -> None:
    """The demo: 24 calls, each with one input and one output; 29 parameters (2 blocks of 12, 5 outside)."""
    report = overflow_report()
    frame = to_dataframe(report)
    counts = frame["kind"].value_counts()
    assert counts["input"] == 24 and counts["output"] == 24
    assert counts["param"] == 29
    assert counts["grad_param"] == 29  # every parameter's gradient was seen
    outputs = frame[frame.kind == "output"]
    assert (~outputs["finite"].astype(bool)).sum() == 1 + len(report.findings.propagation)


def test_statistics_are_columns_matching_the_records() -> None:
    report = overflow_report()
    frame = to_dataframe(report)
    call = next(c for c in report.trace.calls if c.module == "blocks.1.attn.qkv")
    row = frame[(frame.kind == "output") & (frame.module == call.module)].iloc[0]
    stats = call.outputs[0].stats
    for name in STAT_COLUMNS:
        value = getattr(stats, name)
        assert row[name] == value or (value is None and pd.isna(row[name])), name
    assert row["dtype"] == "float16" and row["shape"] == tuple(stats.shape) and row["numel"] == stats.numel
    assert row["abs_max"] == stats.abs_max
    assert row["headroom_bits"] == pytest.approx(math.log2(65504 / stats.abs_max))
    assert row["label"] == "blocks.1.attn.qkv" and row["class_name"] == "Linear"


def test_origin_flag_marks_the_origin_tensor() -> None:
    frame = to_dataframe(overflow_report())
    origin = frame[frame.origin]
    where = origin[["section", "kind", "module", "tensor"]].values.tolist()
    assert where == [["forward", "output", DEMO_ORIGIN, "out"]]
    assert origin["headroom_bits"].iloc[0] == -math.inf and origin["nan_count"].iloc[0] == 896
    backward = to_dataframe(backward_report())
    origin = backward[backward.origin]
    # call 1's input gradient is recorded once, on call 0's output (the same tensor): that row is marked
    assert origin[["kind", "label", "tensor"]].values.tolist() == [["grad_output", "0", "grad:out"]]
    assert backward_report().backward_origin.tensor == "grad:args[0]"  # type: ignore[union-attr]


def test_gradients_held_are_scaled() -> None:
    report = overflow_report()
    frame = to_dataframe(report)
    grads = frame[(frame.section == "backward") & frame.abs_max.notna()]
    assert (grads["abs_max_held"] == grads["abs_max"] * report.trace.scale).all()


def test_parameters_are_rows() -> None:
    frame = to_dataframe(overflow_report())
    params = frame[frame.kind == "param"]
    row = params[params.param == "blocks.1.attn.qkv.weight"].iloc[0]
    assert row["module"] == "blocks.1.attn.qkv" and row["tensor"] == "weight" and row["shape"] == (96, 32)


def test_survey_level_statistics_leave_detail_columns_empty() -> None:
    frame = to_dataframe(healthy_report())
    outputs = frame[frame.kind == "output"]
    assert outputs["min_abs_nonzero"].isna().all() and outputs["nan_count"].isna().all()
    assert outputs["abs_max"].notna().all()


def test_large_report() -> None:
    frame = to_dataframe(long_report(2000))
    assert len(frame) == 2000 * 3  # an input, an output and an output gradient per call


def test_missing_pandas_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pandas", None)  # makes "import pandas" raise ImportError
    with pytest.raises(AmpDoctorError, match=r"pip install 'ampdoctor\[notebook\]'"):
        overflow_report().to_dataframe()


def test_op_peaks_are_columns_of_the_calls_output_rows() -> None:
    """The scores inside an attention (larger than its inputs and outputs) show on that call's output rows only."""
    from test_story import TOKENS, Siblings

    import ampdoctor

    report = ampdoctor.diagnose(Siblings(), TOKENS, loss_fn=lambda out, _: out.mean() * 1e-3, device_type="cpu",
                                verify=False)
    frame = to_dataframe(report)
    peaks = frame[frame.op_peak.notna()]
    assert set(peaks.kind) == {"output"}
    by_module = peaks.groupby("module").op_peak_abs_max.first().to_dict()
    assert by_module["blocks.1"] == 49984.0
    row = peaks[peaks.module == "blocks.1"].iloc[0]
    assert row.op_peak == "matmul#0"
    assert row.op_peak_headroom_bits == pytest.approx(math.log2(65504 / 49984))
    assert frame[frame.kind != "output"].op_peak_abs_max.isna().all()
    assert frame.op_peak_abs_max.dtype == "float64"
