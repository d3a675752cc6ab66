"""What ``ampdoctor.watch`` costs next to the same training loop without it, measured in the same run.

For three models (a 4-layer ``nn.TransformerEncoder``, an 8x1024 MLP and a small convnet with BatchNorm) this
times the classic loop — ``autocast`` forward, loss, ``scaler.scale(loss).backward()``, ``scaler.step(opt)``,
``scaler.update()`` with AdamW — in three modes:

* **plain**: the loop alone;
* **watch**: the loop inside ``ampdoctor.watch(model, scaler)`` with its defaults (per step: the loss, the root
  outputs, the scale and GradScaler's found-inf flags, read back once; per-module statistics every 50 steps);
* **watch, stats every step**: ``stats_every=1`` (every module's outputs measured at every step, by an instance
  ``forward`` wrapper that keeps torch's hook-free call path, and a gradient hook on each output).

Modes are interleaved block by block (the order rotated each round) so drift in machine speed hits them alike.
Each block is timed in process CPU time (``time.process_time``: what other processes on a loaded machine do
costs nothing here), and the table shows the best (minimum) time per step over the rounds and, per mode, the
median of its per-round ratios to the plain block of the same round with their interquartile range (the spread).
Warm-up steps come first (GradScaler's first skipped steps, ampdoctor's captures of them and
``torch.compile``'s compilations happen there); the table says if a measured step was skipped.

``--compile`` runs every mode on ``torch.compile(model)`` (inductor by default; ``--backend aot_eager`` for a
quick run): the watched compiled loop against the plain compiled loop.

CPUs without native float16 arithmetic emulate float16 matmuls slowly, which makes the watch's fixed costs look
small; ``--compute float32`` runs the same loops with autocast off (much faster steps, the same watch work) as a
stress test.

    python benchmarks/watch_overhead.py                      # 1 thread, CPU, float16 autocast
    python benchmarks/watch_overhead.py --compute float32    # the stress test
    python benchmarks/watch_overhead.py --quick              # smoke run
    python benchmarks/watch_overhead.py --compile --models mlp   # compiled loops (inductor: minutes to compile)
    python benchmarks/watch_overhead.py --layers 200 --floor     # the narrow MLP, against bare per-module hooks
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

import ampdoctor

MODES = ("plain", "watch", "watch_every")
MODE_TITLES = {
    "plain": "plain loop", "watch": "watch (defaults)", "watch_every": "watch, stats every step",
    "floor": "bare hooks (the floor of per-module hooks)",
}
TARGETS = {"watch": 1.03, "watch_every": 1.10}


@dataclass
class Case:
    name: str
    model: nn.Module
    make_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    called: Optional[nn.Module] = None  # what the loop calls (the compiled model), else ``model``


def cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float(), target)


def transformer(large: bool) -> Case:
    d, seq, batch = (256, 64, 16) if large else (128, 32, 8)
    layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, dropout=0.1, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False), nn.Linear(d, 10))
    x = torch.randn(batch, seq, d)
    y = torch.randint(0, 10, (batch, seq))

    def loss(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float().flatten(0, 1), t.flatten())

    return Case(f"transformer encoder (4 x d{d}, {batch}x{seq} tokens)", model, lambda: (x, y), loss)


def mlp(large: bool) -> Case:
    width, batch = (1024, 256) if large else (256, 64)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    x = torch.randn(batch, width)
    y = torch.randint(0, 10, (batch,))
    return Case(f"MLP (8 x {width}, batch {batch})", model, lambda: (x, y), cross_entropy)


def convnet(large: bool) -> Case:
    batch, size = (32, 32) if large else (8, 16)

    def block(c_in: int, c_out: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))

    model = nn.Sequential(
        block(3, 32),
        block(32, 32),
        nn.MaxPool2d(2),
        block(32, 64),
        block(64, 64),
        nn.MaxPool2d(2),
        block(64, 128),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    )
    x = torch.randn(batch, 3, size, size)
    y = torch.randint(0, 10, (batch,))
    return Case(f"convnet (5 conv + BN, {batch}x3x{size}x{size})", model, lambda: (x, y), cross_entropy)


class BareHooks:
    """The least any per-module watch can do with Python hooks, for comparison (``--floor``): a forward hook on
    every module that measures its output with one ``aminmax`` into a preallocated slot and hangs one autograd
    node pre-hook that measures the output's gradient the same way; nothing recorded, nothing read back. What
    ``watch`` with statistics every step costs beyond this is its own bookkeeping; what this costs is the price
    of Python hooks per module (torch's hooked call path, the node hook's registration and call). The watch itself
    is built below this floor: no module hook (a ``forward`` wrapper keeps torch's fast call path) and gradient
    hooks set in C (the tensor's own hook dict), so its ratio can come out under this one."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.slot = torch.empty(2)
        self.slots: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self.handles: list[Any] = []
        self.tensor_handles: list[Any] = []

    def _out(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.slots.get(t.dtype)
        if out is None:
            out = self.slots[t.dtype] = torch.empty(2, dtype=t.dtype).unbind(0)  # type: ignore[assignment]
        return out  # type: ignore[return-value]

    def _grad(self, grads: tuple[Optional[torch.Tensor], ...]) -> None:
        g = grads[0] if grads else None
        if g is not None and g.numel():
            torch.aminmax(g, out=self._out(g))

    def _forward(self, module: nn.Module, args: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.is_floating_point() and out.numel():
            torch.aminmax(out.detach(), out=self._out(out))
            if out.grad_fn is not None:
                self.tensor_handles.append(out.grad_fn.register_prehook(self._grad))

    def _root(self, module: nn.Module, args: Any) -> None:
        for handle in self.tensor_handles:  # the previous step's node hooks
            handle.remove()
        self.tensor_handles.clear()

    @contextlib.contextmanager
    def start(self) -> Any:
        self.handles = [self.model.register_forward_pre_hook(self._root)]
        self.handles += [m.register_forward_hook(self._forward) for m in self.model.modules() if m is not self.model]
        try:
            yield self
        finally:
            for handle in self.handles + self.tensor_handles:
                handle.remove()
            self.handles, self.tensor_handles = [], []


def narrow_mlp(layers: int) -> Case:
    """The cost benchmark's model (``cost_per_module.py --parts watch``): where Python work per module dominates."""
    mods: list[nn.Module] = []
    for _ in range(layers):
        linear = nn.Linear(64, 64)
        nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")
        nn.init.zeros_(linear.bias)
        mods += [linear, nn.ReLU()]
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    return Case(f"{layers}-layer narrow MLP", nn.Sequential(*mods, nn.Linear(64, 10)), lambda: (x, y), cross_entropy)


def run_block(
    case: Case, doctor: Any, scaler: torch.amp.GradScaler, opt: torch.optim.Optimizer,
    steps: int, amp: bool,
) -> tuple[float, int]:
    """CPU seconds per step over ``steps`` steps, and how many of them GradScaler skipped. ``doctor`` (None for the
    plain loop) is started for the block and closed after it; its step count goes on from block to block, so
    its sampled steps come every ``stats_every`` steps of the whole measurement, as in one long training run."""
    model = case.called or case.model
    skipped = 0
    with doctor.start() if doctor is not None else contextlib.nullcontext():
        start = time.process_time()
        for _ in range(steps):
            x, y = case.make_batch()
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
                out = model(x)
            loss = case.loss(out, y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            before = scaler.get_scale()
            scaler.update()
            skipped += scaler.get_scale() < before
        elapsed = time.process_time() - start
    return elapsed / steps, skipped


def measure(
    case: Case, rounds: int, steps: int, warmup: int, amp: bool, floor: bool = False, lr: float = 1e-5
) -> dict[str, Any]:
    """``floor``: also time :class:`BareHooks` (mode ``"floor"``), interleaved with the others. ``lr``: AdamW's
    learning rate (0: the same optimizer work on weights that stay put, so activations do not drift)."""
    modes = (*MODES, "floor") if floor else MODES
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.AdamW(case.model.parameters(), lr=lr)
    doctors: dict[str, Any] = {"plain": None}
    for mode, every in (("watch", 50), ("watch_every", 1)):
        doctors[mode] = ampdoctor.Watch(
            case.called or case.model, scaler, stats_every=every, dtype=torch.float16, save_bundle=False
        )
    if floor:
        doctors["floor"] = BareHooks(case.called or case.model)
    for mode in modes:  # warm-up: first skips (and their captures), allocator, lazy imports, compilation
        run_block(case, doctors[mode], scaler, opt, warmup, amp)
    times: dict[str, list[float]] = {m: [] for m in modes}
    skipped = 0
    # the first measured step of each watch (its step count goes on from the warm-up)
    first_measured = {m: d.steps[-1].step + 1 if d.steps else 0
                      for m, d in doctors.items() if isinstance(d, ampdoctor.Watch)}
    for r in range(rounds):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        for mode in order:
            per_step, skips = run_block(case, doctors[mode], scaler, opt, steps, amp)
            times[mode].append(per_step)
            skipped += skips
    best = {m: min(v) for m, v in times.items()}  # CPU time: noise only ever adds, so the minimum is the cost
    # Each round's ratio to the plain block of the same round (neighbours in time see the same machine): the
    # median is the figure, the quartiles its spread.
    per_round = {m: sorted(t / p for t, p in zip(times[m], times["plain"])) for m in modes}
    ratios = {m: statistics.median(v) for m, v in per_round.items()}
    spread = {m: (_quantile(v, 0.25), _quantile(v, 0.75)) for m, v in per_round.items()}
    return {
        "model": case.name, "best_s": best, "ratio": ratios, "ratio_iqr": spread,
        "ratio_range": {m: (v[0], v[-1]) for m, v in per_round.items()},
        "ratio_best": {m: best[m] / best["plain"] for m in modes}, "skipped_in_measurement": skipped,
        # per watch: the measured steps that took per-module statistics (every ``stats_every`` steps, and the dense
        # window after a trend the forecast saw: a model whose activations drift is sampled more)
        "sampled_in_measurement": {m: sum(1 for r in doctors[m].steps if r.sampled and r.step >= first)
                                   for m, first in first_measured.items()},
    }


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks."""
    at = q * (len(sorted_values) - 1)
    lo = int(at)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (at - lo)


def ratio_text(res: dict[str, Any], mode: str) -> str:
    """``1.012x [1.004-1.020]``: the median per-round ratio and its interquartile range."""
    lo, hi = res["ratio_iqr"][mode]
    return f"{res['ratio'][mode]:.3f}x [{lo:.3f}-{hi:.3f}]"


def table(results: list[dict[str, Any]]) -> str:
    rows = []
    floor = any("floor" in res["best_s"] for res in results)
    for res in results:
        med = res["best_s"]
        rows.append(
            [
                res["model"],
                f"{med['plain'] * 1e3:.1f}",
                f"{med['watch'] * 1e3:.1f}",
                ratio_text(res, "watch"),
                f"{med['watch_every'] * 1e3:.1f}",
                ratio_text(res, "watch_every"),
                *([f"{med['floor'] * 1e3:.1f}", ratio_text(res, "floor")] if floor else []),
                res["skipped_in_measurement"],
            ]
        )
    headers = ["model", "plain ms/step", "watch ms/step", "ratio [IQR]", "stats every step ms/step", "ratio [IQR]",
               *(["bare hooks ms/step", "ratio [IQR]"] if floor else []), "skipped"]
    return tabulate(rows, headers=headers, tablefmt="github")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--large", action="store_true", help="larger models (for CPUs with fast float16 matmuls)")
    parser.add_argument(
        "--compute",
        choices=("float16", "float32"),
        default="float16",
        help="float32: autocast off, a stress test: CPUs without native float16 emulate its matmuls slowly, "
        "which hides fixed costs; in float32 the same loop is much faster and the watch's costs show",
    )
    parser.add_argument("--compile", action="store_true", help="run every mode on torch.compile(model)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend with --compile")
    parser.add_argument("--models", default="transformer,mlp,convnet", help="comma-separated subset")
    parser.add_argument("--quick", action="store_true", help="few rounds (a smoke run)")
    parser.add_argument("--floor", action="store_true",
                        help="also time bare per-module hooks (one aminmax per output and per output gradient)")
    parser.add_argument("--layers", type=int, default=0,
                        help="instead of --models: the narrow MLP of this many Linear(64, 64)+ReLU layers")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 3, 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    amp = args.compute == "float16"
    makers = {"transformer": transformer, "mlp": mlp, "convnet": convnet}
    results = []
    cases = [narrow_mlp(args.layers)] if args.layers else [makers[name](args.large) for name in args.models.split(",")]
    for case in cases:
        if args.compile:
            case.called = torch.compile(case.model, backend=args.backend)
            case.name += f", compiled ({args.backend})"
        results.append(measure(case, args.rounds, args.steps, args.warmup, amp, floor=args.floor))
    print(table(results))
    print(
        f"\ntorch {torch.__version__}, {platform.machine()}, {args.threads} thread(s), "
        + ("float16 autocast" if amp else "float32 (autocast off: stress test)")
        + f" on CPU, AdamW; process CPU time; best block (ms/step) and median [interquartile range] of the "
        f"per-round ratios to the plain block of the same round, {args.rounds} rounds of interleaved blocks of "
        f"{args.steps} steps; targets: defaults <= {TARGETS['watch']:.2f}x, stats every step "
        f"<= {TARGETS['watch_every']:.2f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "compute": args.compute, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
