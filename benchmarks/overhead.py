"""What ampdoctor costs next to a plain AMP step, in one run: the goals of issue 13, printed as ratios.

For each model (``overhead_models.py``: a BERT-style classifier of 54M parameters, a VGG-style convnet with
BatchNorm, and a 200-layer narrow MLP) this measures, against **plain** (one AMP training step without optimizer:
``autocast`` forward, loss, backward of the loss times GradScaler's default scale 2**16, ``.grad`` set to None
first):

* **survey**: one ampdoctor survey pass as ``diagnose`` runs it (``run_pass(spec, scale,
  PassOptions(histograms=1))``): forward hooks on every module, gradient hooks on their outputs and on every parameter,
  statistics read back once; the per-step cost of capture, and the per-tensor cost on the narrow MLP;
* **DebugUnderflowOverflow** (transformers, when installed): the plain step with that tool attached (forward
  only; it keeps no handles, so it is attached to a deep copy and taken off afterwards);
* **diagnose** with default arguments, three times: on the model as it is (healthy), on a copy whose
  ``boom`` layer's weight is multiplied by 2**16 (a forward overflow: detailed re-run, op zoom, verification
  re-runs), and at loss scale 2**24 (a scale overflow: probes, window, detailed re-run, verification). The
  per-pass breakdown (``report.run.passes``) follows the table;
* **peak memory** of plain, survey and each diagnose, in a fresh subprocess per (model, mode).

Step times are process CPU time (``--clock``; waiting for a core on a shared machine does not count; wall clock
on CUDA); modes are interleaved round by round, the order rotated. Gates (issue 13): diagnose peak <= 1.25x a plain
step's on the encoder and the convnet; diagnose time <= 3 plain steps (healthy) and <= 8 (failing, verification
included) there; survey overhead <= DebugUnderflowOverflow's on the narrow MLP (stretch: half of it).

    python benchmarks/overhead.py                      # the three models, 1 thread, CPU (about 15 minutes here)
    python benchmarks/overhead.py --quick              # smoke run: smaller batches, fewer repeats
    python benchmarks/overhead.py --models narrow      # one model

Peak memory (CPU): RSS high-water mark growth in a fresh process per (model, mode), glibc made to return freed
memory (``MALLOC_MMAP_THRESHOLD_``, ``malloc_trim``): after a warm-up (a plain step, then the measured mode once:
one-time costs of the process such as kernel caches and lazy imports are not the diagnosis's) and ``.grad`` set to
None, the kernel's peak RSS (VmHWM) is reset to the current RSS (``/proc/self/clear_refs``); the number is VmHWM
after the measured step (or diagnose) minus that RSS: tensors, autograd graph and Python objects alike. CUDA: the
caching allocator's peak over the memory allocated before it.
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
from typing import Any, Callable, Optional

import torch
from overhead_models import CASES, SCALE_OVERFLOW_SCALE, Case, build_case, forward_overflow
from torch import nn

import ampdoctor
from ampdoctor.capture.options import PassOptions
from ampdoctor.capture.passes import PassSpec, run_pass

SCALE = 2.0**16  # torch.amp.GradScaler's default initial scale, the one diagnose uses without a scaler
DTYPE = torch.float16
DIAGNOSES = {"diagnose": "healthy", "diagnose-forward": "forward overflow", "diagnose-scale": "scale overflow"}
GATE_MEMORY, GATE_HEALTHY, GATE_FAILING = 1.25, 3.0, 8.0
GATED = ("encoder", "convnet")  # the gates of items 1-3; the narrow MLP gates the per-tensor cost (item 4)
REPEATS = {"encoder": 3, "convnet": 3, "narrow": 15}


def plain_step(model: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
    """An AMP training step without optimizer: what GradScaler does is multiply the loss by the scale."""
    model.zero_grad(set_to_none=True)
    device = batch.device.type
    with torch.autocast(device, dtype=DTYPE):
        loss = loss_fn(model(batch), batch)
    (loss * SCALE).backward()


def make_spec(case: Case) -> PassSpec:
    """The PassSpec exactly as ``ampdoctor.diagnose`` builds it."""
    return PassSpec(
        root=case.model,
        names={id(m): name for name, m in case.model.named_modules()},
        params=list(case.model.named_parameters()),
        batch=case.batch,
        loss_fn=case.loss_fn,
        device_type=case.batch.device.type,
        dtype=DTYPE,
        backward=True,
    )


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
    return count + sum(len(p._backward_hooks or {}) for p in model.parameters())


def have_transformers() -> bool:
    try:
        import transformers.debug_utils  # noqa: F401
    except Exception:
        return False
    return True


class Steps:
    """One callable per mode for one case."""

    def __init__(self, case: Case, modes: list[str]) -> None:
        self.case = case
        self.spec = make_spec(case)
        self.reports: dict[str, Any] = {}
        self.failing = forward_overflow(case) if "diagnose-forward" in modes else None
        self.duo_model: Optional[nn.Module] = None
        if "duo" in modes:
            from transformers.debug_utils import DebugUnderflowOverflow

            self.duo_model = copy.deepcopy(case.model)
            self.duo = DebugUnderflowOverflow(self.duo_model)

    def __call__(self, mode: str) -> None:
        case = self.case
        if mode == "plain":
            plain_step(case.model, case.batch, case.loss_fn)
        elif mode == "survey":
            run_pass(self.spec, SCALE, PassOptions(histograms=1))
        elif mode == "duo":
            assert self.duo_model is not None
            plain_step(self.duo_model, case.batch, case.loss_fn)
        elif mode in DIAGNOSES:
            model = self.failing if mode == "diagnose-forward" else case.model
            kwargs = {"scale": SCALE_OVERFLOW_SCALE} if mode == "diagnose-scale" else {}
            assert model is not None
            self.reports[mode] = ampdoctor.diagnose(model, case.batch, loss_fn=case.loss_fn, dtype=DTYPE, **kwargs)
        else:
            raise ValueError(mode)

    def close(self) -> None:
        if self.duo_model is not None:
            expected = sum(1 for _ in self.duo_model.modules())
            if detach_duo(self.duo_model, self.duo) != expected:
                warnings.warn("DebugUnderflowOverflow: not every hook was removed", stacklevel=1)
            self.duo_model = None


# -- timing --------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_case(case: Case, modes: list[str], args: argparse.Namespace, key: str) -> tuple[dict[str, list[float]], Steps]:
    """Times per mode on the chosen clock: the step modes interleaved round by round, then each diagnose."""
    device = case.batch.device
    steps = Steps(case, modes)
    clock = time.process_time if args.clock == "process" else time.perf_counter
    times: dict[str, list[float]] = {m: [] for m in modes}
    stepped = [m for m in modes if m not in DIAGNOSES]
    for mode in stepped:
        for _ in range(args.warmup):
            steps(mode)
    repeats = args.repeats or (1 if args.quick else REPEATS[key])
    for r in range(repeats):
        for mode in stepped[r % len(stepped) :] + stepped[: r % len(stepped)]:  # rotate: no mode always first
            _sync(device)
            start = clock()
            steps(mode)
            _sync(device)
            times[mode].append(clock() - start)
    diagnoses = [m for m in modes if m in DIAGNOSES]
    for _ in range(args.diagnose_repeats):
        for mode in diagnoses:
            _sync(device)
            start = clock()
            steps(mode)
            _sync(device)
            times[mode].append(clock() - start)
    return times, steps


# -- peak memory (fresh subprocess per measurement) ------------------------------------------------------------


def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None


def memory_worker(args: argparse.Namespace) -> None:
    """Runs in a fresh process: prints JSON with the peak memory increment of one (model, mode)."""
    device = torch.device(args.device)
    case = build_case(args.case, device, args.batch_div)
    steps = Steps(case, [args.mode])
    # Warm-up: a plain step, then the measured mode once (thread pools, kernels, allocator caches, lazy imports:
    # one-time costs of the process, not of the step or the diagnosis).
    plain_step(case.model, case.batch, case.loss_fn)
    steps(args.mode)
    case.model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        steps(args.mode)
        torch.cuda.synchronize(device)
        result = {"method": "cuda", "peak_mib": (torch.cuda.max_memory_allocated(device) - base) / 2**20}
    else:
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        base_kib = _status_kib("VmRSS") or 0
        if not _reset_hwm():
            print("AMPDOCTOR_MEMORY " + json.dumps({"method": "unavailable", "peak_mib": None}))
            return
        steps(args.mode)
        result = {"method": "cpu", "peak_mib": ((_status_kib("VmHWM") or 0) - base_kib) / 1024}
    steps.close()
    print("AMPDOCTOR_MEMORY " + json.dumps(result))


def measure_memory(key: str, mode: str, args: argparse.Namespace) -> Optional[float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--_memory-worker", "--case", key, "--mode", mode,
           "--device", args.device, "--threads", str(args.threads), "--batch-div", str(args.batch_div)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("AMPDOCTOR_MEMORY "):
            return json.loads(line.split(" ", 1)[1])["peak_mib"]  # type: ignore[no-any-return]
    print(f"[memory worker failed for {key}/{mode}]\n{(proc.stderr or proc.stdout)[-2000:]}", file=sys.stderr)
    return None


# -- output -------------------------------------------------------------------------------------------------


def _median(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def _ratio(times: dict[str, list[float]], mode: str) -> Optional[float]:
    value, plain = _median(times.get(mode, [])), _median(times.get("plain", []))
    return value / plain if value is not None and plain else None


def _x(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.2f}×"


def _verdict(ok: Optional[bool]) -> str:
    return "n/a" if ok is None else ("holds" if ok else "MISSED")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--models", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=0, help="timed steps per step mode (default: per model)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per step mode first (default 1)")
    parser.add_argument("--diagnose-repeats", type=int, default=1, help="timed calls of each diagnose (default 1)")
    parser.add_argument("--batch-div", type=int, default=1, help="divide every batch size by this (default 1)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak memory subprocesses")
    parser.add_argument("--clock", choices=["process", "wall"], default=None, help="default: process on cpu")
    parser.add_argument("--quick", action="store_true", help="smoke run: batches / 8, one repeat")
    parser.add_argument("--_memory-worker", dest="memory_worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.clock = args.clock or ("process" if args.device == "cpu" else "wall")
    if args.quick and args.batch_div == 1:
        args.batch_div = 8
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
    if any(k not in CASES for k in keys):
        print(f"unknown model in {keys}; choose from {list(CASES)}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    device = torch.device(args.device)
    modes = ["plain", "survey"] + (["duo"] if have_transformers() else []) + list(DIAGNOSES)
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    print(f"# ampdoctor overhead ({ampdoctor.__version__})\n")
    print(f"- command: python benchmarks/overhead.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    print(f"- torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()} "
          f"{cpu or platform.processor()}, {os.cpu_count()} cores; torch threads {torch.get_num_threads()}")
    print(f"- autocast float16, loss scale {SCALE:g}; clock: {args.clock}; step modes interleaved; diagnose "
          f"x{args.diagnose_repeats} each" + (f"; batches divided by {args.batch_div}" if args.batch_div > 1 else ""))
    print()
    rows = []
    for key in keys:
        case = build_case(key, device, args.batch_div)
        times, steps = time_case(case, modes, args, key)
        steps.close()
        hooks = leftover_hooks(case.model)
        mem = {m: measure_memory(key, m, args) for m in modes if m != "duo"} if not args.no_memory else {}
        rows.append((key, case, times, steps.reports, mem, hooks))
        print(f"[{case.name} done, {time.perf_counter() - started:.0f} s]", file=sys.stderr, flush=True)
    print_tables(rows)
    print_gates(rows)
    print_passes(rows)
    print(f"\nTotal benchmark time {time.perf_counter() - started:.0f} s.")
    return 0


def print_tables(rows: list[Any]) -> None:
    print("| model (batch) | plain s | survey × | DebugUnderflowOverflow × | diagnose × healthy / forward overflow "
          "/ scale overflow (passes) | peak MiB plain | survey | diagnose healthy / forward / scale |")
    print("|---|---|---|---|---|---|---|---|")
    for _key, case, times, reports, mem, hooks in rows:
        diag = " / ".join(
            f"{_x(_ratio(times, m))} ({len(reports[m].run.passes) if m in reports else '-'})" for m in DIAGNOSES
        )
        mems = " / ".join(_mib(mem, m) for m in DIAGNOSES)
        print(f"| {case.name}: {case.description} | {_median(times['plain']):.3f} | {_x(_ratio(times, 'survey'))} | "
              f"{_x(_ratio(times, 'duo'))} | {diag} | {_mib(mem, 'plain')} | {_mib(mem, 'survey')} | {mems} |"
              + (f" WARNING: {hooks} hooks left" if hooks else ""))
    print("\nTime ratios: median process CPU time / median plain step. Memory ratios: peak increment / plain's.")


def _mib(mem: dict[str, Optional[float]], mode: str) -> str:
    value, plain = mem.get(mode), mem.get("plain")
    if value is None:
        return "n/a"
    return f"{value:.0f}" if mode == "plain" or not plain else _x(value / plain)


def print_gates(rows: list[Any]) -> None:
    print("\n## Goals (issue 13)\n")
    for key, case, times, _reports, mem, _ in rows:
        if key in GATED:
            plain = mem.get("plain")
            for mode, what in DIAGNOSES.items():
                value = mem.get(mode)
                ratio = value / plain if value is not None and plain else None
                ok = None if ratio is None else ratio <= GATE_MEMORY
                print(f"- memory, {case.name}, diagnose ({what}): {_x(ratio)} of a plain step's peak increment "
                      f"(gate <= {GATE_MEMORY}×): {_verdict(ok)}")
            for mode, what in DIAGNOSES.items():
                ratio = _ratio(times, mode)
                gate = GATE_HEALTHY if mode == "diagnose" else GATE_FAILING
                ok = None if ratio is None else ratio <= gate
                print(f"- time, {case.name}, diagnose ({what}): {_x(ratio)} plain steps (gate <= {gate:g}): "
                      f"{_verdict(ok)}")
        else:
            survey, duo = _ratio(times, "survey"), _ratio(times, "duo")
            if survey is None or duo is None:
                print(f"- per-tensor cost, {case.name}: needs transformers for DebugUnderflowOverflow")
                continue
            print(f"- per-tensor cost, {case.name}: survey overhead {survey - 1:.2f} of a plain step, "
                  f"DebugUnderflowOverflow's {duo - 1:.2f}: gate (<=) {_verdict(survey <= duo)}, stretch (<= half, "
                  f"{(duo - 1) / 2:.2f}) {_verdict(survey - 1 <= (duo - 1) / 2)}")


def print_passes(rows: list[Any]) -> None:
    print("\n## Passes of each diagnose (report.run.passes; wall-clock seconds, × the median plain step's)\n")
    for _key, case, times, reports, _mem, _ in rows:
        plain = _median(times["plain"]) or 1.0
        for mode, what in DIAGNOSES.items():
            report = reports.get(mode)
            if report is None:
                continue
            passes = ", ".join(
                f"{p.purpose} @{p.scale:g} {p.dtype} {p.seconds / plain:.2f}×"
                + (f" [{p.status}: {p.reason}]" if p.status != "ran" else "")
                for p in report.run.passes
            )
            print(f"- {case.name}, {what} ({report.verdict}): {passes}")


if __name__ == "__main__":
    sys.exit(main())
