"""Op-level float32 (issue 18, item 4): ``ampdoctor.fp32_op`` runs the k-th call of one op in each call of the
named modules in float32, and ``diagnose`` offers it (rule ``fp32_op``), resolved from the origin's source line and
proven by a re-run that hit exactly the intended ops. Real CPU float16 autocast throughout."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import amp_train, assert_untouched, snapshot
from test_remedies_attention import Wide  # a Linear (no forward of the user's own code) overflows
from torch import nn

import ampdoctor
from ampdoctor.analysis import Findings, Origin
from ampdoctor.errors import InvalidInput
from ampdoctor.fixes.recommend import recommend
from ampdoctor.records import FormatLimits, OpFinding, RunInfo, SourceLocation, TensorStats


class SelfAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(-2, -1)
        attn = torch.softmax(scores / math.sqrt(q.shape[-1]), dim=-1)
        return self.o(attn @ v)


SCORES_LINE = SelfAttention.forward.__code__.co_firstlineno + 2  # `scores = q @ k.transpose(-2, -1)`


class Block(nn.Module):
    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x)


class Sensors(nn.Module):
    """Two attention blocks without LayerNorm on raw readings (mean 200): q @ k^T reaches ~1e5 before the
    1/sqrt(16) scaling, beyond float16's 65504."""

    def __init__(self, make: type[nn.Module] = SelfAttention, d: int = 16, n: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(make(d)) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _readings() -> torch.Tensor:
    return (400 + 100 * torch.randn(4, 8, 16)) * 0.5


def _loss(out: torch.Tensor, _: object = None) -> torch.Tensor:
    return out.float().mean()


def _diagnose(model: nn.Module, x: torch.Tensor) -> ampdoctor.Report:
    return ampdoctor.diagnose(model, x, loss_fn=_loss, device_type="cpu")


def _train(model: nn.Module, x: torch.Tensor, steps: int = 20) -> tuple[list[float], list[int]]:
    """AdamW (lr 1e-3) under GradScaler defaults on one batch: the losses and the steps GradScaler skipped."""
    return amp_train(model, x, _loss, steps)


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# -- (a) scores before scaling, two instances ------------------------------------------------------------------


@pytest.fixture(scope="module")
def story() -> tuple[ampdoctor.Report, torch.Tensor]:
    torch.manual_seed(0)
    model, x = Sensors(), _readings()
    before = snapshot(model)
    report = _diagnose(model, x)
    assert_untouched(model, before)
    return report, x


def test_scores_matmul_upcast_is_offered_for_both_blocks_and_verified(
    story: tuple[ampdoctor.Report, torch.Tensor],
) -> None:
    report, _ = story
    assert report.findings.verdict == "overflow"
    rules = [r.rule for r in report.recommendations]
    assert rules.index("scale_first") < rules.index("fp32_op") < rules.index("forward_fallback")  # by cost
    rec = report.recommendations[rules.index("fp32_op")]
    assert rec.action == "fp32_op" and rec.verified, rec.evidence
    assert rec.modules == ("blocks.0.attn", "blocks.1.attn")
    assert "ampdoctor.fp32_op(model, ['blocks.0.attn', 'blocks.1.attn'], 'matmul', 0)" in rec.snippet
    assert f"the 1st matmul (test_upcast.py:{SCORES_LINE})" in rec.title
    # blocks.0.attn overflows; blocks.1.attn only carries its NaN at this step, so it is in the first re-run too,
    # and its float32 scores (beyond 65504 as well) keep it there: one re-run, no second set tried.
    assert not rec.evidence.startswith("tried")
    assert "2 module call(s), 2 op(s) upcast; forward and backward finite" in rec.evidence
    assert "2 SelfAttention instances (blocks.*.attn) run this code; 2 of 2 need it" in rec.evidence
    assert rec.cost is not None and rec.cost.extra_activation_bytes == 2 * (4 * 8 * 8) * 2  # 2 calls, 4x8x8 scores
    assert rec.cost.fp32_matmul_flop_share == 0.0


def test_the_source_line_gives_the_same_site_when_the_survey_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the survey's numbering of the flagged ops, a re-run numbers the origin module's ops and finds the
    one at the op zoom's line that made the inf: the same call, one pass more."""
    import ampdoctor.fixes.verify_upcast as verify_upcast

    monkeypatch.setattr(verify_upcast, "from_survey", lambda ctx, origin: None)
    torch.manual_seed(0)
    model, x = Sensors(), _readings()
    report = _diagnose(model, x)
    rec = next(r for r in report.recommendations if r.rule == "fp32_op")
    assert rec.verified and rec.modules == ("blocks.0.attn", "blocks.1.attn")
    assert "ampdoctor.fp32_op(model, ['blocks.0.attn', 'blocks.1.attn'], 'matmul', 0)" in rec.snippet
    assert _hooks(model) == 0


def test_a_carrier_that_does_not_need_it_is_left_out() -> None:
    """blocks.1.attn carries blocks.0.attn's NaN at the diagnosed step; with blocks.0.attn's scores in float32 its
    own float32 scores stay far below 65504, so the remedy leaves it in float16 (and says it tried both)."""
    torch.manual_seed(0)
    model, x = Sensors(), _readings()
    with torch.no_grad():
        model.blocks[1].attn.q.weight.div_(30.0)
        model.blocks[1].attn.k.weight.div_(30.0)
    report = _diagnose(model, x)
    rec = next(r for r in report.recommendations if r.rule == "fp32_op")
    assert rec.verified, rec.evidence
    assert rec.modules == ("blocks.0.attn",)
    assert rec.evidence.startswith(
        "tried the op in float32 in [blocks.0.attn, blocks.1.attn]; then in [blocks.0.attn]; "
    )
    assert "1 module call(s), 1 op(s) upcast; forward and backward finite" in rec.evidence


@pytest.mark.slow
def test_training_with_the_pasted_snippet_stays_finite(story: tuple[ampdoctor.Report, torch.Tensor]) -> None:
    """20 AdamW steps under GradScaler defaults: the loss is finite at every step and the only skipped steps are
    GradScaler's initial back-off from 65536 (the backward is finite at scale 1). Without it every step is
    skipped (test_remedies_steps's control)."""
    report, x = story
    rec = next(r for r in report.recommendations if r.rule == "fp32_op")
    torch.manual_seed(0)
    model = Sensors()
    exec(rec.snippet, {"model": model})  # what the user pastes
    losses, skipped = _train(model, x)
    assert all(math.isfinite(v) for v in losses), losses
    assert len(skipped) <= 10 and skipped == list(range(len(skipped))), skipped


@pytest.mark.slow
def test_verify_steps_trains_with_the_pasted_call() -> None:
    torch.manual_seed(0)
    model, x = Sensors(), _readings()
    report = ampdoctor.diagnose(model, x, loss_fn=_loss, device_type="cpu", verify_steps=20)
    rec = next(r for r in report.recommendations if r.rule == "fp32_op")
    assert rec.verified and "trained 20 steps on the batch with it" in rec.evidence, rec.evidence
    assert ": holds; loss non-finite at 0 step(s)" in rec.evidence
    assert _hooks(model) == 0


# -- (b) the occurrence matters ----------------------------------------------------------------------------------


class SecondProduct(nn.Module):
    """The first matmul is harmless (x @ w with w = I / 4: h = 62.5, and 250 in the first feature); the second,
    h @ h^T, reaches 250**2 + 15 * 62.5**2 = 121094, beyond float16's 65504."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.eye(d) / 4)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w
        gram = h @ h.transpose(-2, -1)
        return self.out(gram / 1e6)


GRAM_LINE = SecondProduct.forward.__code__.co_firstlineno + 2


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = SecondProduct()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_the_second_matmul_is_named_by_its_occurrence() -> None:
    x = torch.full((2, 8, 16), 250.0)
    x[:, :, 0] = 1000.0
    model = Holder()
    report = _diagnose(model, x)
    assert report.findings.forward_origin is not None and report.findings.forward_origin.module == "inner"
    rec = next(r for r in report.recommendations if r.rule == "fp32_op")
    assert rec.verified, rec.evidence
    assert "ampdoctor.fp32_op(model, ['inner'], 'matmul', 1)" in rec.snippet
    assert f"the 2nd matmul (test_upcast.py:{GRAM_LINE})" in rec.title
    # The occurrence is what decides: the first matmul in float32 leaves the gram in float16 (inf), the second
    # fixes it.
    with torch.autocast("cpu", dtype=torch.float16):
        with ampdoctor.fp32_op(model, ["inner"], "matmul", 0) as wrong:
            assert not torch.isfinite(model(x)).all()
        with ampdoctor.fp32_op(model, ["inner"], "matmul", 1) as right:
            out = model(x)
            assert torch.isfinite(out).all() and out.dtype == torch.float16
    assert (wrong.calls, wrong.hits, wrong.misses) == (1, 1, 0) and (right.calls, right.hits, right.misses) == (1, 1, 0)
    assert _hooks(model) == 0


# -- (c) not offered where the op cannot be reached --------------------------------------------------------------


def test_not_offered_for_a_module_without_its_own_forward() -> None:
    report = ampdoctor.diagnose(
        Wide(), torch.full((2, 4), 100.0), loss_fn=lambda out, _: out.float().mean() * 1e-6, device_type="cpu"
    )
    origin = report.findings.forward_origin
    assert origin is not None and origin.module == "fc"
    assert "fp32_op" not in [r.rule for r in report.recommendations]
    assert any(r.rule == "forward_fallback" for r in report.recommendations)  # the module fallback still is


FP16 = FormatLimits("float16", 65504.0, 2.0**-14, 2.0**-24, 65520.0, 2.0**-25)
RUN = RunInfo("2", "0", "cpu", "cpu", FP16, 65536.0, "default", "loss_fn", "Net", "")


def _forward_origin(op: str) -> Findings:
    where = SourceLocation("model.py", 12, "forward", "out = F.scaled_dot_product_attention(q, k, v)")
    finding = OpFinding(op, "attn", 0, ("float16",), (1.0,), "float16", 0, 4, 0, location=where)
    origin = Origin("forward", "attn", 0, "Attn", "out", TensorStats("float16", (4,), max=math.inf), 1.0, op=finding)
    return Findings("overflow", origin, None, (), (), None, None, ())


def test_not_proposed_for_sdpa_or_fused_kernels() -> None:
    fused = recommend(_forward_origin("aten::_scaled_dot_product_flash_attention_for_cpu"), RUN)
    assert "fp32_op" not in [r.rule for r in fused]
    plain = recommend(_forward_origin("aten::bmm"), RUN)
    assert "fp32_op" in [r.rule for r in plain]
    with pytest.raises(InvalidInput, match="fused kernel"):
        ampdoctor.fp32_op(Wide(), ["fc"], "scaled_dot_product_attention")


class SdpaAttention(SelfAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(F.scaled_dot_product_attention(self.q(x), self.k(x), self.v(x)))


def test_ops_inside_children_and_fused_kernels_are_not_counted() -> None:
    """The module's own code counts: the Linear children's F.linear is theirs, SDPA's inner matmuls are one op."""
    torch.manual_seed(0)
    model = Block(SdpaAttention(16))
    x = torch.randn(2, 8, 16)
    with ampdoctor.fp32_op(model, ["attn"], "linear", 0) as linear, ampdoctor.fp32_op(model, [""], "matmul") as mm:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
    assert out.dtype == torch.float32  # x + float16 attention output
    assert (linear.calls, linear.hits, linear.misses) == (1, 0, 1)
    assert (mm.calls, mm.hits, mm.misses) == (1, 0, 1)


# -- (d) nothing the user owns changes; hooks go; no frames at run time; torch.compile -------------------------


def test_the_helper_leaves_parameters_autocast_and_hooks_as_they_were() -> None:
    torch.manual_seed(0)
    model, x = Sensors(), _readings()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.autocast("cpu", dtype=torch.float16):
        handle = ampdoctor.fp32_op(model, ["blocks.0.attn", "blocks.1.attn"], "matmul", 0)
        assert handle.where is None  # no source line is read at training time
        out = model(x)
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
    assert torch.isfinite(out).all() and (handle.calls, handle.hits, handle.misses) == (2, 2, 0)
    assert handle.sites == []
    _loss(out).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    handle.remove()
    handle.remove()  # idempotent
    assert _hooks(model) == 0 and torch._C._len_torch_function_stack() == 0
    with torch.autocast("cpu", dtype=torch.float16):
        assert not torch.isfinite(model(x)).all()  # back to plain AMP


def test_activation_checkpointing_recomputes_with_the_same_upcast() -> None:
    """A non-reentrant checkpoint re-runs the forward in the backward: the hooks fire again, the op is upcast again
    (the recomputed result has the dtype autograd saved), and the gradients match the run without checkpointing."""
    torch.manual_seed(0)
    attn, x = SelfAttention(16), _readings()

    def grads(checkpointed: bool) -> tuple[list[torch.Tensor], tuple[int, int, int]]:
        attn.zero_grad(set_to_none=True)
        with ampdoctor.fp32_op(attn, [""], "matmul", 0) as handle, torch.autocast("cpu", dtype=torch.float16):
            if checkpointed:
                out = torch.utils.checkpoint.checkpoint(attn, x, use_reentrant=False)
            else:
                out = attn(x)
            _loss(out).backward()
        return [p.grad.clone() for p in attn.parameters()], (handle.calls, handle.hits, handle.misses)

    plain, counts = grads(False)
    recomputed, recounts = grads(True)
    assert counts == (1, 1, 0) and recounts == (2, 2, 0)
    assert all(torch.isfinite(g).all() for g in recomputed)
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed))
    assert _hooks(attn) == 0


