"""Live and simulated agree (issue 9, "Trust"): the same trace slice through `conductor serve`
(embedded 2P+2D sim engines at a time scale) + `conductor loadgen`, and through `conductor simulate`
in virtual time, compared in modelled seconds by bench/live_vs_sim.py.

The live run is started once per module and compared twice: against the simulation as it should
be (agrees), and against one running another policy (must disagree: the check can fail). A
simulated KV-event lag unlike the gateway's no longer disagrees on this slice: the in-flight
prefix registry covers the lag, which is what it is for. Admission is off on both sides (see
bench/live_vs_sim.py's Slice.admission)."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

slow = pytest.mark.slow  # ~45 s in all: one live run of 60 requests at time scale 4, then simulations
# alone, never beside another xdist worker: at time scale 4 a busy neighbour's host delays flip near-ties
# early in the live run, and its placements then follow another path (CI stop 36: 75% same up to a renaming)
pytestmark = pytest.mark.serial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location("live_vs_sim", os.path.join(ROOT, "bench", "live_vs_sim.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["live_vs_sim"] = mod
    spec.loader.exec_module(mod)
    return mod


B = _bench()
# admission off on both sides: placement is compared, attainment measured against the binding SLO
# at 4x the prefill queues stay short: fewer near-ties for live timing to flip (at 8x on a loaded
# machine one flip early on can send the rest of the run down another, equally balanced, path)
SLICE = B.Slice(limit=60, speedup=4.0, time_scale=4.0, slo_ttft_ms=2000.0, slo_tbt_ms=100.0, admission=False)


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> str:
    return B.run_live(SLICE, str(tmp_path_factory.mktemp("live")))


def _sim(tmp_path, **changes) -> str:
    s = B.Slice(**{**vars(SLICE), **changes})
    return B.run_sim(s, str(tmp_path / "sim"))


@slow
def test_live_and_simulated_agree(live, tmp_path):
    c = B.compare(live, _sim(tmp_path), SLICE.time_scale)
    print(B.table(c))  # shown with pytest -rP
    assert c["requests"]["matched"] == SLICE.limit
    assert B.check(c, B.Bounds()) == [], B.table(c)
    assert c["same_status"] >= 0.95, B.table(c)


@slow
def test_another_policy_disagrees(live, tmp_path):
    c = B.compare(live, _sim(tmp_path, policy="least_loaded"), SLICE.time_scale)
    assert B.check(c, B.Bounds()) != [], B.table(c)


def test_simulated_requests_carry_the_ids_loadgen_sends(tmp_path):
    """The scheduler's tie-breaking RNG is seeded by the request id: the simulation of loadgen's
    step s against target t must use loadgen's ids (s{s}-t{t}-r{index}) to break ties alike."""
    from loadgen.simulate.cluster import ClusterSpec, SchedulerSpec
    from loadgen.simulate.sweep import SimConfig, run_sweep
    from loadgen.workload import read_trace

    w = read_trace(SLICE.trace, limit=4)
    cfg = SimConfig(base=w, cluster=ClusterSpec(), scheduler=SchedulerSpec(), policies=["conductor", "round_robin"],
                    slo=SchedulerSpec().slo, load_kind="speedup", loads=[1.0, 2.0], workers=1, progress=False)
    out = run_sweep(cfg)
    ids = {r.request_id for step in out.steps for r in step.records}
    assert ids == {f"s{s}-t{t}-r{i}" for s in range(2) for t in range(2) for i in range(4)}


def test_one_renaming_forgives_a_mirrored_rest_of_the_run_only():
    """A near-tie flip between two equal instances sends the rest of the run down the mirrored
    path: the same schedule under swapped names. One renaming from some request on forgives
    that, not a second flip nor a different pattern."""
    f = B.same_up_to_one_relabelling
    run = ["p0", "p1", "p1", "p0", "p1", "p0", "p0", "p1", "p0", "p1"]
    swap = {"p0": "p1", "p1": "p0"}
    assert f(list(zip(run, run, strict=True))) == 1.0 and f([]) == 1.0
    mirrored = run[:4] + [swap[x] for x in run[4:]]
    assert f(list(zip(mirrored, run, strict=True))) == 1.0
    twice = mirrored[:7] + run[7:]  # flipped back after three requests: those three stay wrong
    assert f(list(zip(twice, run, strict=True))) == 0.7
    other = ["p0"] * 10  # everything on one instance: not the same schedule under any names
    assert f(list(zip(other, run, strict=True))) == 0.6  # at best, the run's p0s up to request 6, its p1s after
    three = ["p0", "p1", "p2"] * 3
    rotated = three[:3] + [{"p0": "p1", "p1": "p2", "p2": "p0"}[x] for x in three[3:]]
    assert f(list(zip(rotated, three, strict=True))) == 1.0
    assert f([(None, "p0"), ("p0", "p0")]) == 0.5  # placed on one side only: never the same
