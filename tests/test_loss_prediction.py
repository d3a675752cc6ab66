"""analysis.scale.LossPrediction: per-module losses from binade histograms, kept as arrays (a model of thousands of
modules asks for each), against the scalar definitions written out here."""

from __future__ import annotations

import random

import pytest

from ampdoctor.analysis.scale import LossPrediction
from ampdoctor.capture.staging import HIST_BINS
from ampdoctor.thresholds import GRADIENT_KEY, HIST_LOW


def _scalar_lost(hists: dict[str, list[int]], owners: dict[str, str], at: int, flush: int, exponent: int,
                 module: str | None) -> float:
    # Bin i holds binade HIST_LOW + i - 1; it is lost at 2**exponent when HIST_LOW + i + (exponent - at) <= flush.
    total = 0.0
    for name, hist in hists.items():
        if name.startswith(GRADIENT_KEY) or (module is not None and owners.get(name, name) != module):
            continue
        total += sum(c for i, c in enumerate(hist) if HIST_LOW + i + (exponent - at) <= flush)
    return total


@pytest.mark.parametrize("seed", range(5))
def test_lost_and_lowest_useful_match_the_scalar_definitions(seed: int) -> None:
    rng = random.Random(seed)
    at, flush = 16, -25
    owners = {f"m{i}.weight": f"m{i}" for i in range(6)} | {f"m{i}.bias": f"m{i}" for i in range(6)}
    hists: dict[str, list[int]] = {}
    for name in owners:
        hist = [0] * HIST_BINS
        for _ in range(rng.randint(1, 40)):  # values a few binades above the flush threshold at 2**16
            hist[rng.randint(flush - HIST_LOW - 6, flush - HIST_LOW + 30)] += rng.randint(1, 9)
        hists[name] = hist
    hists[GRADIENT_KEY + "x"] = [1] * HIST_BINS
    prediction = LossPrediction(hists, at, flush, owners)
    for exponent in range(-4, 24):
        assert prediction.lost(exponent) == _scalar_lost(hists, owners, at, flush, exponent, None)
        for m in ("m0", "m3", "absent"):
            assert prediction.lost(exponent, m) == _scalar_lost(hists, owners, at, flush, exponent, m)
    counts = {f"m{i}": sum(sum(hists[f"m{i}.{p}"]) for p in ("weight", "bias")) for i in range(6)}
    counts["absent"] = 10
    for top in (0, 1, 7, 20):
        for share in (0.0, 0.01, 0.2):
            expected = {}
            for m, count in counts.items():
                e = top
                while e > 0 and prediction.lost(e - 1, m) / count < share:
                    e -= 1
                expected[m] = e
            assert prediction.lowest_useful(counts, top, share) == expected
