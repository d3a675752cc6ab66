"""The autocast policy tables (torch 2.13) and the CUDA-policy emulation's mechanics on CPU.

Model-level comparisons with hand-written CUDA-policy variants are in test_policy_models.py.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from ampdoctor import autocast_ops as policy
from ampdoctor.capture import emulate
from ampdoctor.capture.emulate import cuda_autocast, installed_cuda_policy

F16, F32 = torch.float16, torch.float32

# Ops registered for AutocastCUDA in the installed torch that the policy table leaves out: none. Keep this an
# explicit list: a torch upgrade that adds an op must add it to autocast_ops.py or name it here with the reason.
LEFT_OUT_OF_TABLE: frozenset[str] = frozenset()
# In the table but not registered in a CPU build: cuDNN's RNN wrapper (aten/src/ATen/cudnn/AutocastRNN.cpp) is
# compiled only into CUDA builds; the emulation follows it on lstm/gru/rnn_tanh/rnn_relu (emulate.RNN_OPS).
TABLE_ONLY_IN_CUDA_BUILDS = frozenset({"aten::_cudnn_rnn"})
# In the table, but no kernel installed: no CPU or composite kernel exists, so CPU code never reaches them.
NOT_EMULATED = frozenset(
    {
        "aten::cudnn_convolution",
        "aten::cudnn_convolution_transpose",
        "aten::_thnn_fused_lstm_cell",
        "aten::_thnn_fused_gru_cell",
        "aten::_scaled_dot_product_flash_attention",
    }
)


# -- the tables against the installed torch ------------------------------------------------------------------


def test_torch_is_the_version_the_tables_follow() -> None:
    assert torch.__version__.startswith(policy.POLICY_TORCH_VERSION)


def test_cuda_table_covers_every_autocast_cuda_registration() -> None:
    registered = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
    assert len(registered) == 119  # 35 low + 59 fp32 + 11 fp32_set_opt_dtype + 2 append + 11 promote + 1 banned
    assert registered - policy.cuda_registrations() == LEFT_OUT_OF_TABLE
    assert policy.cuda_registrations() - registered == TABLE_ONLY_IN_CUDA_BUILDS


def test_cpu_table_equals_the_autocast_cpu_registrations() -> None:
    registered = {op for op in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")}
    assert registered == policy.cpu_registrations()


def test_emulation_installs_the_table_less_the_unreachable_ops() -> None:
    for op in NOT_EMULATED:  # unreachable from CPU code: no CPU or composite kernel
        assert not any(
            torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
            for key in ("CPU", "CompositeImplicitAutograd", "CompositeExplicitAutograd")
        ), op
    assert emulate.NOT_EMULATED == NOT_EMULATED
    with installed_cuda_policy() as handle:
        installed = set(handle.installed)
        fallthrough = set(handle.fallthrough)
        assert set(handle.not_emulated) == NOT_EMULATED  # no table op missing from this torch
    table = policy.cuda_registrations() - TABLE_ONLY_IN_CUDA_BUILDS - NOT_EMULATED
    assert installed == table | emulate.RNN_OPS | policy.CPU_FP32_KEPT_IN_EMULATION
    # Every other op CPU autocast lists falls through, as it does on CUDA (cat, stack, cross_entropy_loss, ...).
    assert fallthrough == policy.cpu_registrations() - installed
    assert {"aten::cat", "aten::stack", "aten::cross_entropy_loss", "aten::conv1d.padding"} <= fallthrough


# -- the torch-free helpers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "cuda", "cpu"),
    [
        ("aten::pow.Tensor_Scalar", "fp32", "unlisted"),
        ("aten.pow.Tensor_Scalar", "fp32", "unlisted"),  # str(OpOverload)
        ("aten::pow", "fp32", "unlisted"),  # bare name: all overloads agree
        ("aten::exp_", "unlisted", "unlisted"),  # in-place: never cast
        ("aten::exp.out", "unlisted", "unlisted"),  # out=: never cast
        ("aten::sum", "fp32_if_dtype", "unlisted"),
        ("torch.ops.aten.sum.dim_IntList", "fp32_if_dtype", "unlisted"),
        ("aten::_softmax", "fp32_if_dtype", "unlisted"),  # what a dispatch-level trace sees of softmax
        ("aten::_log_softmax_backward_data", "fp32_if_dtype", "unlisted"),
        ("aten::native_layer_norm", "fp32", "unlisted"),
        ("aten::mm", "low", "low"),
        ("aten::addmm", "low", "low"),
        ("aten::cat", "unlisted", "promote"),
        ("aten::stft", "unlisted", "fp32"),
        ("aten::prod", "fp32_if_dtype", "fp32"),
        ("aten::mse_loss", "fp32", "fp32"),
        ("aten::nll_loss_forward", "fp32", "fp32"),
        ("aten::binary_cross_entropy", "banned", "fp32"),
        ("aten::addcmul", "promote", "unlisted"),
        ("aten::norm.Scalar", "fp32", "unlisted"),
        ("aten::relu", "unlisted", "unlisted"),
        ("aten::_cudnn_rnn", "low", "unlisted"),
    ],
)
def test_policy_of_an_op(op: str, cuda: str, cpu: str) -> None:
    assert policy.cuda_policy(op) == cuda
    assert policy.cpu_policy(op) == cpu


def test_cuda_runs_in_fp32_means_cuda_fp32_where_cpu_is_not() -> None:
    for op in ("aten::pow.Tensor_Scalar", "aten::exp", "aten::_softmax", "aten::sum", "aten::cumsum", "aten::log"):
        assert policy.cuda_runs_in_fp32(op), op
    for op in ("aten::mse_loss", "aten::prod", "aten::mm", "aten::exp_", "aten::relu", "aten::nll_loss"):
        assert not policy.cuda_runs_in_fp32(op), op
    legacy = {"exp", "pow", "sum", "softmax", "_softmax", "log_softmax", "_log_softmax", "layer_norm"}
    assert {f"aten::{n}" for n in legacy | {"native_layer_norm"}} <= policy.CUDA_FP32_OPS
    assert "aten::mse_loss" not in policy.CUDA_FP32_OPS and "aten::mm" not in policy.CUDA_FP32_OPS


def test_finding_note_text() -> None:
    assert policy.cpu_policy_finding_note("aten::pow.Tensor_Scalar") == (
        "on CUDA `pow` runs in float32: this overflow is specific to the CPU policy; diagnose with the CUDA "
        "policy to see what CUDA does"
    )
    assert policy.cpu_policy_finding_note("aten::_softmax_backward_data", "NaN", "backward") == (
        "on CUDA the backward of `softmax` runs in float32 (unless its caller passes a dtype): this NaN is "
        "specific to the CPU policy; diagnose with the CUDA policy to see what CUDA does"
    )
    assert policy.cpu_policy_finding_note("aten::addmm") is None
    assert policy.cpu_policy_finding_note("aten::mse_loss") is None  # float32 under both policies


def test_policy_differences_run_both_ways() -> None:
    diff = policy.policy_differences()
    assert diff["aten::exp"] == ("unlisted", "fp32")
    assert diff["aten::softmax.int"] == ("unlisted", "fp32_if_dtype")
    assert diff["aten::cat"] == ("promote", "unlisted")
    assert diff["aten::fft_rfft"] == ("fp32", "unlisted")
    assert "aten::mm" not in diff and "aten::mse_loss" not in diff


def test_policy_module_imports_no_torch() -> None:
    code = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('p', sys.argv[1])\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print(m.cuda_policy('aten::exp'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, policy.__file__], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "fp32"


# -- mechanics -------------------------------------------------------------------------------------------------


class _Ops(TorchDispatchMode):
    """Records (op, input floating dtypes, output dtype) of every aten op below autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[torch.dtype, ...], Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        ins = tuple(a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        name = str(func._schema.name) + ("" if func._overloadname == "default" else "." + func._overloadname)
        self.ops.append((name, ins, first.dtype if isinstance(first, torch.Tensor) else None))
        return out

    def names(self) -> list[str]:
        return [op for op, _, _ in self.ops]


def _state() -> tuple[Any, ...]:
    """Everything the emulation may touch, process-wide and thread-local."""
    ops = sorted(policy.cuda_registrations() | policy.cpu_registrations() | emulate.RNN_OPS)
    dumps = tuple(torch._C._dispatch_dump(op) for op in ops if torch._C._dispatch_has_kernel(op))
    nesting = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return (
        sorted(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")),
        dumps,
        {key for key in torch.library._impls if "Autocast" in key},
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cuda"),
        torch.is_autocast_cache_enabled(),
        nesting,
        emulate._LOCAL.depth,
        dict(emulate._LOCAL.cache),
        emulate.is_installed(),
    )


@pytest.fixture
def clean() -> Iterator[None]:
    before = _state()
    yield
    assert _state() == before


def test_region_sets_and_restores_the_flags(clean: None) -> None:
    with cuda_autocast(torch.bfloat16):
        assert torch.is_autocast_enabled() and torch.is_autocast_enabled("cuda")  # CUDA's flag, as on CUDA
        assert torch.get_autocast_dtype("cuda") == torch.bfloat16 == torch.get_autocast_dtype("cpu")
        assert emulate.is_installed()
        assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16


@pytest.mark.parametrize("where", ["forward", "backward", "nested", "install"])
def test_nothing_is_left_behind_after_an_exception(clean: None, where: str) -> None:
    class Boom(Exception):
        pass

    x = torch.ones(3, 3, requires_grad=True)
    with pytest.raises(Boom):
        with installed_cuda_policy():
            with cuda_autocast():
                y = (x @ x).exp()
                if where == "forward":
                    raise Boom
                if where == "nested":
                    with cuda_autocast(torch.bfloat16), installed_cuda_policy():
                        raise Boom
            y.sum().backward()
            if where == "backward":
                raise Boom
            if where == "install":
                raise Boom


def test_a_failed_install_removes_what_it_registered(clean: None, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real = emulate._kernel

    def failing(plan: Any, stats: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 50:
            raise RuntimeError("registration failed")
        return real(plan, stats)

    monkeypatch.setattr(emulate, "_kernel", failing)
    with pytest.raises(RuntimeError, match="registration failed"):
        with cuda_autocast():
            pass
    assert calls["n"] == 50


def test_kernels_are_gone_after_the_pass(clean: None) -> None:
    x = torch.full((4,), 300.0)
    with cuda_autocast():
        assert torch.mm(x[None], x[:, None]).dtype == F16
        assert (x.half() ** 2).dtype == F32
    with torch.autocast("cpu", dtype=F16):  # CPU autocast's own policy is back
        assert (x.half() ** 2).dtype == F16
        assert torch.isinf(x.half() ** 2).all()


def test_rules_that_never_cast(clean: None) -> None:
    h = torch.full((4,), 2.0, dtype=F16)
    with cuda_autocast():
        assert h.sum(dtype=F16).dtype == F16  # fp32_if_dtype respects the caller's dtype
        assert torch.arange(5).sum().dtype == torch.int64  # not floating: not eligible
        assert torch.ones(3, dtype=torch.float64).exp().dtype == torch.float64  # float64 is never cast
        g = h.clone()
        g.exp_()  # in-place: never cast
        assert g.dtype == F16
        out = torch.empty(4, dtype=F16)
        torch.exp(h, out=out)  # out=: never cast
        assert out.dtype == F16
        assert torch.addcmul(h, h, torch.ones(4)).dtype == F32  # promote: widest input
        assert torch.addcmul(h, h, h).dtype == F16
        with pytest.raises(RuntimeError, match="Unexpected floating ScalarType"):
            torch.addcmul(h, h, h.bfloat16())  # as CUDA's prioritize()
        assert torch.norm(h).dtype == F32 and torch.norm(h, dim=0).dtype == F32  # fp32_append_dtype
        assert torch.cat([h, h]).dtype == F16  # CPU would promote; CUDA leaves cat alone
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(torch.sigmoid(h.float()), torch.ones(4))


def test_cross_entropy_decomposes_and_its_inner_ops_follow_cuda(clean: None) -> None:
    logits = torch.randn(4, 5, dtype=F16)
    target = torch.tensor([0, 1, 2, 3])
    with cuda_autocast() as handle, _Ops() as rec:
        assert F.cross_entropy(logits, target).dtype == F32
    # cross_entropy_loss (LossNLL.cpp) calls log_softmax(self, dim, self.scalar_type()): the dtype is given, so
    # CUDA's fp32_set_opt_dtype rule leaves it in float16; nll_loss then runs in float32. CPU autocast instead
    # casts the whole cross_entropy_loss to float32.
    assert rec.ops == [
        ("aten::_log_softmax", (F16,), F16),
        ("aten::_to_copy", (F16,), F32),
        ("aten::nll_loss_forward", (F32,), F32),
    ]
    assert handle.stats.applied == {"aten::log_softmax.int": 1, "aten::nll_loss": 1}
    with torch.autocast("cpu", dtype=F16), _Ops() as rec:
        F.cross_entropy(logits, target)
    assert rec.ops[:2] == [("aten::_to_copy", (F16,), F32), ("aten::_log_softmax", (F32,), F32)]


def test_autocast_cuda_disabled_island_runs_uncast(clean: None) -> None:
    x = torch.ones(2, 2)
    with cuda_autocast() as handle:
        with torch.autocast("cuda", enabled=False):  # torch code often writes this island
            assert torch.mm(x, x).dtype == F32
            assert x.half().exp().dtype == F16
        assert torch.mm(x, x).dtype == F16
    assert handle.stats.island["aten::mm"] == 1 and handle.stats.island["aten::exp"] == 1
    assert any("autocast('cuda', enabled=False)" in n for n in handle.notes())


@pytest.mark.skipif(torch.cuda.is_available(), reason="documents a CPU-only build: needs a machine without a CUDA GPU")
def test_the_documented_approximations_of_a_cpu_only_build(clean: None) -> None:
    x = torch.ones(2, 2)

    @torch.amp.custom_fwd(device_type="cuda", cast_inputs=torch.float32)
    def fp32_function(t: torch.Tensor) -> torch.dtype:
        return t.dtype

    with cuda_autocast() as handle:
        with pytest.warns(UserWarning, match="CUDA is not available"):
            with torch.autocast("cuda"):  # torch disables it without CUDA: its region runs uncast
                assert torch.mm(x, x).dtype == F32  # CUDA: float16
        assert fp32_function(x.half()) == F16  # custom_fwd casts CUDA tensors only; CUDA: float32
    assert handle.stats.island["aten::mm"] == 1
    assert any("nested autocast('cuda')" in n for n in handle.notes())


def test_weight_casts_are_cached_within_a_region_as_on_cuda(clean: None) -> None:
    lin = nn.Linear(4, 4)
    x = torch.ones(2, 4)
    with cuda_autocast(), _Ops() as rec:
        y = lin(lin(x))  # the float16 copy of weight and bias is made once and reused
    assert rec.names().count("aten::_to_copy") == 3  # x, weight, bias; not 5
    with cuda_autocast(cache_enabled=False), _Ops() as rec:
        y = lin(lin(x))
    assert rec.names().count("aten::_to_copy") == 5
    y.float().sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.dtype == F32
    assert emulate._LOCAL.cache == {}


def test_a_cast_cached_under_no_grad_still_carries_the_gradient(clean: None) -> None:
    grads = {}
    for name, region in (("cpu", lambda: torch.autocast("cpu", dtype=F16)), ("emulated", cuda_autocast)):
        lin = nn.Linear(2, 2)
        with region():
            with torch.no_grad():
                lin(torch.ones(1, 2))  # caches the float16 weight
            y = lin(torch.ones(1, 2))  # reuses it with grad enabled
        y.float().sum().backward()
        grads[name] = lin.weight.grad
    assert grads["cpu"] is not None and grads["emulated"] is not None
    assert torch.equal(grads["cpu"], grads["emulated"])
    with torch.inference_mode(), cuda_autocast():  # inference mode: nothing cached
        nn.Linear(2, 2)(torch.ones(1, 2))
        assert emulate._LOCAL.cache == {}


def test_checkpoint_recompute_follows_the_policy_in_the_backward(clean: None) -> None:
    lin = nn.Linear(4, 4)
    x = torch.ones(2, 4, requires_grad=True)

    def block(t: torch.Tensor) -> torch.Tensor:
        return lin(t).exp().sum(-1)

    with installed_cuda_policy():
        with cuda_autocast():
            y = checkpoint(block, x, use_reentrant=False)
        assert y.dtype == F32
        y.sum().backward()  # the recompute runs under autocast("cpu") with CUDA's rules: same metadata
    assert x.grad is not None and x.grad.dtype == F32


def test_multihead_attention_takes_the_slow_path_as_on_cuda(clean: None) -> None:
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(1, 3, 8)
    with torch.no_grad(), cuda_autocast(), _Ops() as rec:
        out, _ = mha(x, x, x, need_weights=False)
    assert out.dtype == F16
    assert "aten::_native_multi_head_attention" not in rec.names()  # fast path refused: "autocast is enabled"


def test_rnn_runs_in_the_low_dtype_like_cudnn(clean: None) -> None:
    lstm = nn.LSTM(4, 3)
    with cuda_autocast() as handle:
        out, (h, c) = lstm(torch.ones(5, 1, 4))
    assert (out.dtype, h.dtype, c.dtype) == (F16, F16, F16)
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == F32 for p in lstm.parameters())
    assert any(n.startswith("RNNs:") for n in handle.notes())


def test_fft_keeps_cpu_float32_and_says_so(clean: None) -> None:
    with cuda_autocast() as handle:
        spec = torch.fft.rfft(torch.ones(16, dtype=F16))
    assert spec.dtype == torch.complex64
    assert handle.stats.kept_fp32["aten::fft_rfft"] == 1
    assert any("fft_rfft" in n for n in handle.notes())


def test_other_threads_regions_are_their_own(clean: None) -> None:
    seen: dict[str, Any] = {}

    def worker() -> None:
        seen["enabled"] = torch.is_autocast_enabled("cpu")
        seen["depth"] = emulate._LOCAL.depth

    with cuda_autocast():
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
    assert seen == {"enabled": False, "depth": 0}


def test_bad_dtype_is_refused(clean: None) -> None:
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        with cuda_autocast(torch.float32):
            pass


def test_should_emulate_cuda() -> None:
    assert emulate.should_emulate_cuda("cuda") == (not torch.cuda.is_available())
    assert not emulate.should_emulate_cuda("cpu")
