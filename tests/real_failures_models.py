"""Small, faithful reproductions of float16 AMP failures reported in other projects' issue trackers.

Each builder returns ``(model, batch, diagnose_kwargs)`` and carries, in its docstring, the issue it reproduces
and the arithmetic that makes the reported mechanism happen on CPU float16 autocast. Where the real library code
is installed (``torch.nn.MultiheadAttention``, Hugging Face Pegasus) the real module runs; where the reported
line lives in a project we do not install, a minimal module runs that same line (quoted in the comment).
``tests/test_real_failures.py`` runs ``ampdoctor.diagnose`` on each and asserts the answer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Case = tuple[nn.Module, Any, dict[str, Any]]


# -- torch.nn.MultiheadAttention --------------------------------------------------------------------------------


class MHABlock(nn.Module):
    """A self-attention block around the real ``nn.MultiheadAttention`` (its eager ``need_weights=True`` path)."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        out, _ = self.attn(x, x, x, key_padding_mask=key_padding_mask)
        return self.head(out)


def mha_scores_overflow() -> Case:
    """pytorch/pytorch#60939: in ``multi_head_attention_forward`` "the product of q and k may have inf in the output
    and it will lead to nan in the following softmax" in fp16.

    in_proj's query and key rows are made equal and scaled by 300: q = k with |q| ~ 0.3 * 300 / sqrt(8) per entry
    after MHA's 1/sqrt(head_dim) scaling of q, and the diagonal scores q . k ~ 8 dims * (~100 * ~280) > 65504.
    The projections themselves stay far below the fp16 max (|x|max ~ 800): MHA's own ``bmm`` overflows.
    """
    torch.manual_seed(0)
    model = MHABlock()
    with torch.no_grad():
        w = model.attn.in_proj_weight
        w[:16] *= 300.0
        w[16:32] = w[:16]
    batch = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    return model, batch, {}


def mha_fully_masked_row() -> Case:
    """pytorch/pytorch#41508 and #26098: a ``key_padding_mask`` that masks every key of a sequence fills that row of
    the scores with ``-inf``; softmax of an all ``-inf`` row is 0/0 = NaN (MHA's eager path, ``need_weights=True``).

    Sample 1 is all padding (an empty sequence in the batch). Nothing here depends on the float16 range: the same
    row is NaN in float32.
    """
    torch.manual_seed(0)
    model = MHABlock()
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1] = True
    return model, (x, pad), {}


# -- hand-written attention with a -1e9 fill ---------------------------------------------------------------------


class MaskedFillAttention(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / 4.0
        # NVIDIA/apex#1105: `attn_scores_head.masked_fill(head_mask == 0, -1e10)`; fairseq#3575: -1e8
        scores = scores.masked_fill(mask[:, None, :] == 0, -1e9)
        return self.out(scores.softmax(dim=-1) @ v)


class MaskedFillModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = MaskedFillAttention()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, mask))


def masked_fill_minus_1e9() -> Case:
    """NVIDIA/apex#1105 and facebookresearch/fairseq#3575: ``masked_fill(mask, -1e9)`` on float16 attention scores
    raises "value cannot be converted to type at::Half without overflow" under AMP (the scores come out of an
    autocast matmul in float16; -1e9 is beyond 65504). The same model runs in float32."""
    torch.manual_seed(0)
    model = MaskedFillModel()
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 6)
    mask[1, 4:] = 0
    return model, (x, mask), {}


# -- BERT's hand-written LayerNorm (pytorch-pretrained-BERT) ----------------------------------------------------


class BertLayerNorm(nn.Module):
    """The LayerNorm of pytorch-pretrained-BERT's modeling.py (the file NVIDIA/apex#224 points at), eps 1e-12."""

    def __init__(self, hidden: int, eps: float = 1e-12) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.variance_epsilon)
        return self.weight * x + self.bias


class BertOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(16, 16)
        self.LayerNorm = BertLayerNorm(16)
        self.classifier = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.LayerNorm(self.dense(x)))


