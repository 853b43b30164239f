"""The scheduler's core shapes: one Role/Tier vocabulary, typed policy parameters, the
predictor registry and observe hook, state behind protocols, and decisions run as stages."""
import pytest

from predictors.base import Predictors
from predictors.registry import make_predictors, predictor_names, register_predictors
from predictors.telemetry import RequestRecord
from predictors.types import ROLES, Role, Tier
from scheduler import Instance, Rejection, RequestFacts, Scheduler
from scheduler.hashing import block_hashes
from scheduler.hit_index import HitIndex
from scheduler.ledger import Ledger
from scheduler.policies import POLICIES, make_policy
from scheduler.state import LoadLedger, PrefixIndex
from tests.sched_helpers import Clock, toks


def test_role_is_one_type_that_reads_as_its_wire_string():
    inst = Instance("p", "prefill")
    assert inst.role is Role.PREFILL and inst.role == "prefill" and ROLES == ("prefill", "decode", "both")
    assert Role.BOTH.prefills and Role.BOTH.decodes and not Role.DECODE.prefills and not Role.PREFILL.decodes
    with pytest.raises(ValueError, match="role must be one of prefill, decode, both"):
        Instance("x", "router")
    with pytest.raises(ValueError, match="other than"):
        Instance(Tier.STORE, "prefill")  # "store" names the shared store as a transfer source


def test_policy_parameters_are_typed_and_parsed_from_strings():
    p = make_policy("conductor", pull_rule="ratio", balancing_threshold="3.5", peer_pull="false")
    assert (p.params.pull_rule, p.params.balancing_threshold, p.params.peer_pull) == ("ratio", 3.5, False)
    s = make_policy("sglang_cache_aware", balance_abs_threshold="32")
    assert s.params.balance_abs_threshold == 32 and isinstance(s.params.balance_abs_threshold, int)
    for bad, match in [({"pull_rule": "always"}, "pull_rule must be one of"),
                       ({"balancing_threshold": "x"}, "must be a number"),
                       ({"balancing_threshold": 0}, "must be > 0"),
                       ({"peer_pull": "maybe"}, "true or false"),
                       ({"nope": 1}, "no parameter")]:
        with pytest.raises(ValueError, match=match):
            make_policy("conductor", **bad)
    with pytest.raises(ValueError, match="must be an integer"):
        make_policy("sglang_cache_aware", max_tree_blocks=1.5)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")
    assert POLICIES["dynamo_cost"].parameters()["host_cache_hit_weight"] == 0.75


def test_scheduler_passes_policy_parameters_through():
    sched = Scheduler([Instance("p", "both")], policy="dynamo_cost", router_temperature="0.5")
    assert sched.policy.params.router_temperature == 0.5
    with pytest.raises(ValueError, match="router_temperature"):
        Scheduler([Instance("p", "both")], policy="dynamo_cost", router_temperature=-1)


class _Learner:
    """A term predictor that learns from finished requests (what learned predictors will do)."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def observe(self, record):
        self.seen.append(record.request_id)


def test_predictors_by_name_and_the_observe_hook():
    assert "analytic" in predictor_names()
    with pytest.raises(ValueError, match="unknown predictors 'crystal_ball'; known: analytic"):
        make_predictors("crystal_ball")
    base = Scheduler([Instance("p", "both")]).predictors
    learner = _Learner(base.prefill)
    bundle = Predictors(queue=base.queue, prefill=learner, transfer=base.transfer, tbt=learner)
    register_predictors("test-learner", lambda **kw: bundle)
    with pytest.raises(ValueError, match="already registered"):
        register_predictors("test-learner", lambda **kw: bundle)
    got = make_predictors("test-learner")
    got.observe(RequestRecord("r1", 0.0))
    assert learner.seen == ["r1"]  # shared by two terms, told once


def test_state_lives_behind_protocols_and_can_be_injected():
    assert isinstance(HitIndex(16), PrefixIndex) and isinstance(Ledger(), LoadLedger)
    index, ledger = HitIndex(16), Ledger()
    sched = Scheduler([Instance("p", "both")], index=index, ledger=ledger, clock=Clock(1.0))
    assert sched.index is index and sched.ledger is ledger
    prompt = toks(1, 64)
    index.block_stored("p", [1, 2, 3], None, prompt[:48], 16)
    d = sched.decide(RequestFacts("r", 64, block_hashes(prompt, 16), 8))
    assert d.hit_tokens == 48 and "r" in ledger  # the injected index answered and the injected ledger holds it


def test_each_stage_refuses_with_its_own_reason():
    clock = Clock(0.0)
    sched = Scheduler([Instance("p", "prefill"), Instance("d", "decode")], clock=clock)
    facts = RequestFacts("r", 64, block_hashes(toks(2, 64), 16), 8)
    assert sched.decide(facts).prefill == "p"
    dup = sched.decide(facts)  # validate stage
    assert isinstance(dup, Rejection) and dup.reason == "duplicate_request_id"
    sched.set_healthy("d", False)  # eligible stage
    r = sched.decide(RequestFacts("r2", 64, facts.block_hashes, 8))
    assert isinstance(r, Rejection) and r.reason == "no_healthy_decode"
    sched.set_healthy("d", True)
    bad = sched.decide(RequestFacts("r3", 64, ["x"] * 4, 8))  # validate stage
    assert isinstance(bad, Rejection) and bad.reason == "bad_block_hashes" and bad.status == 400
    assert sched.release("r") and sched.ledger.is_idle()
