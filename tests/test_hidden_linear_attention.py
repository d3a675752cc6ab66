"""A hidden overflow that a reciprocal hides, in linear attention ("Transformers are RNNs", as LoFTR writes it).

``Z = 1 / (einsum(Q, K.sum(1)) + eps)``: over 4,800 positions the normaliser passes float16's max, ``1 / inf`` is
0, and the layer's output is silently the output projection's bias. LoFTR divides the values by the sequence
length with the comment "prevent fp16 overflow" (zju3dv/LoFTR, linear_attention.py); its users still report NaN
in fp16 training (zju3dv/LoFTR#285). Without the overflow in the output, the zeroed layer makes the gradients
tiny, and the step used to read as UNDERFLOW with "raise the loss scale" first: the hidden overflow must lead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ampdoctor

POSITIONS, HEADS, DIM = 4800, 2, 32


class LinearAttention(nn.Module):
    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        q, k = F.elu(queries) + 1, F.elu(keys) + 1
        kv = torch.einsum("nshd,nshv->nhdv", k, values)
        z = 1 / (torch.einsum("nlhd,nhd->nlh", q, k.sum(dim=1)) + self.eps)  # overflows; 1/inf = 0 hides it
        return torch.einsum("nlhd,nhdv,nlh->nlhv", q, kv, z)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.attn = LinearAttention()
        self.out = nn.Linear(DIM, DIM)
        with torch.no_grad():  # small values: kv stays finite, only the normaliser overflows
            self.v.weight.mul_(0.001)
            self.v.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, s, d = x.shape
        shape = (n, s, HEADS, d // HEADS)
        msg = self.attn(self.q(x).view(shape), self.k(x).view(shape), self.v(x).view(shape))
        return self.out(msg.reshape(n, s, d))


def _case() -> tuple[Layer, torch.Tensor]:
    torch.manual_seed(0)
    return Layer(), torch.randn(1, POSITIONS, DIM) * 4 + 2


def _loss(out: Any, batch: Any) -> torch.Tensor:
    return out.float().pow(2).mean()


def test_the_premise_the_normaliser_overflows_and_the_output_stays_finite() -> None:
    model, x = _case()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        n, s, d = x.shape
        q = F.elu(model.q(x).view(n, s, HEADS, d // HEADS)) + 1
        k = F.elu(model.k(x).view(n, s, HEADS, d // HEADS)) + 1
        normaliser = torch.einsum("nlhd,nhd->nlh", q, k.sum(dim=1))
        assert normaliser.dtype == torch.float16 and int(torch.isinf(normaliser).sum()) == 9561
        assert torch.isfinite(model(x)).all()


def test_the_hidden_overflow_leads_and_its_op_in_float32_is_the_first_remedy() -> None:
    model, x = _case()
    report = ampdoctor.diagnose(model, x, loss_fn=_loss, progress=False)
    assert report.verdict == "hidden_overflow" and report.exit_code == 1, report.to_text()
    (hidden,) = report.findings.hidden
    assert (hidden.module, hidden.op, hidden.count) == ("attn", "einsum", 9561)
    assert hidden.location is not None and "k.sum(dim=1)" in hidden.location.code
    first = report.recommendations[0]
    assert first.action == "fp32_op" and first.verified, report.to_text()
    assert "ampdoctor.fp32_op(model, ['attn'], 'einsum', 1)" in first.snippet
    # The gradients the zeroed layer starves are still reported, after the overflow.
    assert report.findings.underflow is not None and report.findings.underflow.share > 0.05
    assert any(r.action == "loss_scale" for r in report.recommendations[1:])


def _message(model: Layer, x: torch.Tensor, autocast: bool) -> torch.Tensor:
    """The attention's output (what the layer's projection gets)."""
    seen: list[torch.Tensor] = []
    handle = model.attn.register_forward_hook(lambda m, args, out: seen.append(out.detach().float()))
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
            model(x)
    finally:
        handle.remove()
    return seen[0]


def test_the_pasted_remedy_gives_the_layer_its_message_back() -> None:
    model, x = _case()
    reference = _message(model, x, autocast=False)
    broken = _message(model, x, autocast=True)
    zeroed = (broken == 0).all(dim=-1).sum().item()
    assert zeroed >= 9500 and (reference != 0).any(dim=-1).all()  # 1 / inf = 0: the rows are silently empty
    with ampdoctor.fp32_op(model, ["attn"], "einsum", 1) as handle:
        fixed = _message(model, x, autocast=True)
    assert handle.hits == 1 and handle.misses == 0
    assert ((fixed - reference).norm() / reference.norm()).item() < 0.01  # float16 rounding only