def layernorm_eps_zero_variance() -> Case:
    """pytorch/pytorch#41527 (layer_norm of an all-zero fp16 row with eps=1e-12 is NaN) and tensorflow#24979
    ("epsilon 1e-12 is too small for float16 and can cause NaNs when the variance is small").

    1e-12 is below float16's smallest subnormal (2**-24 ~ 6e-8): ``s + 1e-12`` is 0 in float16 for a row whose
    variance is 0. Positions 3.. of sample 1 are zero and ``dense`` has no bias, so ``dense``'s output rows there
    are all 0: x - u = 0, sqrt(0 + 0) = 0, and 0 / 0 = NaN in the LayerNorm's own division.
    """
    torch.manual_seed(0)
    model = BertOutput()
    with torch.no_grad():
        model.dense.bias.zero_()
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    x[1, 3:] = 0.0
    return model, x, {}


def layernorm_variance_overflow() -> Case:
    """pytorch/pytorch#66707 ("layer_norm needs to be done in fp32 for fp16 inputs, otherwise overflow happens"),
    with BERT's hand-written LayerNorm: ``(x - u).pow(2)`` overflows in float16 once |x - u| > 256.

    ``dense``'s weights are scaled by 300: its output reaches |x| ~ 580 (fits float16 with 6.8 bits to spare), so
    (x - u)**2 up to ~3e5 > 65504 is inf in 8 of the 12 rows. The LayerNorm then divides by sqrt(inf) = inf: those
    rows come out as exactly 0 (the bias), finite and wrong. CPU autocast runs ``pow`` in float16; CUDA runs it in
    float32, so this is the CPU policy's failure (and a pure ``.half()`` model's on any device).
    """
    torch.manual_seed(0)
    model = BertOutput()
    with torch.no_grad():
        model.dense.weight.mul_(300.0)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    return model, x, {}


# -- F.normalize's eps -----------------------------------------------------------------------------------------


class ProjectionHead(nn.Module):
    """A CLIP-style projection head: project, then L2-normalise with ``F.normalize`` (default eps=1e-12)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(torch.relu(self.proj(x)), dim=-1)


class ContrastiveModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 32))
        self.head = ProjectionHead()
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.head(self.backbone(x))
        return self.logit_scale.exp() * e @ e.t()


def normalize_eps_zero_vector() -> Case:
    """pytorch/pytorch#32137 ("F.normalize uses an epsilon of 1e-12 ... evaluated as zero in half precision. This
    causes nans when the norm is evaluated as zero"); huggingface/diffusers#13316 hit it in autoencoder norms.

    proj's bias is -100 on every unit but unit 0 (bias 0, weights x50): the head's ReLU output is all zero for a
    sample whose unit 0 is negative (sample 7 of 8 here: -0.98; the others 0.4 ... 3.1), so its norm is 0;
    ``clamp_min(1e-12)`` is ``clamp_min(0)`` in float16, and F.normalize's division is 0 / 0 = NaN for that row.
    """
    torch.manual_seed(0)
    model = ContrastiveModel()
    with torch.no_grad():
        model.head.proj.bias.fill_(-100.0)
        model.head.proj.bias[0] = 0.0
        model.head.proj.weight[0] *= 50.0
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    return model, x, {}


# -- BCELoss after a sigmoid --------------------------------------------------------------------------------------


def sigmoid_bce(policy: str = "native") -> Case:
    """pytorch/pytorch#61098 and Lightning-AI/pytorch-lightning#13871: ``Linear -> Sigmoid -> nn.BCELoss`` under
    AMP. CUDA autocast refuses it ("binary_cross_entropy and BCELoss are unsafe to autocast ... use
    BCEWithLogitsLoss"); CPU autocast runs BCE in float32 and shows why it is unsafe: the Linear's outputs reach
    |x| ~ 15, the float16 sigmoid rounds them to exactly 1.0 (1 - 2**-11 is the last float16 below 1), and BCE's
    gradient (p - y) / max(p (1 - p), 1e-12) is (1 - 0) / 1e-12 / 16 = 6.25e10 for a target 0 there: beyond
    float16, so the gradient reaching the model is inf at every loss scale (GradScaler skips every step).
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 2), nn.Sigmoid())
    with torch.no_grad():
        model[0].weight.mul_(20.0)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 2, (8, 2), generator=torch.Generator().manual_seed(2)).float()
    criterion = nn.BCELoss()

    def loss_fn(out: torch.Tensor, _batch: Any) -> torch.Tensor:
        return criterion(out, target)

    kwargs: dict[str, Any] = {"loss_fn": loss_fn}
    if policy != "native":
        kwargs["policy"] = policy
    return model, x, kwargs


