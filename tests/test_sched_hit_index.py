"""Hit index: KV events in, longest contiguous prefix per instance and tier out."""
from hypothesis import given, settings, strategies as st

from scheduler.hashing import block_hashes, vllm_block_hashes
from scheduler.hit_index import HitIndex

BS = 4
# three token sequences sharing prefixes: A and B share 3 blocks, C shares nothing
A = list(range(100, 140))
B = A[:12] + list(range(500, 528))
C = list(range(900, 940))
SEQS = (A, B, C)
INSTANCES = ("i0", "i1", "i2")
MEDIA = {"GPU": "device", "CPU": "host", "CPU_PINNED": "host", "EXTERNAL": "store", "DISK": "store", "cpu": "store"}


def salted(hashes, instance, trust=False):
    """Engine block ids as an engine with its own seed would name them (differ per instance);
    ``trust``: the engine names blocks by the index's own hash (the simulator's engines)."""
    if trust:
        return list(hashes)
    salt = {"i0": 0x1111, "i1": 0x2222, "i2": 0x3333}[instance]
    return [h ^ salt for h in hashes]


class Model:
    """The semantics the index must have, written the slow, obvious way."""

    def __init__(self, trust=False):
        self.trust = trust
        self.held = {i: {"device": set(), "host": set(), "store": set()} for i in INSTANCES}
        self.known = {i: {} for i in INSTANCES}  # engine hash -> index hash, while held somewhere

    def store(self, inst, seq, a, b, medium):
        ours = block_hashes(seq, BS)
        eng = salted(ours, inst, self.trust)
        parent = eng[a - 1] if a else None
        if parent is not None and parent not in self.known[inst]:
            return False
        for k in range(a, b):
            self.held[inst][MEDIA[medium]].add(ours[k])
            self.known[inst][eng[k]] = ours[k]
        return True

    def remove(self, inst, eng_hashes, medium):
        tier = MEDIA[medium]
        ok = True
        for e in eng_hashes:
            h = self.known[inst].get(e)
            if h is None or h not in self.held[inst][tier]:
                ok = False
                continue
            self.held[inst][tier].discard(h)
            if not any(h in s for s in self.held[inst].values()):
                del self.known[inst][e]
        return ok

    def clear(self, inst, tiers):
        for t in tiers:
            self.held[inst][t].clear()
        self.known[inst] = {e: h for e, h in self.known[inst].items()
                            if any(h in self.held[inst][t] for t in ("device", "host", "store"))}

    def match(self, hashes):
        def run(pred):
            n = 0
            while n < len(hashes) and pred(hashes[n]):
                n += 1
            return n

        device = {i: run(lambda h, i=i: h in self.held[i]["device"]) for i in INSTANCES}
        local = {i: run(lambda h, i=i: h in self.held[i]["device"] or h in self.held[i]["host"]) for i in INSTANCES}
        store = run(lambda h: any(h in self.held[i]["store"] for i in INSTANCES))
        return ({k: v for k, v in device.items() if v}, {k: v for k, v in local.items() if v}, store)


op = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(INSTANCES), st.integers(0, 2), st.integers(0, 9), st.integers(1, 10),
              st.sampled_from(sorted(MEDIA))),
    st.tuples(st.just("remove"), st.sampled_from(INSTANCES), st.integers(0, 2), st.integers(0, 9), st.integers(1, 4),
              st.sampled_from(sorted(MEDIA))),
    st.tuples(st.just("clear"), st.sampled_from(INSTANCES)),
    st.tuples(st.just("drop"), st.sampled_from(INSTANCES)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=40))
def test_longest_prefix_matches_model_after_any_event_sequence(ops):
    _check_against_model(ops, trust=False)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=40))
def test_trusted_event_hashes_give_the_same_index_as_rehashing(ops):
    _check_against_model(ops, trust=True)