class Raises(SelfAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.q(x), self.k(x)
        _ = q @ k.transpose(-2, -1)
        raise RuntimeError("boom")


def test_hooks_and_mode_are_gone_after_an_exception() -> None:
    model = Block(Raises(16))
    with pytest.raises(RuntimeError, match="boom"):
        with ampdoctor.fp32_op(model, ["attn"], "matmul", 0) as handle:
            model(torch.randn(2, 4, 16))
    assert torch._C._len_torch_function_stack() == 0  # left by the always_call hook when the forward raised
    assert handle.hits == 1 and _hooks(model) == 0


def test_bad_arguments_are_named() -> None:
    model = Sensors()
    with pytest.raises(InvalidInput, match="no module named 'blocks.2.attn'"):
        ampdoctor.fp32_op(model, ["blocks.2.attn"], "matmul")
    with pytest.raises(InvalidInput, match="occurrence=-1"):
        ampdoctor.fp32_op(model, ["blocks.0.attn"], "matmul", -1)
    with pytest.raises(InvalidInput, match="not an aten op"):
        ampdoctor.fp32_op(model, ["blocks.0.attn"], "aten::bmm")
    with pytest.raises(InvalidInput, match="no torch function has that name"):
        ampdoctor.fp32_op(model, ["blocks.0.attn"], "matmull")
    assert _hooks(model) == 0


@pytest.mark.slow
def test_it_compiles_without_graph_breaks() -> None:
    torch.manual_seed(0)
    model, x = Sensors(), _readings()
    with torch.autocast("cpu", dtype=torch.float16):
        assert not torch.isfinite(model(x)).all()
    with ampdoctor.fp32_op(model, ["blocks.0.attn", "blocks.1.attn"], "matmul", 0) as handle:
        compiled = torch.compile(model, fullgraph=True, backend="eager")  # fullgraph: a graph break raises
        with torch.autocast("cpu", dtype=torch.float16):
            out = compiled(x)
    assert torch.isfinite(out).all() and (handle.calls, handle.hits, handle.misses) == (2, 2, 0)
    torch._dynamo.reset()


# -- (e) a data-dependent branch shifts the occurrence ------------------------------------------------------------


class Branching(SelfAttention):
    """Rescales large inputs with an extra (identity) matmul first: in the second block, the scores become the
    2nd matmul, so 'the 1st matmul' resolved in the first block misses there."""

    def __init__(self, d: int) -> None:
        super().__init__(d)
        self.register_buffer("eye", torch.eye(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().amax() > 2000:  # data-dependent
            x = x @ self.eye
        return super().forward(x)


def test_a_branch_that_shifts_the_occurrence_is_not_verified() -> None:
    torch.manual_seed(0)
    model = Sensors(Branching)
    x = _readings()
    with torch.no_grad():  # the second block's input takes the branch, the first's does not
        model.blocks[0].attn.o.weight.mul_(30.0)
    report = _diagnose(model, x)
    rec = next((r for r in report.recommendations if r.rule == "fp32_op"), None)
    assert rec is not None and not rec.verified
    assert "missed: the 1st matmul ran elsewhere" in rec.evidence and "a data-dependent branch" in rec.evidence


# -- hidden overflows: the op is named by its records ------------------------------------------------------------


class Clamped(SelfAttention):
    """The user's attempt at a fix: the float16 scores overflow and the clamp hides the inf (finite output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = (q @ k.transpose(-2, -1)).clamp(-60000, 60000)
        return self.o(torch.softmax(scores / math.sqrt(q.shape[-1]), dim=-1) @ v)


CLAMPED_LINE = Clamped.forward.__code__.co_firstlineno + 2


def test_a_hidden_overflow_gets_the_op_upcast_for_every_instance() -> None:
    torch.manual_seed(0)
    model, x = Sensors(Clamped), _readings()
    unverified = ampdoctor.diagnose(model, x, loss_fn=_loss, device_type="cpu", verify=False)
    assert unverified.findings.forward_origin is None
    assert {h.module for h in unverified.findings.hidden} == {"blocks.0.attn", "blocks.1.attn"}
    proposed = next(r for r in unverified.recommendations if r.rule.startswith("hidden_fp32_op"))
    # The records name the op and its occurrence: the snippet is complete before any re-run.
    assert "ampdoctor.fp32_op(model, ['blocks.0.attn', 'blocks.1.attn'], 'matmul', 0)" in proposed.snippet
    assert "clamp" in proposed.title
    report = ampdoctor.diagnose(model, x, loss_fn=_loss, device_type="cpu")
    rec = next(r for r in report.recommendations if r.rule.startswith("hidden_fp32_op"))
    assert rec.verified, rec.evidence
    assert rec.modules == ("blocks.0.attn", "blocks.1.attn")
    assert f"the 1st matmul (test_upcast.py:{CLAMPED_LINE})" in rec.title
    assert "2 module call(s), 2 op(s) upcast" in rec.evidence
    assert _hooks(model) == 0


def test_no_op_upcast_without_an_overflow() -> None:
    torch.manual_seed(0)
    report = _diagnose(Sensors(), torch.randn(4, 8, 16))
    assert report.findings.forward_origin is None and not report.findings.hidden
    assert not [r for r in report.recommendations if r.action == "fp32_op"]
