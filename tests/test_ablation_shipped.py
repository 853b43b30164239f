"""bench/experiments/ablation_shipped.py: each variant turns off exactly the departure it names and
keeps the rest of conductor as shipped (a parameter that did not reach the policy would make its row
a copy of "as shipped"); the best other is taken per seed. No simulation."""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "experiments"))  # the driver imports _common and friends by name

import ablation_shipped as A  # noqa: E402

from predictors.telemetry import SLO  # noqa: E402
from scheduler import Instance, Scheduler  # noqa: E402


def built(policy, params):
    s = Scheduler([Instance("p0", "prefill"), Instance("d0", "decode")], policy=policy, slo=SLO(ttft_s=5.0),
                  **params)
    room, p = s.defer, s.policy.params
    return {"defer": room.enabled, "join": room.join, "wait_holder": room.wait_holder, "inflight": p.inflight,
            "work_weight": p.work_weight, "decode_choice": p.decode_choice}


def test_each_variant_differs_from_as_shipped_in_exactly_what_it_names():
    shipped = built("conductor", {})
    assert shipped == {"defer": True, "join": True, "wait_holder": True, "inflight": True, "work_weight": 1.0,
                       "decode_choice": "first_token"}
    expect = {"no wait room (defer=off)": {"defer": False}, "room without join": {"join": False},
              "room without waiting for the holder": {"wait_holder": False},
              "no in-flight prefixes (inflight=false)": {"inflight": False},
              "no work term (work_weight=0)": {"work_weight": 0.0},
              "decode by TBT (decode_choice=tbt)": {"decode_choice": "tbt"}}
    for label, (policy, params, pred) in A.VARIANTS.items():
        got = built(policy, params)
        if label == "as shipped":
            assert (policy, params, pred) == ("conductor", {}, "learned")
        elif label == "Algorithm 1 (conductor_alg1)":
            assert policy == "conductor_alg1" and got == {"defer": False, "join": False, "wait_holder": False,
                                                          "inflight": False, "work_weight": 0.0,
                                                          "decode_choice": "tbt"}
        elif label == "analytic predictors":
            assert got == shipped and pred == "analytic"
        else:
            assert got == {**shipped, **expect.pop(label)} and pred == "learned", label
    assert expect == {}  # every named departure has its row