def _check_against_model(ops, trust):
    index, model = HitIndex(BS, trust_event_hashes=trust), Model(trust)
    for i in INSTANCES:
        index.register(i)
    for o in ops:
        if o[0] == "store":
            _, inst, s, a, n, medium = o
            seq = SEQS[s]
            b = min(a + n, len(seq) // BS)
            if a >= b:
                continue
            ours = block_hashes(seq, BS)
            eng = salted(ours, inst, trust)
            got = index.block_stored(inst, eng[a:b], eng[a - 1] if a else None, seq[a * BS:b * BS], BS, medium)
            assert got == model.store(inst, seq, a, b, medium)
        elif o[0] == "remove":
            _, inst, s, a, n, medium = o
            eng = salted(block_hashes(SEQS[s], BS), inst, trust)[a:a + n]
            assert index.block_removed(inst, eng, medium) == model.remove(inst, eng, medium)
        elif o[0] == "clear":
            index.all_cleared(o[1])
            model.clear(o[1], ("device", "host"))
        else:
            index.drop_instance(o[1])  # a rebuild keeps what the instance wrote to the store
            model.clear(o[1], ("device", "host"))
    for seq in SEQS:
        hashes = block_hashes(seq, BS)
        m = index.match(hashes)
        assert (m.device, m.local, m.store) == model.match(hashes)
    for i in INSTANCES:  # per-tier counts agree with what is held
        assert index.cached_blocks(i) == {t: len(model.held[i][t]) for t in ("device", "host", "store")}


def test_first_miss_stops_even_when_later_blocks_are_held():
    index = HitIndex(BS)
    index.register("p")
    h = block_hashes(A, BS)
    e = salted(h, "i0")
    assert index.block_stored("p", e, None, A, BS)
    assert index.block_removed("p", [e[3]])  # a hole at block 3
    m = index.match(h)
    assert m.device == {"p": 3} and m.local == {"p": 3}


def test_limit_caps_the_walk():
    index = HitIndex(BS)
    index.register("p")
    h = block_hashes(A, BS)
    index.block_stored("p", salted(h, "i0"), None, A, BS)
    assert index.match(h).device == {"p": 10}
    assert index.match(h, limit=4).device == {"p": 4}
    assert index.match(h, limit=0).device == {}


def test_index_hashes_equal_the_gateways_for_the_same_tokens_whatever_the_engine_ids():
    """Events named by vLLM's own sha256 ids still match prompts hashed by the gateway."""
    index = HitIndex(16)
    index.register("vllm")
    prompt = list(range(1, 16 * 8 + 5))
    engine_ids = vllm_block_hashes(prompt, 16, seed_text="0")
    # stored as two events, the second chained to the first by the engine's parent id
    assert index.block_stored("vllm", engine_ids[:3], None, prompt[:48], 16)
    assert index.block_stored("vllm", engine_ids[3:], engine_ids[2], prompt[48:128], 16)
    assert index.match(block_hashes(prompt, 16)).device == {"vllm": 8}
    other = prompt[:64] + [7] * 64  # same first 4 blocks, then different tokens
    assert index.match(block_hashes(other, 16)).device == {"vllm": 4}


def test_tiers_are_reported_separately_and_local_spans_device_and_host():
    index = HitIndex(BS)
    index.register("p")
    h = block_hashes(A, BS)
    e = salted(h, "i0")
    index.block_stored("p", e[:4], None, A[:16], BS, "GPU")
    index.block_stored("p", e[4:7], e[3], A[16:28], BS, "CPU")
    index.block_stored("p", e[:9], None, A[:36], BS, "EXTERNAL")
    m = index.match(h)
    assert (m.device, m.local, m.store) == ({"p": 4}, {"p": 7}, 9)
    assert index.cached_blocks("p") == {"device": 4, "host": 3, "store": 9}
    index.all_cleared("p")  # the engine's own memory is gone, the store keeps its copy
    m = index.match(h)
    assert (m.device, m.local, m.store) == ({}, {}, 9)
    # the store copy still names the chain: a device block chained to it is accepted
    assert index.block_stored("p", [e[0]], None, A[:4], BS, "GPU")
    index.drop_instance("p")  # a rebuild: the engine's own tiers go, its store copy does not
    assert index.match(h).store == 9 and index.cached_blocks("p") == {"device": 0, "host": 0, "store": 9}
    index.unregister("p")  # the instance leaves for good: everything it reported goes
    assert index.match(h).store == 0


def test_inconsistent_or_foreign_events_are_ignored_without_touching_the_index():
    index = HitIndex(BS)
    index.register("p")
    h = block_hashes(A, BS)
    e = salted(h, "i0")
    before = index.blocks()
    assert not index.block_stored("ghost", e[:2], None, A[:8], BS)  # unknown instance
    assert not index.block_stored("p", e[1:3], 12345, A[4:12], BS)  # parent never stored
    assert not index.block_stored("p", e[:2], None, A[:8], 8)  # block size differs
    assert not index.block_stored("p", e[:2], None, A[:7], BS)  # token count does not match
    assert not index.block_stored("p", e[:2], None, ["x"] * 8, BS)  # not token ids
    assert not index.block_stored("p", e[:2], None, A[:8], BS, "TAPE")  # unknown medium
    assert not index.block_stored("p", [e[0], [1]], None, A[:8], BS)  # engine ids must be integers
    assert not index.block_stored("p", e[:2], [1], A[:8], BS)  # so must the parent
    assert not index.block_stored("p", None, None, A[:8], BS)
    assert index.blocks() == before and index.match(h).device == {}
    assert not index.block_removed("ghost", e[:1])
    assert not index.block_removed("p", [424242])  # never stored: reported, harmless
    assert not index.block_removed("p", [[1]])  # unhashable id
    index.all_cleared("ghost")
    index.drop_instance("ghost")
    assert index.block_stored("p", e[:2], None, A[:8], BS, None)  # medium omitted means GPU
    assert index.match(h).device == {"p": 2}


def test_drop_and_rebuild_from_replay_restores_the_same_view():
    index = HitIndex(BS)
    for i in ("a", "b"):
        index.register(i)
    events = []
    for seq, inst in ((A, "a"), (B, "a"), (B, "b")):
        h = block_hashes(seq, BS)
        e = salted(h, "i0" if inst == "a" else "i1")
        events.append((inst, e, None, seq, BS))
        index.block_stored(inst, e, None, seq, BS)
    view = [index.match(block_hashes(s, BS)) for s in (A, B)]
    index.drop_instance("a")
    assert index.match(block_hashes(A, BS)).device == {"b": 3}  # b holds B, which shares A's first 3 blocks
    for ev in events:
        if ev[0] == "a":
            assert index.block_stored(*ev)
    assert [index.match(block_hashes(s, BS)) for s in (A, B)] == view


def test_memory_is_bounded_per_instance_and_reported():
    index = HitIndex(BS, max_blocks=12)
    index.register("p")
    idle = index.memory_bytes()
    h = block_hashes(A, BS)
    e = salted(h, "i0")
    assert index.block_stored("p", e[:10], None, A, BS)
    assert index.memory_bytes() > idle
    hb = block_hashes(C, BS)
    assert not index.block_stored("p", salted(hb, "i0")[:5], None, C[:20], BS)  # 10 + 5 > 12: refused
    assert index.overflows == 1 and index.cached_blocks("p")["device"] == 10
    assert index.block_stored("p", salted(hb, "i0")[:2], None, C[:8], BS)  # 12 fits
    index.drop_instance("p")
    assert index.blocks() == {"device": 0, "host": 0, "store": 0}
    assert index.memory_bytes() <= idle + 2048  # dict tables may keep their grown size


def test_slots_are_reused_and_unregistered_instances_vanish():
    index = HitIndex(BS)
    index.register("a")
    index.register("b")
    h = block_hashes(A, BS)
    index.block_stored("a", salted(h, "i0"), None, A, BS)
    index.block_stored("b", salted(h, "i1"), None, A, BS)
    assert index.unregister("a") and not index.unregister("a")
    assert index.match(h).device == {"b": 10}
    assert index.register("c")  # takes a's slot, starts empty
    assert index.match(h).device == {"b": 10}
    assert not index.register("b")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(INSTANCES), st.booleans(), st.integers(1, 120),
                          st.sampled_from(sorted(MEDIA))), max_size=12),
       st.lists(st.tuples(st.sampled_from(INSTANCES), st.integers(0, 199), st.sampled_from(sorted(MEDIA))),
                max_size=12),
       st.integers(0, 200))
