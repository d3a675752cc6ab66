"""Autocast policy facts: which ops CPU and CUDA autocast run in which dtype (the one place that says so).

Torch-free on purpose: analysis and the renderers read these names and notes too, and a saved report is
re-rendered on machines without torch.

The tables follow **torch 2.13** (``POLICY_TORCH_VERSION``), read from ATen's ``autocast_mode.h`` op lists
(``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``,
``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE``, ``AT_FORALL_PROMOTE``) and the ``TORCH_LIBRARY_IMPL(aten,
Autocast, m)`` block of ``autocast_mode.cpp`` that registers them for CUDA (plus ``cudnn_convolution[_transpose]``
and the banned ``binary_cross_entropy``), ``aten/src/ATen/cudnn/AutocastRNN.cpp`` (``_cudnn_rnn``, CUDA builds
only), and the ``TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)`` block for CPU. Op names are the dispatcher's
registration names: ``"aten::exp"`` (the default overload), ``"aten::pow.Tensor_Scalar"``. A test compares them
with the registrations of the installed torch (``AutocastCUDA`` and ``AutocastCPU``), so a torch upgrade that
changes a list fails loudly instead of drifting.

How CUDA autocast treats an op (``cuda_policy``):

- ``"low"``: every floating, non-float64 input is cast to the autocast dtype (float16 or bfloat16);
- ``"fp32"``: every floating, non-float64 input is cast to float32;
- ``"fp32_if_dtype"``: the op runs in float32 through its optional ``dtype`` argument, unless the caller
  passed one (``sum``, ``cumsum``, ``softmax``, ``log_softmax``, ``prod``, the vector and matrix norms);
- ``"promote"``: inputs are cast to the widest floating input type (float32 beats the low dtype);
- ``"banned"``: autocast raises (``binary_cross_entropy``: use ``binary_cross_entropy_with_logits``);
- ``"unlisted"``: no cast; the op runs in whatever dtype its inputs have. In-place ops (``exp_``), ``out=``
  overloads and float64 inputs are never cast.

The emulation of CUDA's policy on a CPU (``capture/emulate.py``) reads these tables.
"""

from __future__ import annotations

from typing import Literal, Optional

POLICY_TORCH_VERSION = "2.13"
Policy = Literal["low", "fp32", "fp32_if_dtype", "promote", "banned", "unlisted"]


def _ops(names: str) -> frozenset[str]:
    return frozenset("aten::" + n for n in names.split())


# -- CUDA (torch 2.13: autocast_mode.h lists, registered for the Autocast/AutocastCUDA key) -------------------
CUDA_LOW = _ops(
    """_convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d.input
    conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm
    baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell
    rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention
    cudnn_convolution cudnn_convolution_transpose"""
)
# Registered by aten/src/ATen/cudnn/AutocastRNN.cpp, compiled only into CUDA builds with cuDNN: it is absent
# from a CPU build's registrations. It casts the input, the states and all weights to float16.
CUDA_BUILD_ONLY_LOW = _ops("_cudnn_rnn")
CUDA_FP32 = _ops(
    """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar
    pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm.dim
    nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d
    hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss
    multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits
    dist pdist cdist renorm logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d
    _upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d
    _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa"""
)
CUDA_FP32_SET_OPT_DTYPE = _ops(
    """prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm linalg_matrix_norm
    linalg_matrix_norm.str_ord sum sum.dim_IntList"""
)
# fp32_append_dtype: the overload without a dtype is redispatched to its dtype-taking sibling with float32.
CUDA_FP32_APPEND_DTYPE = {
    "aten::norm.Scalar": "aten::norm.ScalarOpt_dtype",
    "aten::norm.ScalarOpt_dim": "aten::norm.ScalarOpt_dim_dtype",
}
CUDA_PROMOTE = _ops("addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add")
CUDA_BANNED = _ops("binary_cross_entropy")

