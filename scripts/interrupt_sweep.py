"""Ctrl-C at many moments of ``diagnose`` and ``watch`` runs, sweep after sweep (issue 23).

    PYTHONPATH=src python scripts/interrupt_sweep.py --sweeps 20 --moments 16

Each sweep sends SIGINT at ``--moments`` evenly spaced (jittered) offsets across one whole run, each on a fresh
run, and checks after each that nothing the user owns changed (tests/interrupt_harness.py lists what is
compared). Prints one line per sweep; exits 1 at the first moment that leaves something behind.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from interrupt_harness import model_and_batch, sweep, timed  # noqa: E402

import ampdoctor  # noqa: E402


def runs() -> dict[str, tuple[object, object]]:
    model, batch = model_and_batch()
    emulated, emulated_batch = model_and_batch(1, blocks=4)
    watched, watched_batch = model_and_batch(2, blocks=4)
    opt = torch.optim.SGD(watched.parameters(), lr=0.0)  # lr 0: the weights stay, the run repeats exactly

    def watch_steps() -> None:
        scaler = torch.amp.GradScaler("cpu")
        with ampdoctor.watch(watched, scaler, stats_every=1) as _:
            for _ in range(3):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = watched(watched_batch).float().pow(2).mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)

    return {
        "diagnose": (lambda: ampdoctor.diagnose(model, batch, device_type="cpu", progress=False), model),
        "diagnose, CUDA policy emulated": (
            lambda: ampdoctor.diagnose(emulated, emulated_batch, device_type="cuda", progress=False), emulated
        ),
        "watch": (watch_steps, watched),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweeps", type=int, default=20)
    parser.add_argument("--moments", type=int, default=16)
    parser.add_argument("--only", default=None, help="run only the runs whose name contains this")
    args = parser.parse_args()
    rng = random.Random(0)
    failures = 0
    for name, (run, model) in runs().items():
        if args.only and args.only not in name:
            continue
        duration = timed(run) * 1.1  # type: ignore[operator]
        for number in range(args.sweeps):
            outcomes = sweep(run, model, args.moments, duration, rng)  # type: ignore[arg-type]
            bad = [o for o in outcomes if o.left_behind or o.result not in ("interrupted", "finished")]
            interrupted = sum(o.result == "interrupted" for o in outcomes)
            print(f"{name}: sweep {number + 1}/{args.sweeps} over {duration:.2f} s: {interrupted} interrupted, "
                  f"{len(outcomes) - interrupted} finished, {len(bad)} left something behind", flush=True)
            for o in bad:
                print(f"    at {o.offset:.3f} s ({o.result}): {'; '.join(o.left_behind)}", flush=True)
            failures += len(bad)
            if bad:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
