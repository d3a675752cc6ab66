"""Where a failing diagnosis's peak memory goes (issue 18's cost goal: <= 1.25x a plain step's peak), phase by phase.

Same setting as ``cost_per_module.py --parts failing`` (its ``failing_model`` variants, one thread, glibc told to
hand large blocks back): a warm-up of a plain step and of a diagnose, then the measured diagnose, with the RSS
high-water mark (``VmHWM``) read and reset at every phase boundary. A phase is a pass (``Session.run``, named by
its purpose and options), the parameter statistics, the state guard's snapshot and restore, or "between" (the
orchestration, analysis and recommendations around them). Each row: the RSS a pass starts from (after
the host heap's free pages went back), the phase's peak, and the RSS it leaves behind, all over the RSS before the
diagnose.

    python benchmarks/failing_memory.py                     # both variants, a fresh process each
    python benchmarks/failing_memory.py --variant "hidden overflow"
    python benchmarks/failing_memory.py --profile       # also: tensors alive at each pass's peak, by site

``--profile`` runs the measured diagnose under ``torch.profiler`` (memory and Python stacks; slow) and prints, for
each phase, the allocator's peak over the phase's start and the tensors alive at that moment, grouped by the op and
the innermost ampdoctor / user frames that made them; at the end, the largest phase's allocator peak against a plain
step's (tensors alone, whatever the heap's layout: the RSS rows also hold Python objects and heap fragmentation, which
move by +-1-2 MiB between processes of the same code).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import gc
import math
import os
import subprocess
import sys
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cost_per_module import FAILING, failing_model, plain_step  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072",
       "MALLOC_TRIM_THRESHOLD_": "131072"}


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


_MARK_BYTES = 77_777  # a marker allocation's size (plus the phase's index): phase boundaries in the profile


class Phases:
    """A partition of the measured run into phases: each boundary reads the high-water mark of the phase that
    ends and resets it for the next."""

    def __init__(self) -> None:
        self.base = 0
        self.label = "between"
        self.rows: list[tuple[str, float, float]] = []
        self.on = False
        self.profiling = False
        self.starts: list[float] = []

    def start(self) -> None:
        self.base = _kib("VmRSS")
        self.rows.clear()
        self.starts.clear()
        self.label, self.on = "between", True
        _reset_hwm()

    def mark(self, label: str) -> None:
        if not self.on:
            return
        peak, now = _kib("VmHWM"), _kib("VmRSS")
        self.rows.append((self.label, (peak - self.base) / 1024, (now - self.base) / 1024))
        self.label = label
        if self.profiling:
            torch.empty(_MARK_BYTES + len(self.rows), dtype=torch.uint8)
        _reset_hwm()

    def stop(self) -> None:
        self.mark("")
        self.on = False


PHASES = Phases()


def _wrap(owner: Any, attr: str, name: Callable[..., str]) -> None:
    real = getattr(owner, attr)

    @functools.wraps(real)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        outer = PHASES.label
        PHASES.mark(name(*args, **kwargs))
        try:
            return real(*args, **kwargs)
        finally:
            PHASES.mark(outer if outer.startswith("between") else "between")

    setattr(owner, attr, wrapper)


def _pass_name(session: Any, at_scale: float, options: Any = None, dtype: Optional[torch.dtype] = None,
               **kwargs: Any) -> str:
    what = []
    if options is not None:
        if options.detailed:
            what.append("detailed")
        if not options.autocast:
            what.append("float32")
        if options.histograms:
            what.append(f"hist{options.histograms}")
    if dtype is not None:
        what.append(str(dtype).replace("torch.", ""))
    if kwargs.get("variant") is not None:
        what.append("variant")
    return f"pass: {session.purpose} @{at_scale:g}" + (f" ({', '.join(what)})" if what else "")


def instrument() -> None:
    import ampdoctor.api as api
    from ampdoctor.capture import session, state

    _wrap(session.Session, "run", _pass_name)
    real_trim = getattr(session, "trim_host_heap", None)  # absent before the trim between passes

    def trim() -> bool:  # the resident size each pass starts from, after the heap's free pages went back
        done = real_trim() if real_trim is not None else False
        PHASES.starts.append((_kib("VmRSS") - PHASES.base) / 1024)
        return done

    if real_trim is not None:
        session.trim_host_heap = trim
    _wrap(api, "capture_params", lambda *a, **k: "parameter statistics")
    _wrap(state.StateGuard, "__init__", lambda *a, **k: "state guard: snapshot")
    _wrap(state.StateGuard, "restore", lambda *a, **k: "state guard: restore")
    _wrap(api, "recommend", lambda *a, **k: "recommend")
    _wrap(api, "analyze", lambda *a, **k: "analyze")


_DIRS = ("ampdoctor/", "benchmarks/")


def _site(node: Any) -> str:
    """The innermost op that made an allocation, and the innermost ampdoctor / user frames above it."""
    op, frames = "", []
    parent = node.parent
    while parent is not None and len(frames) < 3:
        name = str(parent.name)
        tag = str(parent.tag)
        if not op and tag.endswith("TorchOp"):
            op = name
        elif tag.endswith("PyCall") and "failing_memory" not in name and any(d in name for d in _DIRS):
            frames.append(name.split("ampdoctor/")[-1].split("benchmarks/")[-1])
        parent = parent.parent
    return f"{op or '-'} <- " + " <- ".join(frames)


def _allocations(prof: Any) -> list[Any]:
    events: list[Any] = []
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        todo.extend(node.children)
        if str(node.tag).endswith("Allocation"):
            events.append(node)
    events.sort(key=lambda n: n.start_time_ns)
    return events


def allocator_peak(prof: Any) -> float:
    """The allocator's peak over its level before the first allocation (MiB): tensors only, no heap layout."""
    events = _allocations(prof)
    if not events:
        return 0.0
    first = events[0].extra_fields
    start = int(first.total_allocated) - int(first.alloc_size)
    return (max(int(e.extra_fields.total_allocated) for e in events) - start) / 2**20


