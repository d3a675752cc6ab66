"""Cost per module (issue 22), in one run, as ratios to a plain float16 AMP step measured in the same run.

* **10,000-module model** (5,000 ``Linear(4, 4)`` + ``ReLU``, batch 16): ``diagnose`` time in plain steps, its
  peak memory increment against a plain step's (fresh subprocess per mode, as ``overhead.py`` measures it), and
  the size of the HTML report (and of the text and JSON reports, for comparison); and, for reference, the same plain
  step under the survey's wrappers and hooks doing nothing (``hooks_floor_step``: the floor of the survey's design),
  and with forward hooks instead of the wrappers;
* **watch** on the 50- and 200-layer narrow MLPs (``Linear(64, 64)`` + ``ReLU``, batch 64, AdamW): statistics every
  step and defaults, against the same loop without it (``watch_overhead.measure``: interleaved blocks, process CPU
  time; the gate reads the median of the per-round ratios, the best-block ratio is printed beside it), with how
  many measured steps the default watch sampled (a drift the forecast sees makes it sample densely), and, for
  reference, ``watch_overhead.BareHooks`` interleaved with them: one Python hook per module doing one ``aminmax``
  per output and per output gradient, nothing recorded (the floor of any watch built on per-module hooks);
* **healthy encoder**: ``diagnose`` of ``overhead.py``'s BERT-style classifier in plain steps (the default passes,
  hidden-overflow detection included when the survey has it);
* **first call**: the first ``diagnose`` in a fresh process against the second, on a small model (wall clock:
  imports are what differs);
* **failing diagnoses** (issue 18's cost goals: <= 8 plain steps, <= 1.25x a plain step's peak memory, hidden-overflow
  detection included): ``hidden_overhead.py``'s 2-block transformer (attention in Python, batch 16 x 64 tokens)
  with a forward overflow (``blocks.0.ff1`` and ``ff2`` weights scaled up: ``blocks.0.ff2`` overflows) and its
  hidden-overflow variant (no norms, raw inputs, scores clamped before the scaling), each against a plain step of
  the same model; memory in fresh subprocesses as above.

Times are process CPU time (other processes on a shared machine do not count) unless said otherwise; every ratio
is a median over ``--repeats`` rounds with plain and measured modes interleaved. Memory ratios too: ``--repeats``
pairs of fresh subprocesses (a plain step, a diagnose), the median of the per-pair ratios and their range (a step
of a few MiB reads +-1 MiB between runs).

    python benchmarks/cost_per_module.py            # everything (several minutes on a 2-core CPU)
    python benchmarks/cost_per_module.py --quick    # smoke run: fewer repeats, smaller encoder batch
    python benchmarks/cost_per_module.py --parts tenk,first
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

DTYPE = torch.float16
SCALE = 2.0**16
GATES = {"tenk_time": 3.0, "tenk_memory": 1.25, "tenk_html_bytes": 1 << 20, "watch_every": 1.10, "watch": 1.03,
         "encoder": 1.5, "first_extra_s": 0.5, "failing": 8.0, "failing_memory": 1.25}
PARTS = ("tenk", "watch", "encoder", "first", "failing")
FAILING = ("forward overflow", "hidden overflow")


def tenk_model(pairs: int = 5000, batch: int = 16) -> tuple[nn.Module, torch.Tensor, Callable[[Any, Any], Any]]:
    """``pairs`` x (Linear(4, 4) + ReLU): near-identity weights and positive inputs keep 5,000 layers finite and
    alive (the ReLUs pass almost everything), so the diagnosis is the healthy one."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(pairs):
        linear = nn.Linear(4, 4)
        with torch.no_grad():
            linear.weight.copy_(torch.eye(4) + 0.01 * torch.randn(4, 4))
            linear.bias.zero_()
        layers += [linear, nn.ReLU()]
    model = nn.Sequential(*layers).train()
    x = torch.rand(batch, 4) + 0.5
    targets = torch.randint(0, 4, (batch,))

    def loss_fn(out: torch.Tensor, _batch: Any) -> torch.Tensor:
        return F.cross_entropy(out.float(), targets)

    return model, x, loss_fn