def test_longest_prefix_on_long_chains_spanning_many_walk_chunks(stores, holes, limit):
    """200-block chains: runs that end in later chunks, holders moving between tiers, holes."""
    seq = list(range(1000, 1200))  # block size 1: block k is token k
    ours = block_hashes(seq, 1)
    index, held = HitIndex(1), {i: {"device": set(), "host": set(), "store": set()} for i in INSTANCES}
    ends = dict.fromkeys(INSTANCES, 0)
    for i in INSTANCES:
        index.register(i)
    for inst, extend, n, medium in stores:  # a run from block 0, or extending the instance's last run
        a = ends[inst] if extend else 0
        b = min(200, a + n)
        if a >= b:
            continue
        eng = salted(ours, inst)
        assert index.block_stored(inst, eng[a:b], eng[a - 1] if a else None, seq[a:b], 1, medium)
        held[inst][MEDIA[medium]].update(ours[a:b])
        ends[inst] = max(ends[inst], b)
    for inst, k, medium in holes:
        if index.block_removed(inst, [salted(ours, inst)[k]], medium):
            held[inst][MEDIA[medium]].discard(ours[k])
    _assert_match_is_the_reference(index, held, ours, limit)


def test_store_media_are_told_apart_from_host_memory_by_case():
    from scheduler.hit_index import tier_of
    # vLLM: GPU / CPU (offloading) / cpu (MooncakeStoreConnector, as the Mooncake master's events);
    # SGLang: GPU / CPU_PINNED / DISK / EXTERNAL
    assert [tier_of(m) for m in ("GPU", "CPU", "cpu", "disk", "CPU_PINNED", "EXTERNAL", "DISK", None)] == \
        [0, 1, 2, 2, 1, 2, 2, 0]
    assert tier_of("Cpu") == 1 and tier_of("TAPE") is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(INSTANCES), st.integers(0, 199), st.integers(1, 200),
                          st.sampled_from(["GPU", "CPU", "EXTERNAL"]), st.booleans()), max_size=16),
       st.integers(0, 200))
