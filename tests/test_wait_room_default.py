"""conductor runs with its wait room by default (scheduler/policies/conductor.py ``WAIT_ROOM``,
docs/experiments/default-wait-room.md): ``defer=off`` decides at arrival, a given ``defer_*`` overrides
one setting and keeps the rest, Algorithm 1 and every other policy have no room unless asked, and
without SLO admission there is no room unless ``defer=on`` (the room refuses at the deadline)."""
from __future__ import annotations

import dataclasses

import pytest
import requests

from predictors.telemetry import SLO
from scheduler import Instance, Scheduler
from scheduler.deferral_params import PARAM_KEYS, DeferParams, split_params
from scheduler.policies import POLICIES
from scheduler.policies.conductor import WAIT_ROOM
from tests.servers import gateway

INSTANCES = [Instance("p0", "prefill"), Instance("d0", "decode")]


def room(policy: str = "conductor", **params) -> DeferParams:
    return Scheduler(INSTANCES, policy=policy, slo=SLO(ttft_s=5.0, tbt_s=0.2), **params).defer


def test_conductor_has_the_room_with_its_setting_by_default():
    got = room()
    assert got.enabled
    for key, value in WAIT_ROOM.items():
        assert getattr(got, PARAM_KEYS[key]) == value, key
    # the setting is not the room's own defaults: join, aging, a wider scan, waiting for the holder
    assert got != dataclasses.replace(DeferParams(), enabled=True)
    assert (got.join, got.wait_holder, got.scan) == (True, True, 64)


def test_off_decides_at_arrival_and_one_setting_overrides_only_itself():
    assert not room(defer="off").enabled
    assert not room(defer=False).enabled
    one = room(defer_join="off", defer_horizon_s="0.5")
    assert one.enabled and not one.join and one.horizon_s == 0.5
    assert (one.aging, one.scan, one.wait_holder, one.reeval_s) == (0.05, 64, True, 0.1)  # the rest: conductor's


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "conductor"])
def test_algorithm_1_and_every_other_policy_wait_only_when_asked(policy):
    assert room(policy) == DeferParams()
    asked = room(policy, defer="on")
    assert asked == dataclasses.replace(DeferParams(), enabled=True)  # the room's own defaults, not conductor's


def test_without_admission_nothing_waits_unless_asked():
    assert not room(admission=False).enabled
    assert room(admission=False, defer="on") == dataclasses.replace(DeferParams(), enabled=True)


def test_a_bad_default_override_is_refused_by_name():
    with pytest.raises(ValueError, match="defer_scan must be a positive integer"):
        split_params({"defer_scan": "0"}, WAIT_ROOM)


@pytest.mark.slow
def test_conductor_serve_with_no_policy_parameter_runs_the_room():
    cfg = "[embedded]\nprefill = 1\ndecode = 1\nstore = false\n"
    with gateway(cfg) as g:
        view = requests.get(g["url"] + "/admin/cluster", timeout=10).json()
    assert view["wait_room"]["enabled"] and view["wait_room"]["aging"] == WAIT_ROOM["defer_aging"]
    assert view["wait_room"]["waiting"] == 0
