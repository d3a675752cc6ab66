"""Where ``diagnose``'s memory goes on the 10,000-module model (issue 22): RSS over the start at the phases of one
diagnosis (and its high-water mark so far), in fresh processes, as ``cost_per_module.py --parts tenk`` measures its
peak (one warm-up plain step and diagnose first, then the high-water mark reset).

Phases: the survey's readback starts / ends (``StatsCollector.read`` of the survey), its trace is built, the
survey returns, the survey-only settlement (``settle_from_survey``: the loss-scale predictions), analysis, the
report returned, and the report dropped. ``--trace`` adds tracemalloc's largest live allocation sites at the
readback and at analysis (slow; RSS is then meaningless).

    python benchmarks/tenk_memory_phases.py --runs 5          # medians of 5 fresh processes
    python benchmarks/tenk_memory_phases.py --runs 1 --trace
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def worker(trace: bool) -> None:
    import tracemalloc

    import torch
    from cost_per_module import DTYPE, plain_step, tenk_model

    import ampdoctor
    import ampdoctor.api as api
    import ampdoctor.capture.passes as passes
    import ampdoctor.capture.stats as stats

    torch.set_num_threads(1)
    model, x, loss_fn = tenk_model()
    phases: list[tuple[str, float, float]] = []
    state = {"on": False}

    def mark(name: str) -> None:
        if state["on"]:
            phases.append((name, _rss_mib("VmRSS"), _rss_mib("VmHWM")))

    def sites(title: str) -> None:
        if not (trace and state["on"]):
            return
        gc.collect()
        top = tracemalloc.take_snapshot().statistics("lineno")
        print(f"{title}: {sum(s.size for s in top) / 2**20:.1f} MiB traced", file=sys.stderr)
        for s in top[:20]:
            print(f"  {s.size / 2**20:6.2f} MiB {s.count:7d} {s.traceback}", file=sys.stderr)

    def wrap(owner: Any, name: str, before: Callable[[], None], after: Callable[[], None]) -> None:
        original = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            before()
            result = original(*args, **kwargs)
            after()
            return result

        setattr(owner, name, wrapped)

    survey = {"running": False, "read": False}  # the survey's own readback (the parameters' comes first)

    def read_start() -> None:
        survey["read"] = survey["running"] and not any(n == "readback starts" for n, _, _ in phases)
        if survey["read"]:
            mark("readback starts")
            sites("live at the survey's readback")

    def survey_starts() -> None:
        survey["running"] = True

    def survey_ends() -> None:
        survey["running"] = False
        mark("survey returned")

    wrap(stats.StatsCollector, "read", read_start, lambda: mark("readback ends") if survey["read"] else None)
    wrap(passes, "build_trace", lambda: None, lambda: mark("trace built"))
    wrap(api, "_survey", survey_starts, survey_ends)
    wrap(api, "settle_from_survey", lambda: None, lambda: mark("survey settled"))
    wrap(api, "analyze", lambda: sites("live at analysis"), lambda: mark("analysed"))

    plain_step(model, x, loss_fn)
    ampdoctor.diagnose(model, x, loss_fn=loss_fn, dtype=DTYPE)
    model.zero_grad(set_to_none=True)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = _rss_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    if trace:
        tracemalloc.start(1)
    state["on"] = True
    report = ampdoctor.diagnose(model, x, loss_fn=loss_fn, dtype=DTYPE)
    mark("report returned")
    del report
    gc.collect()
    mark("report dropped")
    print(json.dumps({"peak": _rss_mib("VmHWM") - base, "phases": [(n, r - base, h - base) for n, r, h in phases]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._worker:
        worker(args.trace)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072",
               MALLOC_TRIM_THRESHOLD_="131072")
    runs = []
    for _ in range(args.runs):
        command = [sys.executable, os.path.abspath(__file__), "--_worker"] + (["--trace"] if args.trace else [])
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
        if args.trace:
            print(done.stderr, file=sys.stderr)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"peak RSS increment over {len(runs)} fresh runs: median {statistics.median(r['peak'] for r in runs):.1f} "
          f"MiB (range {min(r['peak'] for r in runs):.1f}-{max(r['peak'] for r in runs):.1f})")
    names = [n for n, _, _ in runs[0]["phases"]]
    for i, name in enumerate(names):
        rss = statistics.median(r["phases"][i][1] for r in runs)
        hwm = statistics.median(r["phases"][i][2] for r in runs)
        print(f"  {name:16s} RSS +{rss:5.1f} MiB   high-water +{hwm:5.1f} MiB")


if __name__ == "__main__":
    main()