def test_longest_prefix_when_runs_move_between_device_and_host_in_any_order(segments, limit):
    """Device and host runs of one chain overlapping, starting and ending anywhere: the walk
    looks the second tier up only where a run in the first ends, and must still find each
    instance's exact device and local run (the host-only and mixed holders included)."""
    seq = list(range(3000, 3200))
    ours = block_hashes(seq, 1)
    index, held = HitIndex(1), {i: {"device": set(), "host": set(), "store": set()} for i in INSTANCES}
    for i in INSTANCES:
        index.register(i)
    for inst, a, n, medium, evict in segments:
        b = min(200, a + n)
        eng = salted(ours, inst)
        tier = held[inst][MEDIA[medium]]
        if evict:  # a removal of blocks [a, b) from that tier (partly unknown ones included)
            index.block_removed(inst, eng[a:b], medium)
            tier.difference_update(ours[a:b])
        elif a == 0 or any(ours[a - 1] in t for t in held[inst].values()):  # a store onto a known parent
            assert index.block_stored(inst, eng[a:b], eng[a - 1] if a else None, seq[a:b], 1, medium)
            tier.update(ours[a:b])
    _assert_match_is_the_reference(index, held, ours, limit)


def _assert_match_is_the_reference(index, held, ours, limit):
    """The index's longest runs equal those of the plain per-tier sets the test kept beside it."""
    m = index.match(ours, limit)

    def run(pred):
        n = 0
        while n < limit and pred(ours[n]):
            n += 1
        return n

    for i in INSTANCES:
        device, local = held[i]["device"], held[i]["device"] | held[i]["host"]
        assert m.device.get(i, 0) == run(device.__contains__)
        assert m.local.get(i, 0) == run(local.__contains__)
    assert m.store == run(lambda x: any(x in held[i]["store"] for i in INSTANCES))
