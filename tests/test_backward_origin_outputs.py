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


def test_a_model_returning_one_tensor_walks_no_graph() -> None:
    from ampdoctor.capture.walk import used_inside

    x = torch.randn(2, W, requires_grad=True)
    y = x * 2
    assert used_inside([("out", y)]) == []
    z = y.sum()
    assert used_inside([("out[0]", y), ("out[1]", z)]) == ["out[0]"]  # z consumed y
    assert used_inside([("out[0]", y), ("out[1]", x * 3)]) == []


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