def small_model() -> tuple[nn.Module, torch.Tensor, Callable[[Any, Any], Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    targets = torch.randint(0, 4, (8,))
    return model, x, lambda out, _b: F.cross_entropy(out.float(), targets)


def plain_step(model: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], Any]) -> None:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=DTYPE):
        loss = loss_fn(model(batch), batch)
    (loss * SCALE).backward()


def _clocked(fn: Callable[[], Any], clock: Callable[[], float] = time.process_time) -> tuple[float, Any]:
    start = clock()
    result = fn()
    return clock() - start, result


def _median_ratio(pairs: list[tuple[float, float]]) -> float:
    """Median over rounds of (measured / plain of the same round)."""
    return statistics.median(m / p for p, m in pairs)


# -- 10,000 modules ---------------------------------------------------------------------------------------------


def _status_kib(field: str) -> Optional[int]:
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def _print_peak_increment(model: nn.Module, warm: Callable[[], Any], run: Callable[[], Any]) -> None:
    """Print the peak RSS increment (MiB) of ``run`` after one warm-up of ``warm`` and of ``run`` (or null where
    /proc/self/clear_refs cannot reset the high-water mark)."""
    warm()
    run()
    model.zero_grad(set_to_none=True)
    gc.collect()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = _status_kib("VmRSS") or 0
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        print("AMPDOCTOR_MEMORY null")
        return
    run()
    print("AMPDOCTOR_MEMORY " + json.dumps(((_status_kib("VmHWM") or 0) - base) / 1024))


def memory_worker(mode: str) -> None:
    """Fresh process: the peak RSS increment of one plain step or one diagnose (after one warm-up of each)."""
    import ampdoctor

    torch.set_num_threads(1)
    model, x, loss_fn = tenk_model()
    run = (lambda: plain_step(model, x, loss_fn)) if mode == "plain" else (
        lambda: ampdoctor.diagnose(model, x, loss_fn=loss_fn, dtype=DTYPE))
    _print_peak_increment(model, lambda: plain_step(model, x, loss_fn), run)


def _subprocess_json(args: list[str], tag: str) -> Any:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072",
               MALLOC_TRIM_THRESHOLD_="131072")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True,
                          env=env, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith(tag + " "):
            return json.loads(line.split(" ", 1)[1])
    print(f"[{args} failed]\n{(proc.stderr or proc.stdout)[-2000:]}", file=sys.stderr)
    return None


def _memory_rounds(plain_args: list[str], diagnose_args: list[str], rounds: int) -> dict[str, Any]:
    """Peak RSS increments of a plain step and of a diagnose, each in its own fresh subprocess, ``rounds`` pairs:
    the medians, the median of the per-pair ratios and their spread (a few-MiB step reads +-1 MiB between runs)."""
    pairs = []
    for _ in range(max(1, rounds)):
        plain = _subprocess_json(plain_args, "AMPDOCTOR_MEMORY")
        diag = _subprocess_json(diagnose_args, "AMPDOCTOR_MEMORY")
        if plain and diag is not None:
            pairs.append((plain, diag))
    if not pairs:
        return {"plain_mib": None, "diagnose_mib": None, "memory_x": None, "memory_spread": None}
    ratios = [d / p for p, d in pairs]
    return {"plain_mib": statistics.median(p for p, _ in pairs), "diagnose_mib": statistics.median(d for _, d in pairs),
            "memory_x": statistics.median(ratios), "memory_spread": (min(ratios), max(ratios))}


def _memory_cell(row: dict[str, Any]) -> str:
    mx, spread = row["memory_x"], row.get("memory_spread")
    if mx is None:
        return "n/a"
    return f"{mx:.2f}×" + (f" [{spread[0]:.2f}–{spread[1]:.2f}]" if spread and spread[0] != spread[1] else "")


