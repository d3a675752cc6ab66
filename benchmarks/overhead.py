"""How much an ampdoctor capture costs next to a plain AMP step, and next to transformers' DebugUnderflowOverflow.

For four models (an 8x1024 MLP, a 4-layer ``nn.TransformerEncoder``, a small convnet with BatchNorm and a
200-layer narrow MLP) this measures, at a stated thread count, the median step time (``--clock``: CPU time of the
process by default on CPU, so that waiting for a core on a shared machine does not count; wall clock on CUDA) of:

* **plain**: one AMP training step without optimizer: ``autocast`` forward, loss, backward of the loss times
  the loss scale (GradScaler's default 2**16), ``.grad`` set to ``None`` first;
* **survey**: one ampdoctor survey pass, ``run_pass(spec, scale, detailed=False)`` with the ``PassSpec`` built
  as ``ampdoctor.diagnose`` builds it: the same forward, loss and scaled backward, with forward hooks on every
  module and gradient hooks on what they return and on every parameter, statistics read back once;
* **diagnose**: a whole ``ampdoctor.diagnose`` call. It runs several passes by design (the survey, then
  reference backwards, scale probes or a detailed re-run as the findings require), so its ratio is not the
  per-step overhead; the table says how many passes it ran;
* **DebugUnderflowOverflow** (when ``transformers`` is installed): the plain step on a copy of the model with
  ``transformers.debug_utils.DebugUnderflowOverflow`` attached (forward only; that tool never removes its
  hooks, so it is attached to a deep copy and its hooks are taken off afterwards).

Timed modes are interleaved round by round (and the order rotated) so that drift in machine speed hits them
alike. Peak memory is measured in a fresh subprocess per (model, mode); see ``--help`` and the printed notes.

    python benchmarks/overhead.py                      # 1 thread, CPU
    python benchmarks/overhead.py --quick              # smoke run
    python benchmarks/overhead.py --device cuda        # CUDA; also counts host syncs per step
    python benchmarks/overhead.py --batch-div 8        # CPUs without fast fp16 matmuls (AVX2 only): smaller batches

Peak memory (CPU): RSS high-water mark growth over the measured steps in a fresh process, the mark reset after
warm-up through ``/proc/self/clear_refs`` (Linux); it includes Python objects, which tensor-allocator statistics
would miss. CUDA: the caching allocator's peak over the memory allocated before the step.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

import ampdoctor
import ampdoctor.api as ampdoctor_api
from ampdoctor.capture.passes import PassSpec, run_pass

SCALE = 2.0**16  # torch.amp.GradScaler's default initial scale, the one diagnose uses without a scaler
DTYPE = torch.float16

LossFn = Callable[[Any, Any], torch.Tensor]


# -- models ------------------------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    description: str
    model: nn.Module
    batch: torch.Tensor
    loss_fn: LossFn


def _classification_loss(targets: torch.Tensor) -> LossFn:
    def loss_fn(output: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.cross_entropy(output.float(), targets)

    return loss_fn


def _mlp(device: torch.device, div: int) -> Case:
    layers: list[nn.Module] = []
    for i in range(8):
        layers.append(nn.Linear(1024, 1024))
        if i < 7:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    n = max(1, 64 // div)
    batch = torch.randn(n, 1024)
    targets = torch.randint(0, 1024, (n,))
    return Case(
        "mlp",
        f"8 x Linear(1024), batch {n}",
        model.to(device),
        batch.to(device),
        _classification_loss(targets.to(device)),
    )


def _encoder(device: torch.device, div: int) -> Case:
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
    n = max(1, 8 // div)
    batch = torch.randn(n, 128, 256)
    target = torch.randn(n, 128, 256).to(device)

    def loss_fn(output: torch.Tensor, batch: Any) -> torch.Tensor:
        return F.mse_loss(output.float(), target)

    return Case(
        "transformer encoder",
        f"4 layers, d_model 256, 4 heads, seq 128, batch {n}",
        model.to(device),
        batch.to(device),
        loss_fn,
    )


def _convnet(device: torch.device, div: int) -> Case:
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    model = nn.Sequential(
        *block(3, 32),
        *block(32, 64),
        nn.MaxPool2d(2),
        *block(64, 128),
        *block(128, 128),
        nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    )
    n = max(2, 32 // div)  # BatchNorm in train mode needs more than one value per channel
    batch = torch.randn(n, 3, 32, 32)
    targets = torch.randint(0, 10, (n,))
    return Case(
        "convnet + BatchNorm",
        f"4 x (conv3x3 + BN + ReLU), 32x32, batch {n}",
        model.to(device),
        batch.to(device),
        _classification_loss(targets.to(device)),
    )


def _narrow(device: torch.device, div: int) -> Case:
    layers: list[nn.Module] = []
    for _ in range(200):
        linear = nn.Linear(64, 64)
        # He init keeps the activations O(1) through 200 ReLU layers (the default init would decay them into
        # fp16 subnormals and zeros, and subnormal arithmetic would distort the timing).
        nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")
        nn.init.zeros_(linear.bias)
        layers += [linear, nn.ReLU()]
    model = nn.Sequential(*layers)
    n = max(1, 64 // div)
    batch = torch.randn(n, 64)
    targets = torch.randint(0, 64, (n,))
    return Case(
        "200-layer narrow MLP",
        f"200 x (Linear(64) + ReLU), batch {n}",
        model.to(device),
        batch.to(device),
        _classification_loss(targets.to(device)),
    )


CASES: dict[str, Callable[[torch.device, int], Case]] = {
    "mlp": _mlp,
    "encoder": _encoder,
    "convnet": _convnet,
    "narrow": _narrow,
}


def build_case(key: str, device: torch.device, batch_div: int = 1) -> Case:
    torch.manual_seed(0)
    case = CASES[key](device, batch_div)
    case.model.train()
    return case


# -- the steps ---------------------------------------------------------------------------------------------


def plain_step(model: nn.Module, batch: torch.Tensor, loss_fn: LossFn) -> None:
    """An AMP training step without optimizer: what GradScaler does is multiply the loss by the scale."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(batch.device.type, dtype=DTYPE):
        output = model(batch)
        loss = loss_fn(output, batch)
    (loss * SCALE).backward()


