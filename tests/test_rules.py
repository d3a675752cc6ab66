"""Recommendations as rules (issue 17, item 3): each rule is considered in one situation, applies or not, proposes
one recommendation named after it, and declares how it is verified and what it costs. Pure: hand-built findings."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ampdoctor import Report
from ampdoctor.analysis import Findings, Origin, ScaleFinding, ScaleProbe
from ampdoctor.fixes import rules as rules_module
from ampdoctor.fixes.recommend import recommend
from ampdoctor.fixes.rules import RULES, RULES_BY_NAME, Context, Rule, rule_of, situation
from ampdoctor.records import BATCH, LOSS, FormatLimits, ModuleInfo, OpFinding, ParamRecord, RunInfo, TensorStats
from ampdoctor.report.sections import SECTIONS, build_document

GOLDEN = Path(__file__).resolve().parent / "golden"
FP16 = FormatLimits("float16", 65504.0, 2.0**-14, 2.0**-24, 65520.0, 2.0**-25)
RUN = RunInfo("2", "0", "cpu", "cpu", FP16, 65536.0, "default", "loss_fn", "Net", "")
BAD = TensorStats("float16", (4,), min=0.0, max=float("inf"))


def _origin(module: str, direction: str = "forward", op: OpFinding | None = None) -> Origin:
    return Origin(direction, module, 0, "Attn", "out", BAD, 1.0, op=op)  # type: ignore[arg-type]


def _findings(**kw: object) -> Findings:
    base = dict(verdict="overflow", forward_origin=None, backward_origin=None, propagation=(), near_limit=(),
                underflow=None, scale=None, not_captured=())
    base.update(kw)
    return Findings(**base)  # type: ignore[arg-type]


def _fill(constant: float) -> OpFinding:
    return OpFinding("aten::masked_fill.Scalar", "attn", 0, ("float16",), (1.0,), "float16", 0, 0, 4,
                     scalar_args=(constant,))


def test_rules_are_complete_and_named_once() -> None:
    assert len(RULES_BY_NAME) == len(RULES)
    for rule in RULES:
        assert rule.verify in ("fallback", "bf16", "loss_scale", "rewrite", "upcast", "none") and rule.cost
        assert (rule.verify == "rewrite") == bool(rule.rewrite)


@pytest.mark.parametrize(
    ("findings", "expected"),
    [
        (_findings(forward_origin=_origin(BATCH)), "batch"),
        (_findings(forward_origin=_origin(LOSS)), "loss"),
        (_findings(forward_origin=_origin("attn")), "forward"),
        (_findings(verdict="scale_overflow", backward_origin=_origin("attn", "backward"),
                   scale=ScaleFinding(65536.0, (ScaleProbe(1024.0, True),), 1024.0, 0.0)), "scale"),
        (_findings(backward_origin=_origin("attn", "backward")), "backward"),
        (_findings(verdict="healthy"), "other"),
    ],
)
def test_situation_is_the_first_that_holds(findings: Findings, expected: str) -> None:
    assert situation(Context(findings, RUN)) == expected


def test_broken_weights_come_before_the_forward_origin() -> None:
    nan = TensorStats("float16", (2,), min=float("nan"), max=float("nan"))
    modules = (ModuleInfo("attn", "Attn", (ParamRecord("attn.weight", nan),)),)
    recs = recommend(_findings(forward_origin=_origin("attn")), RUN, list(modules))
    assert [(r.rule, r.modules) for r in recs] == [("fix_weights", ("attn",))]


def test_forward_origin_at_a_fill_gets_the_constant_fix_then_fallback_then_bf16() -> None:
    recs = recommend(_findings(forward_origin=_origin("attn", op=_fill(-1e9))), RUN)
    assert [r.rule for r in recs] == ["mask_constant", "forward_fallback", "forward_bf16"]
    assert "-1e+09" in recs[0].title and recs[1].modules == ("attn",)
    # A constant that fits float16 is no finding of its own: the rule does not apply.
    recs = recommend(_findings(forward_origin=_origin("attn", op=_fill(-6e4))), RUN)
    assert [r.rule for r in recs] == ["forward_fallback", "forward_bf16"]
    # In bfloat16 there is no bfloat16 to move to.
    bf16_run = dataclasses.replace(RUN, limits=dataclasses.replace(FP16, dtype="bfloat16"))
    assert [r.rule for r in recommend(_findings(forward_origin=_origin("attn")), bf16_run)] == ["forward_fallback"]


def test_harmful_scale_overflow_adds_the_fallback_and_bf16_harmless_does_not() -> None:
    probes = (ScaleProbe(1024.0, True),)
    harmless = ScaleFinding(65536.0, probes, 1024.0, 0.0)
    harmful = ScaleFinding(65536.0, probes, 1024.0, 0.5)
    bwd = _origin("attn", "backward")
    assert [r.rule for r in recommend(_findings(verdict="scale_overflow", backward_origin=bwd, scale=harmless),
                                      RUN)] == ["safe_scale"]
    recs = recommend(_findings(verdict="scale_overflow", backward_origin=bwd, scale=harmful), RUN)
    assert [r.rule for r in recs] == ["safe_scale", "scale_fallback", "scale_bf16"]
    assert "init_scale=512.0" in recs[0].snippet  # 1 bit of margin below the largest finite 1024


def test_each_recommendation_names_its_rule_and_verification(monkeypatch: pytest.MonkeyPatch) -> None:
    recs = recommend(_findings(backward_origin=_origin("attn", "backward")), RUN)
    assert [(r.rule, rule_of(r).verify) for r in recs] == [("backward_fallback", "fallback"),  # type: ignore[union-attr]
                                                            ("backward_bf16", "bf16")]
    # A new remedy is a new rule: appended to RULES, it is proposed in its situation and nowhere else.
    extra = Rule("extra", "backward", lambda ctx: dataclasses.replace(recs[0], title="extra"), "none", "nothing")
    monkeypatch.setattr(rules_module, "RULES", (*RULES, extra))
    monkeypatch.setattr("ampdoctor.fixes.recommend.RULES", (*RULES, extra))
    assert [r.rule for r in recommend(_findings(backward_origin=_origin("attn", "backward")), RUN)][-1] == "extra"
    assert "extra" not in [r.rule for r in recommend(_findings(forward_origin=_origin("attn")), RUN)]


def test_document_is_its_sections_in_order() -> None:
    report = Report.from_json((GOLDEN / "demo_overflow.json").read_text(encoding="utf-8"))
    expected = [s.title for make in SECTIONS for s in make(report, 20)]
    titles = [s.title for s in build_document(report).sections]
    assert titles == expected
    assert titles[0].startswith("Forward origin") and "Recommendations" in titles and titles[-1] == "Notes"