# -- log(softmax) in the loss -------------------------------------------------------------------------------------


def log_of_softmax_loss() -> Case:
    """NVIDIA/apex#379: "we use softmax->log->nll_loss instead of nn.CrossEntropyLoss() ... the log function could
    cause the floating point underflow". The last layer's logits span ~34 (|x|max 17), so the smallest softmax
    probabilities are ~e**-34 ~ 2e-15, below float16's smallest subnormal: they are 0, and log(0) = -inf makes the
    loss inf. CPU autocast keeps softmax and log in float16; CUDA runs both in float32.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    with torch.no_grad():
        model[2].weight.mul_(30.0)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))

    def loss_fn(out: torch.Tensor, _batch: Any) -> torch.Tensor:
        return F.nll_loss(torch.log(torch.softmax(out, dim=-1)), target)

    return model, x, {"loss_fn": loss_fn}


# -- Hugging Face Pegasus in float16 ------------------------------------------------------------------------------


def pegasus_half_residual_overflow() -> Case:
    """huggingface/transformers#12225 ("Pegasus pretraining in fp16 results in NaN loss"): ``fc2`` returns 6.06e4,
    still finite, and the PegasusEncoderLayer's own residual add ``residual + hidden_states`` makes inf. Since
    huggingface/transformers#7243 the layer clamps float16 hidden states to finfo.max - 1000 afterwards, which hides
    the inf: the layer's output is finite, and silently wrong.

    Real ``PegasusForConditionalGeneration`` (tiny config, random weights) stored in float16 (``model.half()``, as
    in fp16 fine-tuning or inference), under float16 autocast. Token embeddings' channel 0 is 800 (no embedding
    scale in this config): the residual stream carries ~820 there. fc2's bias on channel 0 is 65000 (64992 in
    float16). 64992 + ~820 = ~65800 >= 65520: inf in the add, clamped to 64504 (64512 in float16).
    """
    transformers = __import__("transformers")
    torch.manual_seed(0)
    config = transformers.PegasusConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, attn_implementation="eager",
    )
    model = transformers.PegasusForConditionalGeneration(config)
    layer = model.model.encoder.layers[0]
    with torch.no_grad():
        model.model.shared.weight[:, 0] = 800.0
        layer.fc2.bias[0] = 65000.0
    model.half()
    ids = torch.randint(2, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(2, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    return model, {"input_ids": ids, "labels": labels}, {}


# -- Hugging Face T5 v1.1 (gated-gelu) stored in float16 ----------------------------------------------------------


def t5_gated_half_wo_overflow() -> Case:
    """huggingface/transformers#9295 ("for all the models ... at some point we get inf values in hidden_states after
    applying the final linear layer (wo) in T5DenseReluDense and T5DenseGatedGeluDense"), #4287 and #5651 (T5 in
    ``.half()``: NaN from ``h = self.wo(h)``, a value of 66246 > 65504).

    Real ``T5ForConditionalGeneration`` with ``feed_forward_proj="gated-gelu"`` (``T5DenseGatedActDense``, the v1.1
    feed-forward), tiny config, random weights, stored in float16. The encoder's ``wo`` weights are scaled to
    |w|max 30000 (fits float16): 64 terms of |h| up to ~6 times weights in the thousands exceed 65504, so ``wo``'s
    own float16 mm makes +-inf from finite inputs.
    """
    transformers = __import__("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, attn_implementation="eager",
        feed_forward_proj="gated-gelu",
    )
    model = transformers.T5ForConditionalGeneration(config)
    wo = model.encoder.block[0].layer[1].DenseReluDense.wo
    with torch.no_grad():
        wo.weight.mul_(30000.0 / wo.weight.abs().max())
    model.half()
    ids = torch.randint(2, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(2, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    return model, {"input_ids": ids, "labels": labels}, {}


# -- an additive attention mask built with -1e9 in float16 --------------------------------------------------------


class AdditiveMaskAttention(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / 4.0
        extended = (1.0 - mask[:, None, :].to(scores.dtype)) * -1e9  # "fp16 compatibility": the mask in scores' dtype
        return self.out((scores + extended).softmax(dim=-1) @ v)


class AdditiveMaskModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = AdditiveMaskAttention()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x, mask))


def additive_mask_minus_1e9(empty_sequence: bool) -> Case:
    """NVIDIA/apex#93 ("On float32 training, I'm masking with -1e20 ... with float16 and masking with -1e15, amp
    loss scaling always returns NaN for gradients"; ``torch.Tensor([-1e15]).half()`` is -inf): the additive mask
    ``(1 - mask) * -1e9``, cast to the scores' float16 "for fp16 compatibility" as BERT-style code does, is -inf
    wherever the mask is 0 (-1e9 is beyond 65504). Where a row keeps some keys, softmax turns the -inf into 0 and
    the output is right; a row with no key left (``empty_sequence``: sample 1 is all padding) is softmax of all
    -inf = NaN. With ``torch.finfo(dtype).min`` (-65504) such a row is a finite, uniform softmax instead.
    """
    torch.manual_seed(0)
    model = AdditiveMaskModel()
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 6)
    mask[1, 4:] = 0
    if empty_sequence:
        mask[1] = 0
    return model, (x, mask), {}


# -- a clamp epsilon that float16 cannot represent next to 1.0 ----------------------------------------------------


class AnySpanProbability(nn.Module):
    """P(at least one span is active) = 1 - prod(1 - p), through log-survival as GLiNER2's consistency loss does."""

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        probabilities = torch.sigmoid(logits)
        log_survival = torch.log1p(-probabilities.clamp(max=1.0 - 1e-6))
        return 1.0 - torch.exp(log_survival.sum(dim=-1))


class SpanScorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.GELU())
        self.span_logits = nn.Linear(32, 8)
        self.any_span = AnySpanProbability()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.any_span(self.span_logits(self.encoder(x)))


def clamp_eps_below_one() -> Case:
    """fastino-ai/GLiNER2#155: ``log1p(-probabilities.clamp(max=1.0 - 1e-6))`` — "1.0 - 1e-6 rounds to EXACTLY 1.0
    [in half precision] and the clamp becomes a no-op. A saturated probability then reaches 1.0 and log1p(-1.0) is
    -inf. The forward stays finite ... 1 - exp(-inf) is 1. Only the backward breaks -- d/dp log1p(-p) is -1/(1-p) =
    -inf ... 0 * inf = NaN. Under fp16 the GradScaler absorbs it as skipped steps and a collapsing loss scale."

    span_logits' bias on unit 0 is +20: sigmoid(20) = 1 - 2e-9 is exactly 1.0 in float16 for every sample, so every
    sample's log-survival sum is -inf, its output exactly 1.0, and the backward through log1p is NaN at any scale.
    """
    torch.manual_seed(0)
    model = SpanScorer()
    with torch.no_grad():
        model.span_logits.bias[0] = 20.0
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    target = torch.tensor([1.0, 0.0, 1.0, 0.0])

    def loss_fn(out: torch.Tensor, _batch: Any) -> torch.Tensor:
        return F.mse_loss(out.float(), target)

    return model, x, {"loss_fn": loss_fn}