def make_spec(case: Case) -> PassSpec:
    """The PassSpec exactly as ``ampdoctor.diagnose`` builds it."""
    root = case.model
    named = list(root.named_modules())
    return PassSpec(
        root=root,
        names={id(m): name for name, m in named},
        params=list(root.named_parameters()),
        batch=case.batch,
        loss_fn=case.loss_fn,
        device_type=case.batch.device.type,
        dtype=DTYPE,
        backward=True,
    )


class PassCounter:
    """Counts ``run_pass`` calls made by ``diagnose`` (wraps the name ``ampdoctor.api`` looks up)."""

    def __init__(self) -> None:
        self.count = 0
        self._original = ampdoctor_api.run_pass

    def __enter__(self) -> PassCounter:
        original = self._original

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(*args, **kwargs)

        ampdoctor_api.run_pass = counted  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        ampdoctor_api.run_pass = self._original  # type: ignore[assignment]


def attach_duo(model: nn.Module) -> Any:
    from transformers.debug_utils import DebugUnderflowOverflow

    return DebugUnderflowOverflow(model)


def detach_duo(model: nn.Module, duo: Any) -> int:
    """DebugUnderflowOverflow keeps no handles: drop the forward hooks that are its bound methods."""
    removed = 0
    for module in model.modules():
        for key, hook in list(module._forward_hooks.items()):
            if getattr(hook, "__self__", None) is duo:
                del module._forward_hooks[key]
                module._forward_hooks_with_kwargs.pop(key, None)
                module._forward_hooks_always_called.pop(key, None)
                removed += 1
    return removed


def leftover_hooks(model: nn.Module) -> int:
    """Hooks of any kind still on the model (ampdoctor must leave none behind)."""
    count = 0
    for module in model.modules():
        count += len(module._forward_hooks) + len(module._forward_pre_hooks) + len(module._backward_hooks)
        count += len(module._backward_pre_hooks)
    for param in model.parameters():
        count += len(param._backward_hooks or {})
    return count


def have_transformers() -> bool:
    try:
        import transformers.debug_utils  # noqa: F401
    except Exception:
        return False
    return True