# -- CPU (torch 2.13: autocast_mode.cpp, TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)) ----------------------------
CPU_LOW = _ops(
    """conv1d conv1d.padding conv2d conv2d.padding conv3d conv3d.padding bmm mm linalg_vecdot baddbmm addmm
    _addmm_activation addbmm linear _convolution.deprecated matmul conv_tbc mkldnn_rnn_layer conv_transpose1d
    conv_transpose2d.input conv_transpose3d.input prelu scaled_dot_product_attention _native_multi_head_attention"""
)
CPU_FP32 = _ops(
    """avg_pool3d binary_cross_entropy grid_sampler polar prod prod.dim_int quantile quantile.scalar nanquantile
    nanquantile.scalar stft stft.center cdist grid_sampler_2d _grid_sampler_2d_cpu_fallback grid_sampler_3d trace
    view_as_complex cholesky cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr pinverse max_pool3d
    max_unpool2d max_unpool3d adaptive_avg_pool3d reflection_pad1d reflection_pad2d replication_pad1d
    replication_pad2d replication_pad3d mse_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss
    poisson_nll_loss smooth_l1_loss cross_entropy_loss l1_loss huber_loss margin_ranking_loss soft_margin_loss
    triplet_margin_loss multi_margin_loss ctc_loss.IntList ctc_loss.Tensor kl_div multilabel_margin_loss
    binary_cross_entropy_with_logits fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft
    fft_rfft2 fft_irfft2 fft_rfftn fft_irfftn fft_hfft fft_ihfft linalg_cond linalg_cond.p_str linalg_matrix_rank
    linalg_matrix_rank.tol_tensor linalg_matrix_rank.atol_rtol_tensor linalg_matrix_rank.atol_rtol_float
    linalg_solve linalg_cholesky linalg_svdvals linalg_eigvals linalg_eigvalsh linalg_inv linalg_householder_product
    linalg_tensorinv linalg_tensorsolve fake_quantize_per_tensor_affine geqrf _lu_with_info qr svd triangular_solve
    fractional_max_pool2d fractional_max_pool3d adaptive_max_pool3d multilabel_margin_loss_forward linalg_qr
    linalg_cholesky_ex linalg_svd linalg_eig linalg_eigh linalg_lstsq linalg_inv_ex"""
)
CPU_PROMOTE = _ops("stack cat index_copy")

# CPU autocast runs these in float32 where CUDA leaves them in the input dtype, but CPU has no float16 kernel
# for them ("Unsupported dtype Half"): under the emulated CUDA policy they keep CPU's float32 (an approximation,
# reported when hit). The other CPU-only float32 ops (linalg, quantile, polar) also fail on CUDA in float16.
CPU_FP32_KEPT_IN_EMULATION = _ops(
    """fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn
    fft_irfftn fft_hfft fft_ihfft stft stft.center avg_pool3d"""
)

# Ops a dispatch-level trace (the op zoom's TorchDispatchMode) sees *below* autocast, mapped to the autocast-level
# op whose policy decided their dtype: composite ops decompose (softmax.int -> _softmax) and backward ops run in
# the dtype their forward op ran in. A name not here is looked up as it is.
DERIVED_OPS = {
    "aten::_softmax": "aten::softmax.int",
    "aten::_log_softmax": "aten::log_softmax.int",
    "aten::_softmax_backward_data": "aten::softmax.int",
    "aten::_log_softmax_backward_data": "aten::log_softmax.int",
    "aten::native_layer_norm_backward": "aten::native_layer_norm",
    "aten::native_group_norm": "aten::group_norm",
    "aten::native_group_norm_backward": "aten::group_norm",
    "aten::_fused_rms_norm": "aten::rms_norm",
    "aten::nll_loss_forward": "aten::nll_loss",
    "aten::nll_loss_backward": "aten::nll_loss",
    "aten::nll_loss2d_forward": "aten::nll_loss2d",
    "aten::nll_loss2d_backward": "aten::nll_loss2d",
    "aten::mse_loss_backward": "aten::mse_loss",
    "aten::smooth_l1_loss_backward": "aten::smooth_l1_loss",
    "aten::huber_loss_backward": "aten::huber_loss",
    "aten::soft_margin_loss_backward": "aten::soft_margin_loss",
    "aten::multi_margin_loss_backward": "aten::multi_margin_loss",
    "aten::multilabel_margin_loss_backward": "aten::multilabel_margin_loss",
    "aten::binary_cross_entropy_backward": "aten::binary_cross_entropy",
    "aten::_cdist_forward": "aten::cdist",
    "aten::_cdist_backward": "aten::cdist",
    "aten::_euclidean_dist": "aten::cdist",
    "aten::_pdist_forward": "aten::pdist",
    "aten::_pdist_backward": "aten::pdist",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_attention_math": "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_efficient_attention": "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_cudnn_attention": "aten::scaled_dot_product_attention",
    "aten::convolution_backward": "aten::convolution",
    "aten::mkldnn_convolution": "aten::convolution",
}