def analyse_profile(prof: Any, labels: list[str], top: int) -> list[float]:
    """Per phase: the allocator's peak over the phase's start, and what is alive at that peak, by site; returns
    the peaks (MiB)."""
    events = _allocations(prof)
    peaks: list[float] = []
    live: dict[int, tuple[int, str, int]] = {}  # ptr -> (bytes, site, phase index)
    phase, start_total, peak, peak_live = 0, None, 0, {}

    def finish() -> None:
        if start_total is None or phase >= len(labels):
            return
        peaks.append((peak - start_total) / 2**20)
        print(f"\n### {labels[phase]}: allocator peak +{peaks[-1]:.2f} MiB over its start "
              f"(alive at the peak: {sum(b for b, _, _ in peak_live.values()) / 2**20:.2f} MiB)")
        by_site: dict[str, list[int]] = {}
        for size, site, born in peak_live.values():
            key = ("earlier: " if born < phase else "") + site
            by_site.setdefault(key, [0, 0])
            by_site[key][0] += size
            by_site[key][1] += 1
        for key, (size, n) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"  {size / 2**20:7.3f} MiB  x{n:<4d} {key}")

    for node in events:
        f = node.extra_fields
        size, total = int(f.alloc_size), int(f.total_allocated)
        if size > 0 and _MARK_BYTES < size <= _MARK_BYTES + 10_000 and (size - _MARK_BYTES) == phase + 1:
            finish()
            phase, start_total, peak, peak_live = size - _MARK_BYTES, total - size, total - size, dict(live)
            continue
        if size > 0:
            live[int(f.ptr)] = (size, _site(node), phase)
        else:
            live.pop(int(f.ptr), None)
        if start_total is None:
            start_total = total
        if total > peak:
            peak, peak_live = total, dict(live)
    finish()
    return peaks


