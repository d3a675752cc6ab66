"""What hidden-overflow detection costs (issue 18, item 1), in one run, as ratios to a plain AMP step.

A small transformer whose attention is written in Python (so the watch sees every op: the q/k/v projections,
``q @ k``, the mask fill, softmax, ``@ v``, GELU, residual adds), two variants of it:

* **healthy**: pre-norm blocks, q scaled before ``q @ k``, inputs N(0, 1): no op makes inf;
* **hidden**: no norms, raw sensor-like inputs (mean 400, std 100), scores computed before the 1/sqrt(d) scaling
  and clamped to +-60000 (the user's attempt at a fix): the float16 matmul makes inf that the clamp hides, every
  block; ``diagnose`` says ``hidden_overflow``.

Modes, against **plain** (autocast forward, loss, backward of the loss times 2**16, ``.grad`` set to None):
``survey`` and ``survey-off`` (one survey pass with and without the watch), ``diagnose`` and ``diagnose-off`` on
the healthy variant (with and without the watch), ``diagnose-hidden`` on the hidden variant (the survey flags,
the detailed re-run counts, classifies and locates). Goals (issue 18): a healthy diagnosis <= 2.2 plain steps, a
failing one <= 8, peak memory <= 1.25x a plain step's. Times are process CPU time (1 thread by default), modes
interleaved round by round; peak memory is the RSS high-water mark over what is resident, in a fresh subprocess
per mode (as in ``overhead.py``).

    python benchmarks/hidden_overhead.py            # about 2 minutes here
    python benchmarks/hidden_overhead.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from overhead import _reset_hwm, _status_kib
from torch import nn

import ampdoctor
import ampdoctor.capture.passes as passes
from ampdoctor.capture.options import PassOptions
from ampdoctor.capture.passes import PassSpec, run_pass

SCALE = 2.0**16
DTYPE = torch.float16
GATE_HEALTHY, GATE_FAILING, GATE_MEMORY = 2.2, 8.0, 1.25
STEP_MODES = ("plain", "survey-off", "survey")
DIAGNOSE_MODES = ("diagnose-off", "diagnose", "diagnose-hidden")


class Block(nn.Module):
    def __init__(self, d: int, heads: int, healthy: bool) -> None:
        super().__init__()
        self.heads, self.healthy = heads, healthy
        self.norm1 = nn.LayerNorm(d) if healthy else nn.Identity()
        self.norm2 = nn.LayerNorm(d) if healthy else nn.Identity()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ff1 = nn.Linear(d, 4 * d)
        self.ff2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = (z.reshape(b, t, self.heads, hd).transpose(1, 2) for z in self.qkv(self.norm1(x)).split(d, -1))
        if self.healthy:
            scores = (q * hd**-0.5) @ k.transpose(-2, -1)
        else:
            scores = (q @ k.transpose(-2, -1)).clamp(-60000.0, 60000.0) / math.sqrt(hd)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.ff2(F.gelu(self.ff1(self.norm2(x))))


class Model(nn.Module):
    def __init__(self, d: int, heads: int, layers: int, healthy: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, heads, healthy) for _ in range(layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss_fn(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return output.float().pow(2).mean() * 1e-6


def build(healthy: bool, quick: bool, batch_size: int = 8, seq: int = 32) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Model(64, 4, 2, healthy)
    batch = torch.randn(2 if quick else batch_size, seq, 64)
    if not healthy:
        batch = batch * 100 + 400
    return model, batch


@contextlib.contextmanager
def watch_off() -> Iterator[None]:
    """Passes without the hidden-overflow watch (the cost without the detection, for comparison)."""
    real = passes.HiddenWatch
    passes.HiddenWatch = lambda *a, **k: None  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        passes.HiddenWatch = real  # type: ignore[misc]


def spec_of(model: nn.Module, batch: torch.Tensor) -> PassSpec:
    return PassSpec(
        root=model,
        names={id(m): n for n, m in model.named_modules()},
        params=list(model.named_parameters()),
        batch=batch,
        loss_fn=loss_fn,
        device_type="cpu",
        dtype=DTYPE,
        backward=True,
    )


class Steps:
    def __init__(self, quick: bool, batch_size: int = 8, seq: int = 32) -> None:
        self.healthy = build(True, quick, batch_size, seq)
        self.hidden = build(False, quick, batch_size, seq)
        self.spec = spec_of(*self.healthy)
        self.reports: dict[str, Any] = {}

    def __call__(self, mode: str) -> None:
        model, batch = self.healthy
        if mode == "plain":
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=DTYPE):
                loss = loss_fn(model(batch), batch)
            (loss * SCALE).backward()
            model.zero_grad(set_to_none=True)
        elif mode in ("survey", "survey-off"):
            with watch_off() if mode == "survey-off" else contextlib.nullcontext():
                run_pass(self.spec, SCALE, PassOptions(histograms=1))
        elif mode in DIAGNOSE_MODES:
            if mode == "diagnose-hidden":
                model, batch = self.hidden
            with watch_off() if mode == "diagnose-off" else contextlib.nullcontext():
                self.reports[mode] = ampdoctor.diagnose(model, batch, loss_fn=loss_fn, device_type="cpu")
        else:
            raise ValueError(mode)


def time_modes(steps: Steps, repeats: int, diagnose_repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {m: [] for m in (*STEP_MODES, *DIAGNOSE_MODES)}
    for mode in (*STEP_MODES, *DIAGNOSE_MODES):
        steps(mode)  # warm-up
    clock = time.process_time
    for r in range(repeats):
        order = STEP_MODES[r % 3 :] + STEP_MODES[: r % 3]
        for mode in order:
            start = clock()
            steps(mode)
            times[mode].append(clock() - start)
    for r in range(diagnose_repeats):
        for mode in DIAGNOSE_MODES[r % 3 :] + DIAGNOSE_MODES[: r % 3]:
            start = clock()
            steps(mode)
            times[mode].append(clock() - start)
            times["plain"].append(_plain_time(steps, clock))  # keep plain interleaved with the diagnoses too
    return times


def _plain_time(steps: Steps, clock: Any) -> float:
    start = clock()
    steps("plain")
    return clock() - start


def memory_worker(mode: str, args: argparse.Namespace) -> None:
    steps = Steps(args.quick, args.batch, args.seq)
    steps("plain")
    steps(mode)
    gc.collect()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = _status_kib("VmRSS") or 0
    if not _reset_hwm():
        print("HIDDEN_MEMORY null")
        return
    steps(mode)
    print("HIDDEN_MEMORY " + json.dumps(((_status_kib("VmHWM") or 0) - base) / 1024))


def measure_memory(mode: str, args: argparse.Namespace) -> Optional[float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--_memory", mode, "--threads", str(args.threads),
           "--batch", str(args.batch), "--seq", str(args.seq)]
    if args.quick:
        cmd.append("--quick")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MALLOC_MMAP_THRESHOLD_="131072",
               MALLOC_TRIM_THRESHOLD_="131072")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("HIDDEN_MEMORY "):
            value = json.loads(line.split(" ", 1)[1])
            return None if value is None else float(value)
    print(f"[memory worker failed for {mode}]\n{(proc.stderr or proc.stdout)[-2000:]}", file=sys.stderr)
    return None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds of the step modes")
    parser.add_argument("--diagnose-repeats", type=int, default=3, help="timed rounds of the diagnoses")
    parser.add_argument("--batch", type=int, default=8, help="sequences per batch (default 8)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence (default 32)")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--_memory", dest="memory", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory:
        memory_worker(args.memory, args)
        return 0
    steps = Steps(args.quick, args.batch, args.seq)
    times = time_modes(steps, 2 if args.quick else args.repeats, 1 if args.quick else args.diagnose_repeats)
    plain = statistics.median(times["plain"])
    ratio = {m: statistics.median(v) / plain for m, v in times.items() if v}
    print(f"torch {torch.__version__}, {args.threads} thread(s), CPU float16, batch {args.batch} x {args.seq} "
          f"tokens; plain step {plain * 1e3:.1f} ms (process time, median)")
    for mode in (*STEP_MODES[1:], *DIAGNOSE_MODES):
        report = steps.reports.get(mode)
        passes_run = f", {len(report.run.passes)} passes, verdict {report.verdict}" if report is not None else ""
        print(f"  {mode:16s} {ratio[mode]:6.2f}x plain{passes_run}")
    hidden = steps.reports["diagnose-hidden"].findings.hidden
    print(f"  hidden overflows found: {len(hidden)} ("
          + ", ".join(f"{h.label} {h.op} x{h.count} hidden by {h.hidden_by}" for h in hidden[:4]) + ")")
    print(f"  watch's own cost in the survey: {ratio['survey'] - ratio['survey-off']:+.2f} plain steps; "
          f"in a healthy diagnose: {ratio['diagnose'] - ratio['diagnose-off']:+.2f}")
    memory = {} if args.no_memory else {m: measure_memory(m, args) for m in ("plain", "diagnose", "diagnose-hidden")}
    if memory.get("plain"):
        base = memory["plain"]
        for m in ("diagnose", "diagnose-hidden"):
            value = memory.get(m)
            print(f"  peak memory {m}: " + ("n/a" if value is None or base is None else f"{value / base:.2f}x plain"
                                            f" ({value:.1f} MiB vs {base:.1f} MiB)"))
    ok_healthy = ratio["diagnose"] <= GATE_HEALTHY
    ok_failing = ratio["diagnose-hidden"] <= GATE_FAILING
    print(f"goals: healthy diagnose <= {GATE_HEALTHY}x: {'holds' if ok_healthy else 'MISSED'}; "
          f"failing (hidden) <= {GATE_FAILING}x: {'holds' if ok_failing else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