_CUDA_TABLE: dict[str, Policy] = {
    **{op: "low" for op in CUDA_LOW | CUDA_BUILD_ONLY_LOW},
    **{op: "fp32" for op in CUDA_FP32 | set(CUDA_FP32_APPEND_DTYPE)},
    **{op: "fp32_if_dtype" for op in CUDA_FP32_SET_OPT_DTYPE},
    **{op: "promote" for op in CUDA_PROMOTE},
    **{op: "banned" for op in CUDA_BANNED},
}
_CPU_TABLE: dict[str, Policy] = {
    **{op: "low" for op in CPU_LOW},
    **{op: "fp32" for op in CPU_FP32},
    **{op: "promote" for op in CPU_PROMOTE},
}


def cuda_registrations() -> frozenset[str]:
    """Every op CUDA autocast registers a kernel for (in a CUDA build with cuDNN), by registration name."""
    return frozenset(_CUDA_TABLE)


def cpu_registrations() -> frozenset[str]:
    """Every op CPU autocast registers a kernel for, by registration name."""
    return frozenset(_CPU_TABLE)


def normalize_op(op: str) -> str:
    """``"aten.pow.Tensor_Scalar"``, ``"torch.ops.aten.sum.default"``, ``"pow.Tensor_Scalar"`` ->
    the registration name ``"aten::pow.Tensor_Scalar"`` / ``"aten::sum"``."""
    name = op.strip()
    if name.startswith("torch.ops."):
        name = name[len("torch.ops.") :]
    if "::" not in name:
        ns, sep, rest = name.partition(".")
        name = f"{ns}::{rest}" if sep and ns == "aten" else f"aten::{name}"
    if name.endswith(".default"):
        name = name[: -len(".default")]
    return name


def _lookup(table: dict[str, Policy], op: str) -> Policy:
    name = normalize_op(op)
    name = DERIVED_OPS.get(name, name)
    if name in table:
        return table[name]
    if "." not in name.split("::", 1)[1]:  # a bare "aten::pow": decide only when all its overloads agree
        found = {p for key, p in table.items() if key.split(".", 1)[0] == name}
        if len(found) == 1:
            return found.pop()
    return "unlisted"


def cuda_policy(op: str) -> Policy:
    """How CUDA autocast (torch 2.13) treats an aten op: ``"low"``, ``"fp32"``, ``"fp32_if_dtype"``,
    ``"promote"``, ``"banned"`` or ``"unlisted"``. Accepts registration names, ``OpOverload`` strings and the
    names a dispatch-level trace records (``"aten::_softmax"`` -> softmax's policy). In-place and ``out=``
    overloads are ``"unlisted"``: autocast never casts them."""
    return _lookup(_CUDA_TABLE, op)


def cpu_policy(op: str) -> Policy:
    """How CPU autocast (torch 2.13) treats an aten op: ``"low"``, ``"fp32"``, ``"promote"`` or ``"unlisted"``."""
    return _lookup(_CPU_TABLE, op)


def _fp32(policy: Policy) -> bool:
    return policy in ("fp32", "fp32_if_dtype")


def cuda_runs_in_fp32(op: str) -> bool:
    """True for an aten op (``"aten::pow"``, ``"aten::pow.Tensor_Scalar"``, ``"aten::_softmax"``) that CUDA
    autocast runs in float32 while CPU autocast leaves it in the low dtype: a CPU finding there may not happen on
    CUDA. (``mse_loss`` runs in float32 under both policies, so it is not one of them.)"""
    return _fp32(cuda_policy(op)) and not _fp32(cpu_policy(op))


def _base_names() -> frozenset[str]:
    names = set(_CUDA_TABLE) | set(DERIVED_OPS)
    return frozenset(n.split(".", 1)[0] for n in names if cuda_runs_in_fp32(n))


# Base names (no overload) of the ops CUDA autocast runs in float32 where CPU autocast keeps the low dtype.
CUDA_FP32_OPS = _base_names()