class _NoopMode(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def hooks_floor_step(model: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], Any], wrappers: bool = True) -> None:
    """A plain step under what the survey hangs, doing nothing: per module an instance ``forward`` wrapper
    (``wrappers``: the survey's design since call_wrappers) or a forward pre- and post-hook (with kwargs, through
    torch's public API), a gradient hook per module output and per parameter, one torch-function mode. The floor
    of the survey's design on a model of many modules."""
    from ampdoctor.capture.call_wrappers import PassForwards

    handles: list[Any] = []

    def post(module: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g: None)

    forwards = PassForwards(lambda m, a, k: None, post, lambda m, a, k: None)
    try:
        for module in model.modules():
            if wrappers:
                forwards.wrap(module)
            else:
                handles.append(module.register_forward_pre_hook(lambda m, a, k: None, with_kwargs=True))
                handles.append(module.register_forward_hook(post, with_kwargs=True))
        handles += [p.register_hook(lambda g: None) for p in model.parameters() if p.requires_grad]
        with _NoopMode():
            plain_step(model, batch, loss_fn)
    finally:
        forwards.remove()
        for handle in handles:
            handle.remove()


def measure_tenk(repeats: int, memory: bool) -> dict[str, Any]:
    import ampdoctor
    from ampdoctor.report.html import render_html

    model, x, loss_fn = tenk_model()
    modules = sum(1 for _ in model.modules()) - 1
    plain_step(model, x, loss_fn)
    diagnose = lambda: ampdoctor.diagnose(model, x, loss_fn=loss_fn, dtype=DTYPE)  # noqa: E731
    report = diagnose()  # warm-up
    pairs = []
    for _ in range(repeats):
        plain, _ = _clocked(lambda: plain_step(model, x, loss_fn))
        seconds, report = _clocked(diagnose)
        pairs.append((plain, seconds))
    floor, hook_floor = [], []
    for _ in range(repeats):
        plain, _ = _clocked(lambda: plain_step(model, x, loss_fn))
        floor.append((plain, _clocked(lambda: hooks_floor_step(model, x, loss_fn))[0]))
        hook_floor.append((plain, _clocked(lambda: hooks_floor_step(model, x, loss_fn, wrappers=False))[0]))
    html_s, html = _clocked(lambda: render_html(report))
    text_s, text = _clocked(report.to_text)
    json_s, js = _clocked(report.to_json)
    out: dict[str, Any] = {
        "modules": modules, "plain_s": statistics.median(p for p, _ in pairs),
        "diagnose_x": _median_ratio(pairs), "floor_x": _median_ratio(floor),
        "hook_floor_x": _median_ratio(hook_floor), "verdict": str(report.verdict),
        "passes": [(p.purpose, round(p.seconds, 2)) for p in report.run.passes],
        "html_bytes": len(html.encode()), "html_s": html_s, "text_bytes": len(text.encode()), "text_s": text_s,
        "json_bytes": len(js.encode()), "json_s": json_s,
    }
    if memory:
        out.update(_memory_rounds(["--_worker", "memory", "--mode", "plain"],
                                  ["--_worker", "memory", "--mode", "diagnose"], repeats))
    return out


# -- watch ------------------------------------------------------------------------------------------------------


def measure_watch(layers: int, rounds: int, steps: int) -> dict[str, Any]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import watch_overhead

    torch.manual_seed(0)
    case = watch_overhead.narrow_mlp(layers)
    # With the bare-hooks floor interleaved: what any watch with a Python hook per module costs on this model. AdamW
    # at lr 0 does the same work on weights that stay put: trained at 1e-5 by every mode's blocks, these deep
    # MLPs drift (the 200-layer one loses about 0.1 bit of headroom a step), and the default watch then samples
    # densely, as designed, so "defaults" would measure the dense window, not a steady run.
    return watch_overhead.measure(  # type: ignore[no-any-return]
        case, rounds, steps, warmup=3, amp=True, floor=True, lr=0.0
    )


def _watch_ratio(w: dict[str, Any], mode: str) -> str:
    """The median per-round ratio and its interquartile range (``watch_overhead.measure``)."""
    lo, hi = w["ratio_iqr"][mode]
    return f"{w['ratio'][mode]:.3f}× [{lo:.3f}–{hi:.3f}]"


