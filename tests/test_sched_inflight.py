"""In-flight prefixes: placed, not yet announced by KV events; registered at placement, gone when
the request ends or (after its prefill) once the events had time to arrive."""
from scheduler import Instance, Placement, RequestFacts, Scheduler
from scheduler.hashing import block_hashes
from scheduler.inflight import InflightPrefixes
from tests.sched_helpers import Clock, toks

BS = 16


def test_match_is_the_longest_contiguous_registered_prefix_per_instance():
    reg = InflightPrefixes()
    reg.add("a", "p0", [1, 2, 3, 4])
    reg.add("b", "p1", [1, 2, 9])
    assert reg.match([1, 2, 3, 4, 5], 5) == {"p0": 4, "p1": 2}
    assert reg.match([1, 2, 3, 4, 5], 3) == {"p0": 3, "p1": 2}  # capped at the usable blocks
    assert reg.match([7, 1, 2], 3) == {}  # a prefix starts at the first block
    reg.drop("a")
    assert reg.match([1, 2, 3], 3) == {"p1": 2}
    reg.add("c", "p1", [1, 2, 3])
    reg.drop("b")  # one registration of the shared blocks goes; the other stays
    assert reg.match([1, 2, 3], 3) == {"p1": 3} and len(reg) == 1


def test_registrations_lapse_after_the_prefill_plus_grace_and_at_release():
    reg = InflightPrefixes(grace_s=1.0)
    reg.add("a", "p0", [1, 2])
    reg.prefill_done("a", now=10.0)
    reg.expire(10.5)
    assert reg.match([1, 2], 2) == {"p0": 2}
    reg.expire(11.0)
    assert reg.match([1, 2], 2) == {} and len(reg) == 0
    reg.add("b", "p0", [1, 2])
    reg.drop("b")
    reg.drop("b")  # idempotent
    assert reg.match([1, 2], 2) == {} and len(reg) == 0


def test_registrations_are_found_by_their_first_block_and_leave_nothing_behind():
    reg = InflightPrefixes()
    chains = {f"r{k}": block_hashes(toks(k % 3, 64 + 16 * k), BS) for k in range(9)}  # three first blocks
    for k, (rid, hashes) in enumerate(chains.items()):
        reg.add(rid, f"p{k % 2}", hashes)
    for k in range(3):  # each prompt finds the registrations sharing its first block, on both instances
        got = reg.match(chains[f"r{k + 6}"], 100)
        assert set(got) == {"p0", "p1"} and max(got.values()) == len(chains[f"r{k + 6}"])
    assert reg.match(block_hashes(toks(5, 64), BS), 4) == {}
    for rid in chains:
        reg.drop(rid)
    assert len(reg) == 0 and reg._by_first == {} and reg.match(chains["r0"], 4) == {}


def test_hundreds_in_flight_behind_one_system_prompt_each_matched_to_its_own_chain():
    reg = InflightPrefixes()
    system = toks(1, 4 * BS)
    chains = [block_hashes(system + toks(100 + k, 3 * BS), BS) for k in range(200)]
    for k, hashes in enumerate(chains):
        reg.add(f"r{k}", f"p{k % 2}", hashes)
    own = block_hashes(system + toks(150, 2 * BS) + toks(7, BS), BS)  # r50's first 6 blocks, then its own
    assert reg.match(own, 7) == {"p0": 6, "p1": 4}
    stranger = block_hashes(system + toks(9, 3 * BS), BS)
    assert reg.match(stranger, 7) == {"p0": 4, "p1": 4}  # the system prompt only
    for k in range(200):
        if k != 51:
            reg.drop(f"r{k}")
    assert reg.match(own, 7) == {"p1": 4} and len(reg) == 1  # r50 gone; r51 (on p1) shares the system prompt


def pd(**params):
    clock = Clock(100.0)
    insts = [Instance(f"p{i}", "prefill") for i in range(3)] + [Instance("d0", "decode")]
    return Scheduler(insts, clock=clock, block_size=BS, policy="conductor", **params), clock


def facts(rid, tokens):
    return RequestFacts(rid, len(tokens), block_hashes(tokens, BS), 64)


def test_a_burst_sharing_a_new_prefix_follows_the_first_request():
    doc = toks(3, 20_000)
    burst = [doc + toks(10 + k, 200) for k in range(4)]
    sched, clock = pd(inflight=True, work_weight=1.0)
    first = sched.decide(facts("r0", burst[0]))
    assert isinstance(first, Placement) and first.hit_tokens == 0
    for k in range(1, 4):  # the KV events have not arrived: only the registry knows
        d = sched.decide(facts(f"r{k}", burst[k]))
        assert d.prefill == first.prefill and d.hit_tokens >= 20_000 - BS
        assert d.explanation["why"]["extra"]["inflight_hit_tokens"][first.prefill] >= 20_000 - BS
    plain, _ = pd(inflight=False, work_weight=1.0)  # reading only the KV-event hit map: nothing, so they spread
    chosen = {plain.decide(facts(f"r{k}", burst[k])).prefill for k in range(4)}
    assert len(chosen) > 1


def test_a_failed_or_rejected_request_leaves_no_registration():
    sched, clock = pd(inflight=True)
    doc = toks(4, 8000)
    d = sched.decide(facts("r0", doc))
    assert len(sched.inflight) == 1
    sched.release("r0")  # the engine failed before the prefill: nothing will arrive
    assert len(sched.inflight) == 0
    assert sched.decide(facts("r1", doc + toks(5, 100))).hit_tokens == 0
    r = sched.decide(RequestFacts("bad", 10, [1, 2, 3], 4))  # refused: never registered
    assert r.reason == "bad_block_hashes" and len(sched.inflight) == 1
    sched.prefill_done("r1")
    clock.t += 5.0  # the events had their time: the hit index is the truth now
    sched.decide(facts("r2", toks(6, 100)))
    assert len(sched.inflight) == 1  # r1 lapsed, r2 registered
    assert d.prefill  # placed