def short_op(op: str) -> str:
    """``"aten::pow.Tensor_Scalar"`` -> ``"pow"``; a derived op names the op the user called
    (``"aten::_softmax"`` -> ``"softmax"``)."""
    name = normalize_op(op)
    name = DERIVED_OPS.get(name, name)
    return name.split("::", 1)[1].split(".", 1)[0]


# The end of a note worded from the op's name alone; a CUDA-policy re-run replaces it by what it showed.
CUDA_POLICY_HINT = "diagnose with the CUDA policy to see what CUDA does"


def cpu_policy_finding_note(op: str, kind: str = "overflow", direction: str = "forward") -> Optional[str]:
    """The note a CPU-policy finding carries when CUDA would run its op in float32 (issue 12 item 2), else None.

    ``kind`` names what the finding is ("overflow", "NaN", "underflow"); ``direction`` is "forward" or
    "backward" (a gradient op runs in the dtype its forward op ran in).
    """
    policy = cuda_policy(op)
    if not cuda_runs_in_fp32(op):
        return None
    name = short_op(op)
    subject = f"the backward of `{name}`" if direction == "backward" else f"`{name}`"
    unless = " (unless its caller passes a dtype)" if policy == "fp32_if_dtype" else ""
    return f"on CUDA {subject} runs in float32{unless}: this {kind} is specific to the CPU policy; {CUDA_POLICY_HINT}"


def policy_differences() -> dict[str, tuple[Policy, Policy]]:
    """Registration name -> (CPU policy, CUDA policy) for every op the two policies treat differently."""
    ops = set(_CUDA_TABLE) | set(_CPU_TABLE)
    both = {op: (cpu_policy(op), cuda_policy(op)) for op in sorted(ops)}
    return {op: pair for op, pair in both.items() if pair[0] != pair[1]}


# Where the CUDA-policy emulation on a CPU is approximate (README, report notes). Keep in step with emulate.py.
EMULATION_APPROXIMATIONS = (
    "kernels: CPU kernels accumulate in their own order and precision (a float16 matmul, sum or softmax may "
    "round differently from cuBLAS/cuDNN); values near a format limit can land on the other side of it",
    "attention: scaled_dot_product_attention runs CPU's kernel (flash-for-CPU or math) where CUDA picks flash, "
    "memory-efficient or cuDNN attention, each with its own internal precision",
    "RNNs: nn.LSTM/GRU/RNN follow cuDNN's autocast wrapper (input, states and weights in float16) but run CPU's "
    "recurrence, whose gate arithmetic in float16 may differ from cuDNN's",
    "FFT, stft and avg_pool3d keep CPU's float32: CPU has no float16 kernel for them, where CUDA runs them in "
    "the input dtype",
    "a nested autocast('cuda') inside the model is disabled on a machine without CUDA, so its region runs "
    "without autocast (an autocast('cuda', enabled=False) island is followed exactly)",
    "custom_fwd(device_type='cuda', cast_inputs=...) casts only CUDA tensors, so its inputs are not cast",
    "only aten ops follow CUDA's lists: custom ops with their own autocast kernels keep their CPU behaviour",
)

AUTOCAST_NOTES = {
    "cpu": "CPU autocast keeps exp, pow, sum, softmax and layer_norm in float16/bfloat16 when their input is; "
    "CUDA autocast runs them in float32, so some CPU findings would not happen on CUDA.",
    "cuda": "CUDA autocast op lists: matmul/conv/linear in the low dtype; softmax, exp, pow, norms and losses "
    "in float32.",
    "cuda_emulated": f"CUDA autocast policy, emulated on CPU (torch {POLICY_TORCH_VERSION} op lists): "
    "matmul/conv/linear in the low dtype; softmax, exp, pow, norms and losses in float32. Approximate where CPU "
    "kernels accumulate differently from CUDA's, and for attention kernels, RNNs, FFTs and custom ops.",
}


def autocast_note(device_type: str) -> str:
    return AUTOCAST_NOTES.get(device_type, "")


def saved_from_cuda_note(cuda_devices: list[str], device_type: str) -> str:
    """The device-honesty note for a CPU diagnosis of something saved from CUDA."""
    return (
        f"the checkpoint was saved from {', '.join(cuda_devices)} and this diagnosis ran on {device_type}: CPU "
        "autocast keeps exp, pow, sum, softmax and layer_norm in the low dtype where CUDA runs them in float32, so "
        "a finding in those ops may not happen on CUDA (rerun with --device cuda to confirm)"
    )
