"""The CUDA-policy emulation against hand-written CUDA-policy variants of small models.

Each model's modules carry a ``hand`` switch: off, the code is what a user writes (autocast decides the dtypes);
on, the code spells CUDA autocast's casts out (``.half()`` before matmuls, ``.float()`` / ``dtype=torch.float32``
for CUDA's float32 list) and runs without autocast. The emulation must match the hand-written variant op by op
(every aten op of forward and backward, with input and output dtypes), in the first op and the first module that
make a non-finite value, and in the dtypes of intermediate tensors and of their gradients. Native CPU autocast
is run too, to show each case tells the two policies apart (the control case shows where they agree).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from test_policy import _state
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ampdoctor.capture.emulate import cuda_autocast, installed_cuda_policy

F16, F32 = torch.float16, torch.float32
Op = tuple[str, str, tuple[str, ...], tuple[str, ...]]  # phase, op, input dtypes, output dtypes


def _floats(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _floats(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _floats(v)]
    return []


def _finite(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


class _Recorder(TorchDispatchMode):
    """Every aten op below autograd, and the first one per phase that makes a non-finite value from finite ones."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.ops: list[Op] = []
        self.first_bad: dict[str, tuple[int, str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = str(func._schema.name) + ("" if func._overloadname == "default" else "." + func._overloadname)
        ins, outs = _floats((args, kwargs or {})), _floats(out)
        self.ops.append((self.phase, name, tuple(str(t.dtype) for t in ins), tuple(str(t.dtype) for t in outs)))
        if self.phase not in self.first_bad and _finite(ins) and not _finite(outs):
            self.first_bad[self.phase] = (len(self.ops) - 1, name)
        return out


class Part(nn.Module):
    """A module with the ``hand`` switch and a place to leave intermediate tensors (``taps``) for the test."""

    hand = False

    def __init__(self) -> None:
        super().__init__()
        self.taps: dict[str, torch.Tensor] = {}


def _linear(part: Part, lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear under autocast, or CUDA's lower-precision cast written out."""
    if part.hand:
        return F.linear(x.half(), lin.weight.half(), lin.bias.half())
    return lin(x)


class Lin(Part):
    def __init__(self, n_in: int, n_out: int, scale: float = 1.0, bias: float = 0.0) -> None:
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)
        with torch.no_grad():
            self.lin.weight.copy_(scale * torch.linspace(0.5, 1.0, n_in * n_out).reshape(n_out, n_in))
            self.lin.bias.fill_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self, self.lin, x)


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    """No kernel, flag or cache of the emulation survives a case."""
    before = _state()
    yield
    assert _state() == before


# -- the models ----------------------------------------------------------------------------------------------


class DFT(Part):
    """A fixed real/imaginary DFT basis as a strided conv1d (n_fft 16, hop 8, bins 0..7)."""

    def __init__(self) -> None:
        super().__init__()
        n, k = torch.arange(16.0), torch.arange(8.0)[:, None]
        angle = 2 * math.pi * k * n / 16
        self.register_buffer("basis", torch.cat([torch.cos(angle), -torch.sin(angle)])[:, None, :])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hand:
            return F.conv1d(x.half(), self.basis.half(), stride=8)
        return F.conv1d(x, self.basis, stride=8)


class Power(Part):
    def forward(self, spec: torch.Tensor) -> torch.Tensor:
        re, im = spec.chunk(2, dim=1)
        self.taps["re"] = re
        if self.hand:
            return re.float() ** 2 + im.float() ** 2
        return re**2 + im**2


class LogCompress(Part):
    def forward(self, power: torch.Tensor) -> torch.Tensor:
        return torch.log(power + 1.0).transpose(1, 2)


def spectrogram() -> tuple[nn.Module, torch.Tensor]:
    # A tone at bin 2, amplitude 40: |re| = 40 * 16 / 2 = 320 and re**2 = 102400 > 65504: float16 pow overflows
    # on CPU; CUDA runs pow in float32 (log then brings it to ~11.5 for the float16 head).
    model = nn.Sequential()
    model.add_module("dft", DFT())
    model.add_module("power", Power())
    model.add_module("log", LogCompress())
    model.add_module("head", Lin(8, 4, scale=0.1))
    x = 40 * torch.cos(2 * math.pi * 2 * torch.arange(64.0) / 16)
    return model, x.reshape(1, 1, 64)


class ExpNorm(Part):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.taps["h"] = h
        y = h.float().exp() if self.hand else h.exp()
        total = y.sum(-1, keepdim=True, dtype=F32) if self.hand else y.sum(-1, keepdim=True)
        self.taps["y"] = y
        return y / total


def exp_overflow() -> tuple[nn.Module, torch.Tensor]:
    # h reaches 12 and e**12 = 162755 > 65504: float16 exp overflows on CPU (then inf / inf = NaN).
    model = nn.Sequential()
    model.add_module("proj", Lin(4, 8, scale=3.0))
    model.add_module("gate", ExpNorm())
    model.add_module("head", Lin(8, 2))
    return model, torch.ones(2, 4)


class Total(Part):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.taps["h"] = h
        total = h.sum(dtype=F32) if self.hand else h.sum()
        return (total / h.shape[0]).reshape(1, 1)


def long_sum() -> tuple[nn.Module, torch.Tensor]:
    # 70,000 ones: the float16 sum is 70000 > 65504 -> inf on CPU; CUDA's sum runs with dtype=float32.
    model = nn.Sequential()
    model.add_module("ones", Lin(1, 1, scale=2.0))  # linspace(0.5, 1, 1) = [0.5]: weight 1.0
    model.add_module("total", Total())
    model.add_module("head", Lin(1, 1))
    return model, torch.ones(70_000, 1)


class LogProb(Part):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(z, -1, dtype=F32) if self.hand else torch.softmax(z, -1)
        self.taps["p"] = p
        return torch.log(p)


def log_softmax_by_hand() -> tuple[nn.Module, torch.Tensor]:
    # Logits [10, 0, -10]: the smallest probability is ~2e-9, below float16's smallest subnormal (6e-8), so the
    # CPU float16 softmax gives 0 and log gives -inf; CUDA's float32 softmax keeps it and log gives ~-20.
    model = nn.Sequential()
    model.add_module("logits", Lin(1, 3))
    model.add_module("logprob", LogProb())
    model.add_module("head", Lin(3, 2))
    with torch.no_grad():
        model.logits.lin.weight.copy_(torch.tensor([[10.0], [0.0], [-10.0]]))
    return model, torch.ones(2, 1)


class Norm(Part):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        with torch.no_grad():
            self.ln.weight.fill_(70_000.0)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.taps["h"] = h
        if self.hand:
            out = F.layer_norm(h.float(), (8,), self.ln.weight, self.ln.bias, self.ln.eps)
        else:
            out = self.ln(h)
        self.taps["out"] = out
        return out


def layer_norm_affine() -> tuple[nn.Module, torch.Tensor]:
    # Normalised values up to ~1.5 times a weight of 70,000 exceed 65504. On CPU the float16 layer norm overflows
    # in `norm`; under CUDA's policy the layer norm is float32 and finite, and the overflow moves to `out`, whose
    # linear casts its input to float16 (aten::_to_copy).
    model = nn.Sequential()
    model.add_module("proj", Lin(8, 8))
    model.add_module("norm", Norm())
    model.add_module("out", Lin(8, 2))
    with torch.no_grad():
        model.proj.lin.weight.copy_(torch.eye(8))  # h = x: eight distinct values per row
    return model, torch.linspace(-1, 1, 16).reshape(2, 8)


class Running(Part):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        c = h.cumsum(-1, dtype=F32) if self.hand else h.cumsum(-1)
        self.taps["c"] = c
        return c / torch.arange(1, h.shape[-1] + 1, device=h.device)


def cumulative_sum() -> tuple[nn.Module, torch.Tensor]:
    # 100 values near 1000: the running sum passes 65504 after ~70 steps (inf in float16 on CPU).
    model = nn.Sequential()
    model.add_module("proj", Lin(2, 100, scale=1000.0 / 1.5, bias=0.0))
    model.add_module("running", Running())
    model.add_module("head", Lin(100, 2, scale=0.001))
    return model, torch.ones(1, 2)


def _mha_by_hand(mha: nn.MultiheadAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """F.multi_head_attention_forward's need_weights path (self-attention, no mask, no dropout), CUDA's casts
    written out: linear and bmm in float16, softmax in float32."""
    length, batch, embed = x.shape
    heads = mha.num_heads
    head_dim = embed // heads
    proj = F.linear(x.half(), mha.in_proj_weight.half(), mha.in_proj_bias.half())
    proj = proj.unflatten(-1, (3, embed)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
    q, k, v = proj[0], proj[1], proj[2]
    q = q.view(length, batch * heads, head_dim).transpose(0, 1)
    k = k.view(k.shape[0], batch * heads, head_dim).transpose(0, 1)
    v = v.view(v.shape[0], batch * heads, head_dim).transpose(0, 1)
    q_scaled = q * math.sqrt(1.0 / float(head_dim))
    weights = torch.bmm(q_scaled, k.transpose(-2, -1))
    weights = F.softmax(weights, dim=-1, dtype=F32)
    out = torch.bmm(weights.half(), v)
    out = out.transpose(0, 1).reshape(length * batch, embed)
    out = F.linear(out, mha.out_proj.weight.half(), mha.out_proj.bias.half())
    out = out.view(length, batch, out.size(1))
    return out, weights.view(batch, heads, length, length).mean(dim=1)


class Attention(Part):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2)
        with torch.no_grad():
            self.mha.in_proj_weight.copy_(3.0 * torch.eye(8).repeat(3, 1))
            self.mha.in_proj_bias.zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, weights = _mha_by_hand(self.mha, x) if self.hand else self.mha(x, x, x, need_weights=True)
        self.taps["weights"] = weights
        return out, weights


class LogWeights(Part):
    def forward(self, out_weights: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        out, weights = out_weights
        return out, torch.log(weights)


def attention() -> tuple[nn.Module, torch.Tensor]:
    # Two tokens, +1 and -1 on every channel, q = k = v = 3x, two heads of 4 channels: scores +-36 / sqrt(4) =
    # +-18 in each head, so each token gives the other e**-36 = 2e-16 of its weight: 0 in float16 (CPU's softmax),
    # positive in float32 (CUDA's softmax). The head-averaged weights then give log = -inf vs ~-36.
    model = nn.Sequential()
    model.add_module("attn", Attention())
    model.add_module("logw", LogWeights())
    x = torch.ones(2, 1, 8)
    x[1] = -1.0
    return model, x


class Classifier(Part):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 4)
        with torch.no_grad():
            self.fc2.weight.fill_(10_000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(_linear(self, self.fc1, x))
        self.taps["h"] = h
        out = _linear(self, self.fc2, h)
        self.taps["out"] = out
        target = torch.zeros(2, 4, device=out.device)
        if self.hand:
            return F.mse_loss(out.float(), target).reshape(1)
        return F.mse_loss(out, target).reshape(1)


def control() -> tuple[nn.Module, torch.Tensor]:
    # Both policies run linear in float16 and mse_loss in float32: fc2's float16 matmul overflows under both.
    model = nn.Sequential()
    model.add_module("clf", Classifier())
    torch.manual_seed(0)
    nn.init.uniform_(model.clf.fc1.weight, 0.5, 1.0)
    return model, torch.ones(2, 4)


# -- running a case ------------------------------------------------------------------------------------------


@dataclass
class Result:
    ops: list[Op]
    first_bad: dict[str, tuple[int, str]]
    first_bad_module: Optional[str]
    outputs: tuple[str, ...]
    taps: dict[str, tuple[str, Optional[str]]] = field(default_factory=dict)  # name -> (dtype, grad dtype)
    grads: dict[str, str] = field(default_factory=dict)


def run(build: Callable[[], tuple[nn.Module, torch.Tensor]], mode: str) -> Result:
    """One forward and backward in ``mode``: "cpu" (native CPU autocast), "cuda_emulated", "cuda_by_hand", or
    "cuda" (real CUDA autocast on a GPU)."""
    torch.manual_seed(0)
    model, x = build()
    if mode == "cuda":
        model, x = model.cuda(), x.cuda()
    x.requires_grad_(True)  # the gradient reaches the front end (the spectrogram's basis is a fixed buffer)
    parts = [m for m in model.modules() if isinstance(m, Part)]
    for part in parts:
        part.hand = mode == "cuda_by_hand"
    bad_modules: list[str] = []

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, out: Any) -> None:
            if not _finite(_floats(out)):
                bad_modules.append(name)

        return record

    for name, child in model.named_children():
        child.register_forward_hook(hook(name))
    installed = installed_cuda_policy() if mode == "cuda_emulated" else nullcontext()
    region = {
        "cpu": lambda: torch.autocast("cpu", dtype=F16),
        "cuda_emulated": lambda: cuda_autocast(F16),
        "cuda": lambda: torch.autocast("cuda", dtype=F16),
    }
    with installed, _Recorder() as rec:
        with region[mode]() if mode in region else nullcontext():
            out = model(x)
        for part in parts:
            for tap in part.taps.values():
                tap.retain_grad()
        rec.phase = "backward"
        sum(t.float().sum() for t in _floats(out)).backward()
    taps = {
        f"{type(p).__name__}.{k}": (str(t.dtype), None if t.grad is None else str(t.grad.dtype))
        for p in parts
        for k, t in p.taps.items()
    }
    grads = {n: str(p.grad.dtype) for n, p in model.named_parameters() if p.grad is not None}
    outputs = tuple(str(t.dtype) for t in _floats(out))
    return Result(rec.ops, rec.first_bad, bad_modules[0] if bad_modules else None, outputs, taps, grads)


CASES = {
    "spectrogram": spectrogram,
    "exp": exp_overflow,
    "long_sum": long_sum,
    "log_softmax": log_softmax_by_hand,
    "layer_norm": layer_norm_affine,
    "cumsum": cumulative_sum,
    "attention": attention,
    "control": control,
}
# (first forward op that makes a non-finite value, its module) under CPU's and under CUDA's policy.
EXPECTED = {
    "spectrogram": (("aten::pow.Tensor_Scalar", "power"), (None, None)),
    "exp": (("aten::exp", "gate"), (None, None)),
    "long_sum": (("aten::sum", "total"), (None, None)),
    "log_softmax": (("aten::log", "logprob"), (None, None)),
    "layer_norm": (("aten::native_layer_norm", "norm"), ("aten::_to_copy", "out")),
    "cumsum": (("aten::cumsum", "running"), (None, None)),
    "attention": (("aten::log", "logw"), (None, None)),
    "control": (("aten::addmm", "clf"), ("aten::addmm", "clf")),
}
# Intermediate tensors: (dtype, gradient dtype) under CUDA's policy.
H16, H32 = ("torch.float16", "torch.float16"), ("torch.float32", "torch.float32")
EXPECTED_TAPS = {
    "spectrogram": {"Power.re": H16},
    "exp": {"ExpNorm.h": H16, "ExpNorm.y": H32},
    "long_sum": {"Total.h": H16},
    "log_softmax": {"LogProb.p": H32},
    "layer_norm": {"Norm.h": H16, "Norm.out": H32},
    "cumsum": {"Running.c": H32},
    "attention": {"Attention.weights": H32},
    "control": {"Classifier.h": H16, "Classifier.out": H16},
}


def _first(result: Result) -> tuple[Optional[str], Optional[str]]:
    bad = result.first_bad.get("forward")
    return (bad[1] if bad else None), result.first_bad_module


@pytest.mark.parametrize("case", list(CASES))
def test_emulation_matches_the_hand_written_cuda_policy(case: str) -> None:
    emulated, by_hand = run(CASES[case], "cuda_emulated"), run(CASES[case], "cuda_by_hand")
    assert emulated.ops == by_hand.ops  # every aten op, forward and backward, with its dtypes
    assert emulated.first_bad == by_hand.first_bad  # same op, same position, both phases
    assert _first(emulated) == _first(by_hand) == EXPECTED[case][1]
    assert emulated.outputs == by_hand.outputs
    assert emulated.taps == by_hand.taps
    assert emulated.grads == by_hand.grads and set(emulated.grads.values()) == {"torch.float32"}
    for name, dtypes in EXPECTED_TAPS[case].items():
        assert emulated.taps[name] == dtypes, name


@pytest.mark.parametrize("case", list(CASES))
def test_native_cpu_autocast_tells_the_cases_apart(case: str) -> None:
    cpu, emulated = run(CASES[case], "cpu"), run(CASES[case], "cuda_emulated")
    assert _first(cpu) == EXPECTED[case][0]
    if case == "control":  # both policies agree op by op
        assert cpu.ops == emulated.ops and cpu.taps == emulated.taps
    else:
        assert cpu.ops != emulated.ops


def test_spectrogram_backward_runs_pow_in_float32() -> None:
    emulated = run(spectrogram, "cuda_emulated")
    backward = [(op, ins, outs) for phase, op, ins, outs in emulated.ops if phase == "backward"]
    pow_grads = [b for b in backward if b[0] == "aten::pow.Tensor_Scalar"]
    assert pow_grads and all(outs == ("torch.float32",) for _, _, outs in pow_grads)
    # the float32 gradient goes back to float16 on its way to the conv (the cast's backward)
    assert ("aten::_to_copy", ("torch.float32",), ("torch.float16",)) in backward


# The ops whose dtype the policy decides, compared with real CUDA by name and dtypes (kernel choices such as
# cudnn_convolution or half_to_float softmax make the full traces differ between devices).
_POLICY_OPS = {
    "aten::exp",
    "aten::pow.Tensor_Scalar",
    "aten::sum",
    "aten::sum.dim_IntList",
    "aten::cumsum",
    "aten::log",
    "aten::native_layer_norm",
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::mse_loss",
}


def _policy_ops(result: Result) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(phase, op, outs) for phase, op, _, outs in result.ops if op in _POLICY_OPS]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", list(CASES))
def test_real_cuda_autocast_matches_the_emulation(case: str) -> None:
    real, emulated = run(CASES[case], "cuda"), run(CASES[case], "cuda_emulated")
    assert _first(real) == _first(emulated) == EXPECTED[case][1]
    assert real.outputs == emulated.outputs
    assert real.taps == emulated.taps
    assert real.grads == emulated.grads
    assert _policy_ops(real) == _policy_ops(emulated)
