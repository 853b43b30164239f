"""Deferred dispatch in the virtual-time simulator: every request ends once, nothing is held at
the end, waits are recorded, runs are reproducible, and with the option off nothing changes."""
from __future__ import annotations

import collections
import json

from loadgen.simulate.cluster import ClusterSpec, SchedulerSpec
from predictors.telemetry import SLO
from scheduler.deferral import DEADLINE
from tests.test_simulate import conductor, run

SLO_TIGHT = SLO(ttft_s=0.5, tbt_s=0.2)


def overloaded(policy="conductor", **params):
    return run(policy, n=400, rate=60.0, cluster=ClusterSpec(prefill=2, decode=2, seed=3), slo=SLO_TIGHT,
               policy_params=params)


def test_overloaded_run_ends_every_request_once_and_refuses_at_deadline():
    r = overloaded(defer=True, defer_horizon_s=0.05)  # simulate() raises if a reservation or a waiter is left
    assert len({x.request_id for x in r.records}) == 400
    c = r.scheduler_counts
    assert c["defer_waited"] == c["defer_dispatched"] + c["defer_deadline"] + c["defer_refused"] > 0
    late = [x for x in r.records if x.reject_reason == DEADLINE]
    assert late and len(late) == c["defer_deadline"]
    for x in late:
        assert x.status == "rejected" and x.prefill_instance is None and x.first_token_s is None
        assert 0 < x.extra["wait_s"] <= SLO_TIGHT.ttft_s and x.end_s == x.arrival_s + x.extra["wait_s"]
    waited = [x for x in r.records if x.status == "ok" and "wait_s" in x.extra]
    assert waited and all(x.decided_s == x.arrival_s + x.extra["wait_s"] for x in waited)
    # the TTFT counts the wait: it runs from the arrival at the gateway
    assert all(x.ttft_s >= x.extra["wait_s"] for x in waited)


def test_off_changes_nothing():
    # a policy without a wait room of its own (every one but conductor) decides as with defer=off
    plain, off = overloaded("dynamo_cost"), overloaded("dynamo_cost", defer=False)
    assert [x.to_dict() for x in plain.records] == [x.to_dict() for x in off.records]
    assert plain.scheduler_counts == off.scheduler_counts
    assert not any("wait_s" in x.extra for x in plain.records)


def test_conductor_waits_by_default_and_off_decides_at_arrival():
    """conductor runs with its wait room (``WAIT_ROOM``) unless ``defer=off``; Algorithm 1 never waits."""
    default, off, alg1 = overloaded(), overloaded(defer=False), overloaded("conductor_alg1")
    room = default.stats.wait_room
    assert room["waited"] > 0 and room["joined"] > 0  # join is part of the default
    assert sum("wait_s" in x.extra for x in default.records) == default.scheduler_counts["defer_waited"]
    for r in (off, alg1):
        assert not r.stats.wait_room and not any("wait_s" in x.extra for x in r.records)
    # under this overload the room serves more within the SLO than deciding at arrival
    def met(r):
        return sum(x.meets(SLO_TIGHT) for x in r.records)

    assert met(default) > met(off)
    assert not any("wait_s" in x.extra for x in off.records)


def test_deferral_serves_more_of_the_overloaded_run_within_the_slo():
    counts = {}
    for on in (False, True):
        r = overloaded(defer=on, defer_horizon_s=0.05)
        counts[on] = collections.Counter(x.meets(SLO_TIGHT) for x in r.records)[True]
    assert counts[True] > counts[False]


def test_the_command_is_byte_deterministic_with_defer_on(tmp_path):
    args = ["--synthetic", "--requests", "80", "--rate", "40", "--prefill", "1", "--decode", "1",
            "--slo-ttft-ms", "800", "--slo-tbt-ms", "200", "--policy-param", "defer=on",
            "--policy-param", "defer_horizon_s=0.05", "--quiet"]
    p1 = conductor(*args, "--out", str(tmp_path / "a"))
    assert p1.returncode == 0, p1.stderr
    p2 = conductor(*args, "--out", str(tmp_path / "b"))
    assert p2.returncode == 0, p2.stderr
    assert (tmp_path / "a" / "summary.json").read_bytes() == (tmp_path / "b" / "summary.json").read_bytes()
    # the summary carries the room's counts: every waiter was evaluated at least at its arrival
    room = json.loads((tmp_path / "a" / "summary.json").read_text())["steps"][0]["simulation"]["wait_room"]
    assert room["evaluations"] >= room["waited"] > 0
    assert room["waited"] == room["dispatched"] + room["deadline"] + room["refused"] + room["cancelled"]
    recs = [json.loads(x) for x in (tmp_path / "a" / "requests.jsonl").read_text().splitlines()]
    assert any("wait_s" in (r.get("extra") or {}) for r in recs)


def test_a_sweep_pins_a_policy_wherever_it_stands_in_the_list():
    """``SimConfig.pinned``: an experiment runs conductor as its page measured it (here without the
    room), second in the list, where --policy-param does not reach."""
    from loadgen.simulate.sweep import SimConfig, run_sweep
    from tests.test_simulate import workload

    def sweep(pinned):
        cfg = SimConfig(base=workload(400, 60.0), cluster=ClusterSpec(prefill=2, decode=2, seed=3),
                        scheduler=SchedulerSpec(slo=SLO_TIGHT), policies=["round_robin", "conductor"], slo=SLO_TIGHT,
                        loads=[1.0], workers=1, progress=False, pinned=pinned)
        return {s.policy: s.records for s in run_sweep(cfg).steps}

    shipped, pinned = sweep({}), sweep({"conductor": {"defer": False}})
    assert any("wait_s" in x.extra for x in shipped["conductor"])
    assert not any("wait_s" in x.extra for x in pinned["conductor"])
    assert [x.to_dict() for x in shipped["round_robin"]] == [x.to_dict() for x in pinned["round_robin"]]
