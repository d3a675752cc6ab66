"""Peak memory of ``ampdoctor scan`` on a ``torch.distributed.checkpoint`` folder: bounded by the largest tensor.

Writes a DCP folder of ``--tensors`` float32 tensors of ``--mib`` MiB each (``torch.distributed.checkpoint.save``,
no process group) in a child process, then scans it in a fresh one and prints, as ``key=value`` lines:
``checkpoint_bytes`` (the tensors' bytes), ``largest_bytes`` (one tensor), ``peak_growth_bytes`` (the scan's peak
resident memory above what the process held before it: ``ru_maxrss`` after, minus the resident size before) and
their ratio. The scan runs with ``MALLOC_MMAP_THRESHOLD_=1048576`` so that freed tensors leave the resident set (a
measurement choice: by default glibc may keep freed blocks for reuse). A model larger than RAM/4 is this case
scaled up: ``--tensors 64 --mib 256`` is a 16 GiB checkpoint.

    python benchmarks/dcp_memory.py --tensors 16 --mib 64
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

WRITE = """
import sys, warnings, torch
import torch.distributed.checkpoint as dcp
n, mib, folder = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
numel = mib * 2**20 // 4
state = {"model": {f"layer{i}.weight": torch.randn(numel // 1024, 1024) for i in range(n)}}
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    dcp.save(state, checkpoint_id=folder)
    dcp.save({"model": {"w": torch.ones(4, 4)}}, checkpoint_id=folder + "-warmup")
"""

SCAN = """
import resource, sys
import torch
import ampdoctor


def rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


ampdoctor.scan(sys.argv[1] + "-warmup")  # imports and first-call caches are not the scan's memory
before = rss()
resource_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
report = ampdoctor.scan(sys.argv[1])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
largest = max(t.stats.numel for t in report.tensors) * 4
total = sum(t.stats.numel for t in report.tensors) * 4
print(f"tensors={len(report.tensors)} checkpoint_bytes={total} largest_bytes={largest}")
print(f"peak_growth_bytes={peak - max(before, resource_before)} verdict={report.verdict}")
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--mib", type=int, default=64, help="MiB per tensor")
    parser.add_argument("--folder", help="where to write the checkpoint (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or str(Path(tmp) / "dcp")
        subprocess.run([sys.executable, "-c", WRITE, str(args.tensors), str(args.mib), folder], check=True)
        # Large blocks from the system allocator at once, and back to it when freed: resident memory then follows
        # what is alive (glibc otherwise keeps freed 16 MiB blocks in its heap after raising its mmap threshold).
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
        done = subprocess.run(
            [sys.executable, "-c", SCAN, folder], check=True, capture_output=True, text=True, env=env
        )
    print(done.stdout.strip())
    values = dict(item.split("=", 1) for item in done.stdout.split())
    ratio = int(values["peak_growth_bytes"]) / int(values["largest_bytes"])
    share = int(values["peak_growth_bytes"]) / int(values["checkpoint_bytes"])
    print(f"peak_over_largest={ratio:.2f} peak_over_checkpoint={share:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