# -- encoder ----------------------------------------------------------------------------------------------------


def measure_encoder(repeats: int, batch_div: int) -> dict[str, Any]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from overhead_models import build_case

    import ampdoctor

    case = build_case("encoder", torch.device("cpu"), batch_div)
    plain_step(case.model, case.batch, case.loss_fn)
    diagnose = lambda: ampdoctor.diagnose(case.model, case.batch, loss_fn=case.loss_fn, dtype=DTYPE)  # noqa: E731
    pairs = []
    report = None
    for _ in range(repeats):
        plain, _ = _clocked(lambda: plain_step(case.model, case.batch, case.loss_fn))
        seconds, report = _clocked(diagnose)
        pairs.append((plain, seconds))
    assert report is not None
    return {"description": case.description, "plain_s": statistics.median(p for p, _ in pairs),
            "diagnose_x": _median_ratio(pairs), "verdict": str(report.verdict),
            "passes": [(p.purpose, round(p.seconds, 2)) for p in report.run.passes]}


# -- first call -------------------------------------------------------------------------------------------------


def first_worker() -> None:
    """Fresh process: wall seconds of the first and the second diagnose, and the RSS each adds."""
    start = time.perf_counter()
    import ampdoctor

    imported = time.perf_counter() - start
    torch.set_num_threads(1)
    model, x, loss_fn = small_model()
    plain_step(model, x, loss_fn)
    out = {"import_s": imported}
    for key in ("first", "second"):
        rss = _status_kib("VmRSS") or 0
        out[key + "_s"], _ = _clocked(lambda: ampdoctor.diagnose(model, x, loss_fn=loss_fn, dtype=DTYPE),
                                      time.perf_counter)
        out[key + "_mib"] = ((_status_kib("VmRSS") or 0) - rss) / 1024
    out["dynamo_imported"] = "torch._dynamo" in sys.modules
    print("AMPDOCTOR_FIRST " + json.dumps(out))


def measure_first(repeats: int) -> dict[str, Any]:
    runs = [r for r in (_subprocess_json(["--_worker", "first"], "AMPDOCTOR_FIRST") for _ in range(repeats)) if r]
    if not runs:
        return {}
    extra = statistics.median(r["first_s"] - r["second_s"] for r in runs)
    return {"extra_s": extra, "first_s": statistics.median(r["first_s"] for r in runs),
            "second_s": statistics.median(r["second_s"] for r in runs),
            "extra_mib": statistics.median(r["first_mib"] - r["second_mib"] for r in runs),
            "import_s": statistics.median(r["import_s"] for r in runs),
            "dynamo_imported": any(r["dynamo_imported"] for r in runs)}


# -- failing diagnoses -----------------------------------------------------------------------------------------


