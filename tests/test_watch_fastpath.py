"""The watch's hot path (training/fastpath.py): (lo, hi) pairs written into reused buffers, read back exactly; gradient
hooks on autograd nodes that see what a tensor hook sees."""

from __future__ import annotations

import math

import torch
from torch import nn

import ampdoctor
from ampdoctor.training.fastpath import CHUNK_ROWS, Slabs, hang_grad_hook
from ampdoctor.training.readback import Collector


def test_pairs_of_mixed_dtypes_read_back_exactly_and_reuse_the_buffers() -> None:
    slabs = Slabs()
    torch.manual_seed(0)
    tensors = [torch.randn(7, 5, dtype=dt) * 300 for dt in (torch.float16, torch.float32, torch.bfloat16)] * 120
    tensors.append(torch.tensor([1.0, -math.inf, 2.0], dtype=torch.float16))  # a mask's -inf: lo is -inf
    first = Collector(slabs)
    loss_at = first.add(torch.tensor(3.5))
    at = [first.pair("out", f"m{i}", t, t.dtype == torch.float16) for i, t in enumerate(tensors)]
    numbers = first.read()
    assert numbers[loss_at] == 3.5
    for i, t in zip(at, tensors):  # exact: every low dtype widens to float64 without rounding
        assert (numbers[i], numbers[i + 1]) == (t.double().min().item(), t.double().max().item())
    assert numbers[at[-1]] == -math.inf
    chunks = {key: [c.data_ptr() for c in slab.chunks] for key, slab in slabs._by_key.items()}
    assert CHUNK_ROWS >= 121 and sorted(len(c) for c in chunks.values()) == [1, 1, 1]  # one chunk per dtype
    second = Collector(slabs)  # the next step writes into the same buffers
    t = torch.full((4,), 2.0, dtype=torch.float16)
    i = second.pair("out", "m", t, True)
    assert second.read()[i : i + 2] == [2.0, 2.0]
    assert {key: [c.data_ptr() for c in slab.chunks] for key, slab in slabs._by_key.items()} == chunks


def _grads(make: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient a node hook and a tensor hook see on the same tensor."""
    seen: dict[str, torch.Tensor] = {}
    w = torch.randn(4, 4, requires_grad=True)
    y = make(torch.randn(3, 4) @ w)  # type: ignore[operator]
    hang_grad_hook(y, lambda g: seen.__setitem__("node", g.clone()))
    y.register_hook(lambda g: seen.__setitem__("tensor", g.clone()))
    return y, seen  # type: ignore[return-value]


def test_a_node_hook_sees_the_tensor_hooks_gradient() -> None:
    torch.manual_seed(1)
    # used twice (the gradient is the sum), then modified in place (the value as it was)
    y, seen = _grads(lambda h: h * 1.0)
    assert y.grad_fn is not None and y._base is None
    out = (y * 2).sum() + torch.relu_(y).pow(2).sum()
    out.backward()
    assert torch.equal(seen["node"], seen["tensor"])
    # the second output of a node
    x = torch.randn(5, 3, requires_grad=True)
    got: dict[str, torch.Tensor] = {}
    pair = torch.std_mean(x * 1.0, dim=0)
    assert pair[1].output_nr == 1
    hang_grad_hook(pair[1], lambda g: got.__setitem__("mean", g.clone()))
    (pair[0].sum() + 3 * pair[1].sum()).backward()
    assert torch.equal(got["mean"], torch.full((3,), 3.0))


def test_stats_every_step_match_a_float64_reference_without_growing_buffers() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 4))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 8)
    ptrs = []
    with ampdoctor.watch(model, scaler, stats_every=1, save_bundle=False) as doctor:
        for _ in range(4):
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):  # the reference, same weights
                h = model[0](x)
                pre_relu = h.double().abs().max().item()
                r = torch.relu(h)
                o = model[2](r)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scaler.scale(out.float().pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()
            ptrs.append([c.data_ptr() for s in doctor._slabs._by_key.values() for c in s.chunks])
        step = doctor.steps[-1]
    assert ptrs[1:] == ptrs[:-1]  # no buffer allocated after the first step
    assert step.out_abs_max["0"] == pre_relu  # measured before ReLU(inplace=True) overwrote it
    assert step.out_abs_max["1"] == r.double().abs().max().item()
    assert step.out_abs_max["2"] == o.double().abs().max().item()
    assert set(step.grad_abs_max) == {"", "0", "1", "2"}
    assert not any(m._forward_hooks for m in model.modules())