class Steps:
    """One callable per mode for one case; the DebugUnderflowOverflow mode runs on a deep copy of the model."""

    def __init__(self, case: Case, modes: list[str]) -> None:
        self.case = case
        self.spec = make_spec(case)
        self.counter = PassCounter()
        self.diagnose_passes: list[int] = []
        self.verdicts: list[str] = []
        self.duo_model: Optional[nn.Module] = None
        self.duo: Any = None
        if "duo" in modes:
            self.duo_model = copy.deepcopy(case.model)
            self.duo = attach_duo(self.duo_model)

    def __call__(self, mode: str) -> None:
        case = self.case
        if mode == "plain":
            plain_step(case.model, case.batch, case.loss_fn)
        elif mode == "survey":
            run_pass(self.spec, SCALE, detailed=False)
        elif mode == "diagnose":
            with self.counter:
                before = self.counter.count
                report = ampdoctor.diagnose(case.model, case.batch, loss_fn=case.loss_fn, dtype=DTYPE)
                self.diagnose_passes.append(self.counter.count - before)
                self.verdicts.append(report.verdict)
        elif mode == "duo":
            assert self.duo_model is not None
            plain_step(self.duo_model, case.batch, case.loss_fn)
        elif mode == "reference":  # a survey pass with diagnose(reference=True): each leaf re-run in float32
            run_pass(self.spec, SCALE, detailed=False, reference=True)
        elif mode == "fp32":  # what the users who need AMP cannot afford: the whole step in float32
            case.model.zero_grad(set_to_none=True)
            case.loss_fn(case.model(case.batch), case.batch).backward()
        else:
            raise ValueError(mode)

    def close(self) -> None:
        if self.duo_model is not None:
            expected = sum(1 for _ in self.duo_model.modules())
            removed = detach_duo(self.duo_model, self.duo)
            if removed != expected:
                warnings.warn(f"DebugUnderflowOverflow: removed {removed} hooks, expected {expected}", stacklevel=1)
            self.duo_model = None


# -- timing ------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CLOCKS = {
    "process": "CPU time of this process (time.process_time): time the step spends waiting for a core on a busy "
    "machine is not counted; with more than one thread it sums the threads' CPU time",
    "wall": "wall-clock time (time.perf_counter)",
}


def time_case(
    case: Case, modes: list[str], args: argparse.Namespace
) -> tuple[dict[str, list[float]], dict[str, list[float]], Steps]:
    """Median-ready step times per mode on the chosen clock, and wall-clock times alongside."""
    device = case.batch.device
    steps = Steps(case, modes)
    clock = time.process_time if args.clock == "process" else time.perf_counter
    times: dict[str, list[float]] = {m: [] for m in modes}
    walls: dict[str, list[float]] = {m: [] for m in modes}
    for mode in modes:
        for _ in range(args.diagnose_warmup if mode == "diagnose" else args.warmup):
            steps(mode)
    rounds = max(args.repeats, args.diagnose_repeats)
    for r in range(rounds):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]  # rotate: no mode always runs first
        for mode in order:
            if mode == "diagnose" and len(times[mode]) >= args.diagnose_repeats:
                continue
            if mode != "diagnose" and len(times[mode]) >= args.repeats:
                continue
            _sync(device)
            start, wall = clock(), time.perf_counter()
            steps(mode)
            _sync(device)
            times[mode].append(clock() - start)
            walls[mode].append(time.perf_counter() - wall)
    return times, walls, steps


_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ")


def _profiled_syncs(fn: Callable[[], None]) -> int:
    """Blocking CUDA runtime calls made while ``fn`` runs, from the profiler's record of runtime API calls.

    This sees calls made on any thread, the autograd engine's device threads (gradient hooks) included.
    """
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if any((e.key + " ").startswith(c) for c in _SYNC_CALLS))