def failing_model(variant: str) -> tuple[nn.Module, torch.Tensor, Callable[[Any, Any], Any]]:
    """``hidden_overhead.py``'s transformer: ``forward overflow`` (healthy blocks, ``blocks.0``'s feed-forward
    weights scaled by 100 and 1000: its second Linear makes inf) or ``hidden overflow`` (its hidden variant)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import hidden_overhead

    model, batch = hidden_overhead.build(variant != "hidden overflow", False, 16, 64)
    if variant == "forward overflow":
        block = model.blocks[0]  # type: ignore[index]
        with torch.no_grad():
            block.ff1.weight.mul_(100)
            block.ff2.weight.mul_(1000)
    return model.train(), batch, hidden_overhead.loss_fn


def failing_worker(mode: str) -> None:
    """Fresh process: the peak RSS increment of one plain step or one diagnose of a failing variant."""
    import ampdoctor

    torch.set_num_threads(1)
    kind, variant = mode.split(":", 1)
    model, x, loss_fn = failing_model(variant)
    run = (lambda: plain_step(model, x, loss_fn)) if kind == "plain" else (
        lambda: ampdoctor.diagnose(model, x, loss_fn=loss_fn, dtype=DTYPE, device_type="cpu"))
    _print_peak_increment(model, lambda: plain_step(model, x, loss_fn), run)


def measure_failing(repeats: int, memory: bool) -> dict[str, Any]:
    import ampdoctor

    out: dict[str, Any] = {}
    for variant in FAILING:
        model, x, loss_fn = failing_model(variant)
        plain_step(model, x, loss_fn)
        diagnose = lambda: ampdoctor.diagnose(model, x, loss_fn=loss_fn, dtype=DTYPE, device_type="cpu")  # noqa: E731,B023
        report = diagnose()  # warm-up
        pairs = []
        for _ in range(repeats):
            plain, _ = _clocked(lambda: plain_step(model, x, loss_fn))  # noqa: B023
            seconds, report = _clocked(diagnose)
            pairs.append((plain, seconds))
        row: dict[str, Any] = {
            "plain_s": statistics.median(p for p, _ in pairs), "diagnose_x": _median_ratio(pairs),
            "spread": (min(m / p for p, m in pairs), max(m / p for p, m in pairs)), "verdict": str(report.verdict),
            "passes": [(p.purpose, round(p.seconds, 2)) for p in report.run.passes],
        }
        if memory:
            row.update(_memory_rounds(["--_worker", "failing", "--mode", f"plain:{variant}"],
                                      ["--_worker", "failing", "--mode", f"diagnose:{variant}"], repeats))
        out[variant] = row
    return out


# -- output -----------------------------------------------------------------------------------------------------


def _gate(value: Optional[float], gate: float) -> str:
    return "n/a" if value is None else ("holds" if value <= gate else "MISSED")


def report(results: dict[str, Any]) -> None:
    print("| measure | value | goal | |\n|---|---|---|---|")
    t = results.get("tenk")
    if t:
        print(f"| 10,000 modules: diagnose, plain steps (plain {t['plain_s']:.3f} s; {t['verdict']}; passes "
              f"{t['passes']}) | {t['diagnose_x']:.2f}× | ≤ {GATES['tenk_time']:g} | "
              f"{_gate(t['diagnose_x'], GATES['tenk_time'])} |")
        print(f"| 10,000 modules: the survey's wrappers and hooks doing nothing (floor of its design; no goal) | "
              f"{t['floor_x']:.2f}× | | |")
        print(f"| 10,000 modules: the same with a forward pre- and post-hook per module instead of wrappers | "
              f"{t['hook_floor_x']:.2f}× | | |")
        if "memory_x" in t:
            mx = t["memory_x"]
            print(f"| 10,000 modules: diagnose peak memory / plain step's (medians {t['diagnose_mib'] or 0:.1f} / "
                  f"{t['plain_mib'] or 0:.1f} MiB) | {_memory_cell(t)} | ≤ {GATES['tenk_memory']} | "
                  f"{_gate(mx, GATES['tenk_memory'])} |")
        print(f"| 10,000 modules: HTML report (rendered in {t['html_s']:.2f} s; text {t['text_bytes'] / 1024:.0f} KiB "
              f"in {t['text_s']:.2f} s, JSON {t['json_bytes'] / 2**20:.1f} MiB in {t['json_s']:.2f} s) | "
              f"{t['html_bytes'] / 2**20:.2f} MiB | ≤ 1 MiB | {_gate(t['html_bytes'], GATES['tenk_html_bytes'])} |")
    for layers in (50, 200):
        w = results.get(f"watch{layers}")
        if w:
            best = w["best_s"]
            print(f"| watch, {layers}-layer narrow MLP, statistics every step (plain {best['plain'] * 1e3:.1f} ms, "
                  f"{(best['watch_every'] - best['plain']) * 1e6 / (2 * layers + 1):.0f} µs per module; "
                  f"best block {w['ratio_best']['watch_every']:.3f}×) | {_watch_ratio(w, 'watch_every')} | "
                  f"≤ {GATES['watch_every']} | "
                  f"{_gate(w['ratio']['watch_every'], GATES['watch_every'])} |")
            sampled = w.get("sampled_in_measurement", {}).get("watch")
            print(f"| watch, {layers}-layer narrow MLP, defaults ({sampled} of the measured steps sampled; best block "
                  f"{w['ratio_best']['watch']:.3f}×) | {_watch_ratio(w, 'watch')} | ≤ {GATES['watch']} | "
                  f"{_gate(w['ratio']['watch'], GATES['watch'])} |")
            if "floor" in w["ratio"]:
                print(f"| watch, {layers}-layer narrow MLP: bare hooks, one aminmax per output and per output "
                      f"gradient, nothing recorded (the floor of a Python hook per module; no goal; best block "
                      f"{w['ratio_best']['floor']:.3f}×) | {_watch_ratio(w, 'floor')} | | |")
    e = results.get("encoder")
    if e:
        print(f"| healthy encoder: diagnose, plain steps (plain {e['plain_s']:.2f} s; {e['verdict']}; passes "
              f"{e['passes']}) | {e['diagnose_x']:.2f}× | ≤ {GATES['encoder']} | "
              f"{_gate(e['diagnose_x'], GATES['encoder'])} |")
    for variant, r in (results.get("failing") or {}).items():
        low, high = r["spread"]
        print(f"| failing diagnose, 2-block transformer, {variant} (plain {r['plain_s']:.3f} s; {r['verdict']}; "
              f"{len(r['passes'])} passes; rounds {low:.2f}–{high:.2f}×) | {r['diagnose_x']:.2f}× | "
              f"≤ {GATES['failing']:g} | {_gate(r['diagnose_x'], GATES['failing'])} |")
        if "memory_x" in r:
            mx = r["memory_x"]
            print(f"| failing diagnose, {variant}: peak memory / plain step's (medians {r['diagnose_mib'] or 0:.1f} / "
                  f"{r['plain_mib'] or 0:.1f} MiB) | {_memory_cell(r)} | "
                  f"≤ {GATES['failing_memory']} | {_gate(mx, GATES['failing_memory'])} |")
    f = results.get("first")
    if f:
        print(f"| first diagnose in a fresh process minus the second, small model (wall: {f['first_s']:.2f} s vs "
              f"{f['second_s']:.2f} s, +{f['extra_mib']:.0f} MiB RSS; import ampdoctor {f['import_s']:.2f} s; "
              f"dynamo imported: {f['dynamo_imported']}) | {f['extra_s']:.2f} s | ≤ {GATES['first_extra_s']} s | "
              f"{_gate(f['extra_s'], GATES['first_extra_s'])} |")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per time ratio (median; default 3)")
    parser.add_argument("--quick", action="store_true", help="smoke run: one round, encoder batch / 8")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--_worker", dest="worker", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "memory":
        memory_worker(args.mode)
        return 0
    if args.worker == "failing":
        failing_worker(args.mode)
        return 0
    if args.worker == "first":
        first_worker()
        return 0
    torch.set_num_threads(1)
    repeats = 1 if args.quick else args.repeats
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    started = time.perf_counter()
    results: dict[str, Any] = {}
    for part in parts:
        if part == "tenk":
            results["tenk"] = measure_tenk(repeats, not args.no_memory)
        elif part == "watch":
            for layers in (50, 200):
                results[f"watch{layers}"] = measure_watch(layers, 2 if args.quick else 15, 3 if args.quick else 6)
        elif part == "encoder":
            results["encoder"] = measure_encoder(repeats, 8 if args.quick else 1)
        elif part == "first":
            results["first"] = measure_first(repeats)
        elif part == "failing":
            results["failing"] = measure_failing(repeats, not args.no_memory)
        else:
            print(f"unknown part {part!r}; choose from {','.join(PARTS)}", file=sys.stderr)
            return 2
        print(f"[{part} done, {time.perf_counter() - started:.0f} s]", file=sys.stderr, flush=True)
    import ampdoctor

    print(f"# ampdoctor cost per module ({ampdoctor.__version__}, torch {torch.__version__}, 1 thread, "
          f"{os.cpu_count()} cores; process CPU time, medians of {repeats} interleaved rounds)\n")
    report(results)
    print(f"\nTotal benchmark time {time.perf_counter() - started:.0f} s.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
