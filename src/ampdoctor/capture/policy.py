"""Autocast policy facts: which ops CPU and CUDA autocast run in which dtype (the one place that says so).

Torch-free on purpose: the notes and op names are read by analysis and renderers too.
"""

from __future__ import annotations

# CPU autocast leaves these ops in float16/bfloat16 when their input is; CUDA autocast runs them in float32
# (ARCHITECTURE.md §3). A CPU finding at one of them may not happen on CUDA.
CUDA_FP32_OPS = frozenset(
    {
        "aten::exp",
        "aten::pow",
        "aten::sum",
        "aten::softmax",
        "aten::_softmax",
        "aten::log_softmax",
        "aten::_log_softmax",
        "aten::layer_norm",
        "aten::native_layer_norm",
    }
)

AUTOCAST_NOTES = {
    "cpu": "CPU autocast keeps exp, pow, sum, softmax and layer_norm in float16/bfloat16 when their input is; "
    "CUDA autocast runs them in float32, so some CPU findings would not happen on CUDA.",
    "cuda": "CUDA autocast op lists: matmul/conv/linear in the low dtype; softmax, exp, pow, norms and losses "
    "in float32.",
}


def autocast_note(device_type: str) -> str:
    return AUTOCAST_NOTES.get(device_type, "")


def cuda_runs_in_fp32(op: str) -> bool:
    """True for an aten op (``"aten::pow"``, ``"aten::pow.Tensor_Scalar"``) that CUDA autocast runs in float32."""
    return op.split(".")[0] in CUDA_FP32_OPS


def saved_from_cuda_note(cuda_devices: list[str], device_type: str) -> str:
    """The device-honesty note for a CPU diagnosis of something saved from CUDA."""
    return (
        f"the checkpoint was saved from {', '.join(cuda_devices)} and this diagnosis ran on {device_type}: CPU "
        "autocast keeps exp, pow, sum, softmax and layer_norm in the low dtype where CUDA runs them in float32, so "
        "a finding in those ops may not happen on CUDA (rerun with --device cuda to confirm)"
    )
