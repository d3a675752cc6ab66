"""Returned tensors that the model's own ops also consumed (a KV cache the attention read, embeddings the root
multiplied into logits) get gradient from inside the model: theirs is not "the gradient of the loss reaching the
model". Before, a non-finite gradient made inside the model and reaching such a tensor was blamed on the loss
(``<loss>``: "outside the model"); every causal LM of Hugging Face returns its KV cache by default.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampdoctor

W = 4


class ReturnsWhatItUses(nn.Module):
    """Returns ``v`` (as a cache) and ``y = v * 1000``: the multiply's backward overflows float16 from scale 4096 on
    (4096 / 32 * 1000 per element); inputs of |x| ~ 1e-3 keep ``lin``'s weight gradient small. The root's own code
    made the gradient that reaches ``v``, while the loss's gradient (4096 / 32) is finite."""

    def __init__(self, view: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W, bias=False)  # (a bias's gradient sums the batch's: it would overflow first)
        self.view = view

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        v = self.lin(x)
        y = v * 1000.0
        return {"y": y, "cache": v.t() if self.view else v}  # a view: its hook sees its base's gradient


def _loss(out: dict[str, torch.Tensor], batch: torch.Tensor) -> torch.Tensor:
    return out["y"].float().mean()


@pytest.mark.parametrize("view", [False, True], ids=["tensor", "view"])
def test_a_returned_tensor_used_inside_does_not_make_the_loss_the_backward_origin(view: bool) -> None:
    torch.manual_seed(0)
    model = ReturnsWhatItUses(view)
    x = torch.randn(8, W) * 1e-3
    report = ampdoctor.diagnose(model, x, loss_fn=_loss, device_type="cpu", progress=False, dtype=torch.float16)
    origin = report.backward_origin
    assert origin is not None
    assert origin.module == "" and origin.tensor.startswith("grad:")  # before: "<loss>", "out['cache']"
    assert origin.input_abs_max == pytest.approx(1 / 32)  # the loss's gradient of each y, unscaled
    (root,) = [c for c in report.trace.calls if c.parent is None]
    assert report.trace.used_inside == ((root.index, "out['cache']"),)


class ViewOutputs(nn.Module):
    """Two outputs with gradient, one of them a view (of the other, or of a tensor nothing else reads): a view that
    returns values is no reader of them."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.aux = nn.Linear(W, W)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.lin(x)
        if self.mode == "view":
            return {"logits": h.t(), "other": self.aux(x)}
        if self.mode == "chunk":
            a, b = h.chunk(2, dim=-1)
            return {"logits": a, "other": b}
        return {"logits": h, "last": h[:, -1]}


@pytest.mark.parametrize("mode", ["view", "chunk", "base-and-view"])
def test_returned_views_are_not_used_inside_and_the_loss_stays_the_origin(mode: str) -> None:
    torch.manual_seed(0)
    report = ampdoctor.diagnose(ViewOutputs(mode), torch.randn(8, W), device_type="cpu", progress=False,
                                loss_fn=lambda out, x: (out["logits"].float() * 1e6).sum(), dtype=torch.float16)
    origin = report.backward_origin
    assert origin is not None and (origin.module, origin.tensor) == ("<loss>", "out['logits']")
    assert report.trace.used_inside == ()


class AuxOnHidden(nn.Module):
    """Returns hidden states that its own matmul read too; the loss's auxiliary term on them overflows float16 in
    the loss's own backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.w = nn.Parameter(torch.randn(W, 3) * 0.1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.lin(x)
        return {"logits": h @ self.w, "hidden": h}


def test_a_gradient_the_loss_made_on_an_output_used_inside_names_the_loss() -> None:
    torch.manual_seed(0)

    def loss(out: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return out["logits"].float().logsumexp(-1).mean() + (out["hidden"].float() * 1e6).sum()

    report = ampdoctor.diagnose(AuxOnHidden(), torch.randn(8, W), loss_fn=loss, device_type="cpu", progress=False,
                                dtype=torch.float16)
    origin = report.backward_origin
    assert origin is not None and (origin.module, origin.tensor) == ("<loss>", "out['hidden']")
    assert origin.op is not None and origin.op.module == "<loss>"  # the zoomed node was made by the loss
    (root,) = [c for c in report.trace.calls if c.parent is None]
    assert report.trace.used_inside == ((root.index, "out['hidden']"),)


def test_hf_causal_lm_with_its_kv_cache_names_the_same_origin_as_without() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.norm.weight.mul_(30)  # the gradients overflow float16 at scale 65536, the forward does not
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    origins = []
    for use_cache in (False, True):
        batch = {"input_ids": ids, "labels": ids.clone(), "use_cache": use_cache}
        report = ampdoctor.diagnose(model, batch, dtype=torch.float16, progress=False)
        assert str(report.verdict) == "scale_overflow"
        assert report.backward_origin is not None
        origins.append((report.backward_origin.module, report.backward_origin.tensor))
    assert origins == [("lm_head", "grad:lm_head.weight")] * 2  # with the cache, before: ("<loss>", "out['cache']...")


class TiedLM(nn.Module):
    """Tied input embedding and output head (one weight); ``h`` is scaled up, so the head's weight gradient
    (``grad_logits^T h``) overflows float16 while the embedding's own part (a sum of ``grad_h`` rows) is small."""

    def __init__(self, vocab: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, W)
        self.head = nn.Linear(W, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids) * 3000.0)


def test_a_tied_weight_is_blamed_on_the_module_whose_backward_made_it_non_finite() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(0))
    report = ampdoctor.diagnose(model, ids, loss_fn=lambda out, ids: out.float().logsumexp(-1).mean(),
                                device_type="cpu", progress=False, dtype=torch.float16)
    origin = report.backward_origin
    assert origin is not None and origin.tensor == "grad:emb.weight"  # one gradient, two users
    assert origin.module == "head"  # before: "emb", the first module holding the weight
    assert origin.op is not None and origin.op.module == "head" and origin.op.node == "MmBackward0"


class MatmulChild(nn.Module):
    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, weight)


class HeadWithKernel(nn.Module):
    """Holds the tied weight; its matmul runs in a child (a kernel wrapper) that holds nothing."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, W))
        self.mm = MatmulChild()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.mm(h, self.weight)


def test_a_tied_weight_whose_holder_runs_the_matmul_in_a_child_is_blamed_on_the_holder() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    model.head = HeadWithKernel(16)
    model.head.weight = model.emb.weight
    ids = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(0))
    report = ampdoctor.diagnose(model, ids, loss_fn=lambda out, ids: out.float().logsumexp(-1).mean(),
                                device_type="cpu", progress=False, dtype=torch.float16)
    origin = report.backward_origin
    assert origin is not None and origin.op is not None and origin.op.module == "head.mm"
    assert origin.module == "head"  # the holder the zoomed call sits in; not "emb"


def test_hf_tied_embeddings_blame_the_head_as_untied_ones_do() -> None:
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
    found = []
    for tie in (True, False):
        torch.manual_seed(0)
        config = transformers.BloomConfig(vocab_size=100, hidden_size=32, n_layer=2, n_head=4, tie_word_embeddings=tie)
        model = transformers.BloomForCausalLM(config)
        with torch.no_grad():
            model.transformer.ln_f.weight.mul_(30)
        report = ampdoctor.diagnose(model, batch, dtype=torch.float16, progress=False)
        assert report.backward_origin is not None
        found.append(report.backward_origin.module)
    assert found == ["lm_head", "lm_head"]  # tied, before: "transformer.word_embeddings"