def _debug_mode_syncs(fn: Callable[[], None]) -> int:
    """Synchronizing calls as ``torch.cuda.set_sync_debug_mode('warn')`` reports them (Python's thread only)."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return sum(1 for w in caught if "synchroniz" in str(w.message))


def count_host_syncs(steps: Steps, modes: list[str]) -> dict[str, str]:
    """CUDA only: host synchronisations per step, as ``profiler count (sync-debug-mode count)``."""
    out: dict[str, str] = {}
    for mode in modes:

        def step(mode: str = mode) -> None:
            steps(mode)

        counts = []
        for counter in (_profiled_syncs, _debug_mode_syncs):
            try:
                baseline = counter(lambda: None) if counter is _profiled_syncs else 0
                counts.append(str(counter(step) - baseline))
            except Exception as exc:  # a counter that does not work on this build: say so, keep the other
                counts.append(f"n/a ({type(exc).__name__})")
        out[mode] = f"{counts[0]} ({counts[1]})"
    return out


# -- peak memory (fresh subprocess per measurement) --------------------------------------------------------

MEMORY_METHODS = {
    "cpu": (
        "process RSS high-water mark delta, in a fresh subprocess per (model, mode): after warm-up steps, "
        ".grad set to None, gc and malloc_trim, the kernel's peak RSS (VmHWM) is reset to the current RSS "
        "(/proc/self/clear_refs 5); the number is VmHWM after the measured steps minus that RSS. It counts "
        "everything the step touches: tensors, autograd graph, Python objects (hooks, records)"
    ),
    "cpu-fallback": (
        "process RSS high-water mark delta (getrusage ru_maxrss), in a fresh subprocess per (model, mode), "
        "from before the first step (warm-up not excluded: /proc/self/clear_refs unavailable)"
    ),
    "cuda": (
        "CUDA caching-allocator peak (torch.cuda.max_memory_allocated after reset_peak_memory_stats) minus "
        "the memory allocated before the step, in a fresh subprocess per (model, mode), after warm-up steps; "
        "tensor memory on the GPU only"
    ),
}


def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _malloc_trim() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None


def _maxrss_mib() -> float:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def memory_worker(args: argparse.Namespace) -> None:
    """Runs in a fresh process: prints JSON with the peak memory of one (model, mode)."""
    device = torch.device(args.device)
    resettable = device.type == "cpu" and _status_kib("VmRSS") is not None and _reset_hwm()
    before_anything = _maxrss_mib()
    case = build_case(args.case, device, args.batch_div)
    steps = Steps(case, [args.mode])
    mode = args.mode
    if device.type == "cpu" and not resettable:
        # ru_maxrss cannot be reset: the growth of the high-water mark over the first steps, model build included.
        for _ in range(args.mem_steps):
            steps(mode)
        result = {"method": "cpu-fallback", "peak_mib": _maxrss_mib() - before_anything}
        steps.close()
        print("AMPDOCTOR_MEMORY " + json.dumps(result))
        return
    steps(mode)  # warm-up: one-time allocations (thread pools, kernels, lazily built state) are not counted
    case.model.zero_grad(set_to_none=True)
    if steps.duo_model is not None:
        steps.duo_model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(args.mem_steps):
            steps(mode)
        torch.cuda.synchronize(device)
        result = {"method": "cuda", "peak_mib": (torch.cuda.max_memory_allocated(device) - base) / 2**20}
    else:
        _malloc_trim()
        base_kib = _status_kib("VmRSS") or 0
        _reset_hwm()
        for _ in range(args.mem_steps):
            steps(mode)
        peak_kib = _status_kib("VmHWM") or 0
        result = {"method": "cpu", "peak_mib": (peak_kib - base_kib) / 1024}
    steps.close()
    print("AMPDOCTOR_MEMORY " + json.dumps(result))


def measure_memory(key: str, mode: str, args: argparse.Namespace) -> tuple[Optional[float], str]:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--_memory-worker",
        "--case",
        key,
        "--mode",
        mode,
        "--device",
        args.device,
        "--threads",
        str(args.threads),
        "--mem-steps",
        str(args.mem_steps),
        "--batch-div",
        str(args.batch_div),
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("AMPDOCTOR_MEMORY "):
            data = json.loads(line.split(" ", 1)[1])
            return data["peak_mib"], data["method"]
    tail = (proc.stderr or proc.stdout)[-2000:]
    print(f"[memory worker failed for {key}/{mode}]\n{tail}", file=sys.stderr)
    return None, "failed"


# -- output ------------------------------------------------------------------------------------------------


def _ratio(times: dict[str, list[float]], mode: str) -> Optional[float]:
    if not times.get(mode) or not times.get("plain"):
        return None
    return statistics.median(times[mode]) / statistics.median(times["plain"])


def _fmt_ratio(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.2f}×"


def _fmt_mib(value: Optional[float], plain: Optional[float] = None) -> str:
    if value is None:
        return "n/a"
    text = f"{value:.1f}"
    if plain is not None and plain > 0.05:
        text += f" ({value / plain:.2f}×)"
    return text


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per mode (default 15; quick 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per mode first (default 3; quick 1)")
    parser.add_argument(
        "--diagnose-repeats", type=int, default=None, help="timed diagnose calls (default 3; 0: skip diagnose)"
    )
    parser.add_argument("--diagnose-warmup", type=int, default=1, help="untimed diagnose calls first (default 1)")
    parser.add_argument("--mem-steps", type=int, default=2, help="steps measured for peak memory (default 2)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak memory subprocesses")
    parser.add_argument(
        "--reference",
        action="store_true",
        help="also measure a survey pass with diagnose(reference=True) (each leaf call re-run in float32) and a "
        "whole float32 step, time and peak memory",
    )
    parser.add_argument("--models", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument(
        "--batch-div",
        type=int,
        default=1,
        help="divide every batch size by this (default 1: the stated sizes); for machines where fp16 "
        "matmuls are emulated and a full-size step takes seconds. Smaller batches make the fixed "
        "per-tensor cost of any instrumentation weigh more",
    )
    parser.add_argument(
        "--clock",
        choices=["process", "wall"],
        default=None,
        help="step timer (default: process CPU time on cpu, wall clock on cuda)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: few repeats, one memory step")
    parser.add_argument("--_memory-worker", dest="memory_worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 15
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    if args.diagnose_repeats is None:
        args.diagnose_repeats = 1 if args.quick else 3
    if args.clock is None:
        args.clock = "process" if args.device == "cpu" else "wall"
    if args.quick:
        args.mem_steps = 1
        args.diagnose_warmup = min(args.diagnose_warmup, 1)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available", file=sys.stderr)
        return 2
    if args.memory_worker:
        memory_worker(args)
        return 0
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    unknown = [k for k in keys if k not in CASES]
    if unknown:
        print(f"unknown model(s) {unknown}; choose from {list(CASES)}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    modes = ["plain", "survey"] + (["diagnose"] if args.diagnose_repeats > 0 else [])
    modes += ["duo"] if have_transformers() else []
    modes += ["reference", "fp32"] if args.reference else []
    started = time.perf_counter()

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    cpu_model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    tf_version = "not installed"
    if "duo" in modes:
        import transformers

        tf_version = transformers.__version__
    print(f"# ampdoctor overhead ({ampdoctor.__version__})\n")
    print(f"- torch {torch.__version__}, transformers {tf_version}, Python {platform.python_version()}")
    print(
        f"- device: {args.device} ({device_name}{', ' + cpu_model if cpu_model else ''}); "
        f"torch threads: {torch.get_num_threads()}"
    )
    print(
        f"- autocast dtype float16, loss scale {SCALE:g}; median of {args.repeats} timed steps per mode "
        f"after {args.warmup} warm-up steps (diagnose: median of {args.diagnose_repeats} calls after "
        f"{args.diagnose_warmup} warm-up), modes interleaved round by round"
    )
    print(f"- clock: {CLOCKS[args.clock]}")
    if args.batch_div != 1:
        print(f"- batch sizes divided by {args.batch_div} (--batch-div): not the stated sizes")
    print()

    rows = []
    details = []
    memory_method = None
    for key in keys:
        case = build_case(key, device, args.batch_div)
        times, walls, steps = time_case(case, modes, args)
        syncs = count_host_syncs(steps, [m for m in modes if m != "diagnose"]) if device.type == "cuda" else {}
        steps.close()
        hooks_left = leftover_hooks(case.model)
        mem: dict[str, Optional[float]] = {}
        if not args.no_memory:
            for mode in modes:
                mem[mode], method = measure_memory(key, mode, args)
                if method != "failed":
                    memory_method = method
        passes = sorted(set(steps.diagnose_passes))
        verdicts = sorted(set(steps.verdicts))
        rows.append((case, times, mem, syncs, passes, verdicts, hooks_left))
        plain_median = statistics.median(times["plain"])
        spread = "; ".join(
            f"{m} {1e3 * min(times[m]):.1f}..{1e3 * max(times[m]):.1f} ms "
            f"(n={len(times[m])}, +{1e3 * (statistics.median(times[m]) - plain_median):.1f} ms over plain, "
            f"wall median {1e3 * statistics.median(walls[m]):.1f} ms)"
            for m in modes
        )
        details.append(
            f"- {case.name} ({case.description}): {spread}"
            + (f"; diagnose verdict {', '.join(verdicts)}" if verdicts else "")
            + (f"; WARNING {hooks_left} hooks left on the model" if hooks_left else "")
        )
        print(f"[{case.name} done, {time.perf_counter() - started:.0f} s]", file=sys.stderr, flush=True)

    has_duo = "duo" in modes
    header = ["model", "plain ms", "ampdoctor survey ×", "diagnose × (passes)"]
    header += ["DebugUnderflowOverflow ×"] if has_duo else []
    if not args.no_memory:
        header += ["peak mem MiB plain", "survey", "diagnose"] + (["DebugUnderflowOverflow"] if has_duo else [])
    if device.type == "cuda":
        header += ["host syncs/step plain / survey" + (" / DUO" if has_duo else "")]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for case, times, mem, syncs, passes, _verdicts, _hooks in rows:
        cells = [
            case.name,
            f"{1e3 * statistics.median(times['plain']):.2f}",
            _fmt_ratio(_ratio(times, "survey")),
            f"{_fmt_ratio(_ratio(times, 'diagnose'))} ({'/'.join(str(p) for p in passes)})" if passes else "skipped",
        ]
        if has_duo:
            cells.append(_fmt_ratio(_ratio(times, "duo")))
        if not args.no_memory:
            plain_mem = mem.get("plain")
            cells += [
                _fmt_mib(plain_mem),
                _fmt_mib(mem.get("survey"), plain_mem),
                _fmt_mib(mem.get("diagnose"), plain_mem),
            ]
            if has_duo:
                cells.append(_fmt_mib(mem.get("duo"), plain_mem))
        if device.type == "cuda":
            cells.append(" / ".join(syncs.get(m, "n/a") for m in ["plain", "survey"] + (["duo"] if has_duo else [])))
        print("| " + " | ".join(cells) + " |")
    print()
    print(
        "Ratios are median step time / median plain step time. `ampdoctor survey ×` is one instrumented step "
        "(`run_pass(spec, scale, detailed=False)`): the per-step cost. `diagnose ×` is a whole "
        "`ampdoctor.diagnose` call, which runs several passes by design (count in parentheses: the survey, then "
        "reference backwards, scale probes or a detailed re-run as the findings require), plus parameter "
        "statistics, state snapshot/restore and analysis; it is not a per-step cost. DebugUnderflowOverflow "
        "checks the forward only; the ampdoctor survey also records every gradient of the backward."
    )
    if not has_duo:
        print("transformers is not installed: no DebugUnderflowOverflow column.")
    if not args.no_memory and memory_method:
        print(
            f"\nPeak memory: {MEMORY_METHODS.get(memory_method, memory_method)}. Measured over "
            f"{args.mem_steps} step(s); in parentheses: ratio to plain."
        )
    if device.type == "cuda":
        print(
            "\nHost syncs per step: blocking CUDA runtime calls (cudaStreamSynchronize, cudaDeviceSynchronize, "
            "cudaEventSynchronize, cudaMemcpy) counted with torch.profiler, minus an empty profiled region; in "
            "parentheses the count torch.cuda.set_sync_debug_mode('warn') reports (it sees only the Python "
            "thread, not syncs inside gradient hooks run by autograd's device threads). ampdoctor's design: one "
            "per survey pass."
        )
    if args.reference:
        print("\n### Per-call float32 reference (`diagnose(..., reference=True)`)\n")
        print(
            "| model | survey + reference × | float32 step × | peak mem MiB plain | survey + reference "
            "| float32 step |"
        )
        print("|---|---|---|---|---|---|")
        for case, times, mem, *_ in rows:
            plain_mem = mem.get("plain")
            print(
                f"| {case.name} | {_fmt_ratio(_ratio(times, 'reference'))} | {_fmt_ratio(_ratio(times, 'fp32'))} | "
                f"{_fmt_mib(plain_mem)} | {_fmt_mib(mem.get('reference'), plain_mem)} | "
                f"{_fmt_mib(mem.get('fp32'), plain_mem)} |"
            )
        print(
            "\nThe reference re-runs one call at a time in float32 under no_grad and drops both outputs after "
            "comparing: its peak should stay near one AMP step, below a whole float32 step."
        )
    print("\nSpread (min..max of the timed steps, median overhead over plain in ms, wall-clock median):")
    print("\n".join(details))
    print(f"\nTotal benchmark time {time.perf_counter() - started:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
