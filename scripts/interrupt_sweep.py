"""Ctrl-C at many moments of ``diagnose`` and ``watch`` runs, sweep after sweep (issue 23).

    PYTHONPATH=src python scripts/interrupt_sweep.py --sweeps 20 --moments 16

Each sweep sends SIGINT at ``--moments`` evenly spaced (jittered) offsets across one whole run, each on a fresh
run, and checks after each that nothing the user owns changed (tests/interrupt_harness.py lists what is
compared). Prints one line per sweep; exits 1 at the first moment that leaves something behind.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from interrupt_harness import TRAINING_CHANGES, model_and_batch, sweep, timed, watched_run  # noqa: E402
from torch import nn  # noqa: E402

import ampdoctor  # noqa: E402


def runs() -> dict[str, tuple[Callable[[], object], nn.Module, object, tuple[str, ...]]]:
    model, batch = model_and_batch()
    emulated, emulated_batch = model_and_batch(1, blocks=4)
    watch_run, watched, scaler = watched_run()
    return {
        "diagnose": (lambda: ampdoctor.diagnose(model, batch, device_type="cpu", progress=False), model, None, ()),
        "diagnose, CUDA policy emulated": (
            lambda: ampdoctor.diagnose(emulated, emulated_batch, device_type="cuda", progress=False), emulated, None,
            (),
        ),
        "watch": (watch_run, watched, scaler, TRAINING_CHANGES),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweeps", type=int, default=20)
    parser.add_argument("--moments", type=int, default=16)
    parser.add_argument("--only", default=None, help="run only the runs whose name contains this")
    args = parser.parse_args()
    # Started in the background (nohup, &), the process inherits SIGINT ignored: give it Python's usual handler,
    # as in a terminal, or no interrupt would ever arrive.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rng = random.Random(0)
    failures = 0
    for name, (run, model, scaler, ignore) in runs().items():
        if args.only and args.only not in name:
            continue
        timed(run)  # the first run pays one-time costs (imports, kernel registration): not typical
        duration = min(timed(run) for _ in range(2)) * 1.1
        for number in range(args.sweeps):
            outcomes = sweep(run, model, args.moments, duration, rng, scaler, ignore)
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