def experiment(names: str) -> None:
    """Changes tried before they are made (``FAILING_MEMORY_TRY=trim,cycle,chunk,nograd``): what each would save.

    * ``trim``: freed heap pages handed back (``malloc_trim``) before every pass;
    * ``cycle``: a staging buffer refers to its collector weakly (no collector outlives its pass);
    * ``chunk``: the detailed statistics' chunk 2**16 elements instead of 2**20;
    * ``nograd``: a pass without backward runs its forward without autograd (no graph kept).
    """
    chosen = {n for n in names.split(",") if n}
    if "trim" in chosen:
        from ampdoctor.capture import session

        real_run = session.Session.run

        def trimmed(*a: Any, **k: Any) -> Any:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            return real_run(*a, **k)

        session.Session.run = trimmed  # type: ignore[method-assign]
    if "cycle" in chosen:
        import weakref

        from ampdoctor.capture import staging

        real_init = staging.Stage.__init__

        def weak_init(self: Any, dtype: Any, device: Any, histogram: Any) -> None:
            method = weakref.WeakMethod(histogram)
            real_init(self, dtype, device, lambda d: method()(d))  # type: ignore[misc]

        staging.Stage.__init__ = weak_init  # type: ignore[method-assign]
    if "chunk" in chosen:
        from ampdoctor.capture import stats

        stats.CHUNK = 1 << 16
    if "nograd" in chosen:
        from ampdoctor.capture import passes

        real_install = passes._Step._install

        def install(self: Any) -> None:
            real_install(self)
            if not self.spec.backward:
                self.contexts.enter_context(torch.no_grad())

        passes._Step._install = install  # type: ignore[method-assign]


def worker(variant: str, profile: bool = False, top: int = 12) -> None:
    import ampdoctor

    torch.set_num_threads(1)
    experiment(os.environ.get("FAILING_MEMORY_TRY", ""))
    instrument()
    model, x, loss_fn = failing_model(variant)

    def diagnose() -> Any:
        return ampdoctor.diagnose(model, x, loss_fn=loss_fn, dtype=torch.float16, device_type="cpu")

    def settle() -> int:
        model.zero_grad(set_to_none=True)
        gc.collect()
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        return _kib("VmRSS")

    plain_step(model, x, loss_fn)
    settle()
    base = _kib("VmRSS")
    _reset_hwm()
    plain_step(model, x, loss_fn)
    plain = (_kib("VmHWM") - base) / 1024
    diagnose()
    settle()
    plain_tensors = math.nan
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as plain_prof:
            plain_step(model, x, loss_fn)
        plain_tensors = allocator_peak(plain_prof)
        settle()
    PHASES.start()
    if profile:
        PHASES.profiling = True
        with torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
            report = diagnose()
            PHASES.stop()
    else:
        report = diagnose()
        PHASES.stop()
    print(f"## {variant}: {report.verdict}; plain step peak +{plain:.2f} MiB (budget 1.25x: {1.25 * plain:.2f})")
    print(f"{'phase':52s} {'start MiB':>9s} {'peak MiB':>9s} {'after':>7s}")
    starts = iter(PHASES.starts)
    for label, peak, after in PHASES.rows:
        flag = "  <-- over" if peak > 1.25 * plain else ""
        start = f"{next(starts, math.nan):9.2f}" if label.startswith("pass:") else " " * 9
        print(f"{label:52s} {start} {peak:9.2f} {after:7.2f}{flag}")
    print(f"{'whole diagnose':72s} {max(p for _, p, _ in PHASES.rows):9.2f}  = "
          f"{max(p for _, p, _ in PHASES.rows) / plain:.2f}x the plain step")
    if profile:
        peaks = analyse_profile(prof, [label for label, _, _ in PHASES.rows], top)
        print(f"\ntensors alone (the allocator's peak, no heap layout): plain step +{plain_tensors:.2f} MiB, the "
              f"diagnose's largest phase +{max(peaks, default=math.nan):.2f} MiB = "
              f"{max(peaks, default=math.nan) / plain_tensors:.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--variant", choices=FAILING, help="one variant (default: both)")
    parser.add_argument("--profile", action="store_true", help="tensors alive at each phase's peak (slow)")
    parser.add_argument("--top", type=int, default=12, help="sites listed per phase with --profile")
    parser.add_argument("--_worker", dest="worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.variant, args.profile, args.top)
        return 0
    env = dict(os.environ, **ENV)
    for variant in [args.variant] if args.variant else FAILING:
        extra = ["--profile", "--top", str(args.top)] if args.profile else []
        subprocess.run([sys.executable, os.path.abspath(__file__), "--_worker", "--variant", variant, *extra],
                       env=env, check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
