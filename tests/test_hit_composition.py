"""bench/experiments/hit_composition.py: two runs' hits are compared on the requests both completed,
and a run's own completed requests are what its bound is over. No server; one small simulation."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "experiments"))  # the driver imports _common and friends by name

import hit_composition as H  # noqa: E402


def tokens(**by):
    return {int(k[1:]): {"cached_tokens": c, "prompt_tokens": p} for k, (c, p) in by.items()}


def test_the_same_requests_are_compared_and_the_rest_counted_apart():
    # conductor completed 1, 2, 3 (3: long, uncached); the other 1, 2, 4 (4: fully cached)
    ours = {"tokens": tokens(r1=(500, 1000), r2=(100, 1000), r3=(0, 8000))}
    theirs = {"tokens": tokens(r1=(400, 1000), r2=(100, 1000), r4=(900, 1000))}
    p = H.pair(ours, theirs)
    assert p["both"] == 2 and p["ours_only"] == 1 and p["theirs_only"] == 1
    assert p["ours_both"] == pytest.approx(0.3) and p["theirs_both"] == pytest.approx(0.25)
    assert p["ours_only_hit"] == 0 and p["theirs_only_hit"] == pytest.approx(0.9)
    # on everything each completed the order flips: 600/10000 against 1400/3000
    assert H.P.hit(list(ours["tokens"].values())) < H.P.hit(list(theirs["tokens"].values()))


def test_a_run_reports_its_completed_requests_and_the_bound_over_them():
    from loadgen.simulate.reuse import served_bound
    from loadgen.synthetic import parse_dist, synthetic_workload

    w = synthetic_workload(80, 40.0, input_tokens=parse_dist("lognormal:1500:0.6"),
                           output_tokens=parse_dist("lognormal:32:0.5"), turns=3, turn_gap_s=1.0,
                           shared_prefix_blocks=1, seed=1)
    spec = H.C.cluster(1, 1)
    r = H._run((w, spec, "conductor", 1.0, 1.0, 200.0, "analytic", 0))  # overloaded: some are refused
    assert 0 < len(r["tokens"]) < len(w.requests)
    total, hit = served_bound(w, r["tokens"], spec.block_size, 10**9, salt="sim-0")
    assert r["served_bound"] <= hit / total + 1e-12  # the cluster's capacity can only lower it
    assert sum(t["prompt_tokens"] for t in r["tokens"].values()) == total
