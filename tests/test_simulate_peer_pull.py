"""Peer pulls in the simulator (``ClusterSpec.peer_pull``): a prefill instance sent with a plan to
pull a prefix from another prefill instance loads what that instance still holds, beyond its own,
at the network bandwidth; off (the default, as the gateway) conductor plans none."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from engines_adapters.sim.model import SimRequest
from engines_adapters.sim.profiles import load_profile
from engines_adapters.store.model import StoreSpec
from loadgen.simulate.cluster import ClusterSpec, SchedulerSpec, SimCluster
from loadgen.simulate.loop import EventLoop
from scheduler.hashing import block_hashes
from tests.test_simulate import run

BS = 16


def cluster(peer_pull=True):
    loop = EventLoop()
    return SimCluster(ClusterSpec(prefill=2, decode=1, seed=3, noise=0.0, peer_pull=peer_pull), SchedulerSpec(),
                      loop), loop


def prefill_on(c, loop, iid, tokens, **load):
    """Compute ``tokens`` on ``iid`` (a whole one-token request, no decode leg): the prefix stays cached."""
    finished = []
    inst = c.instances[iid]
    step = inst.on_step
    inst.on_step = lambda i, res: finished.extend(res.finished) or step(i, res)
    inst.add(SimRequest(f"r-{iid}-{len(tokens)}", tokens, 1, output_len=1, block_hashes=block_hashes(tokens, BS),
                        **load))
    loop.run()
    inst.on_step = step
    return finished


def plan(source, blocks, dest="prefill-2"):
    return SimpleNamespace(prefill=dest, transfer_from=source, transfer_tokens=blocks * BS, hit_tokens=blocks * BS)


PREFIX = list(range(1000, 1000 + 48 * BS))
PROMPT = PREFIX + list(range(5000, 5000 + 16 * BS))


def test_a_planned_pull_loads_the_sources_blocks_beyond_the_pullers_own():
    c, loop = cluster()
    prefill_on(c, loop, "prefill-1", PREFIX)
    prefill_on(c, loop, "prefill-2", PREFIX[:16 * BS])  # the puller holds the first 16 blocks itself
    hashes = block_hashes(PROMPT, BS)
    load, pulled = c.peer_pull(plan("prefill-1", 48), hashes)
    assert pulled == 32 * BS and load["store_blocks"] == 48 and load["store_fetched"] == 32
    m, p = c.instances["prefill-2"].model, load_profile("llama3-8b-h200")
    assert load["store_load_s"] == pytest.approx(m.transfer_latency_s + 32 * BS * p.kv_bytes_per_token
                                                 / m.net_bytes_per_s)
    # a plan for more than the source holds brings only what it holds
    load, pulled = c.peer_pull(plan("prefill-1", 60), hashes)
    assert pulled == 32 * BS and load["store_blocks"] == 48
    # nothing beyond the puller's own prefix, a plan from the store, or the puller itself: no pull
    assert c.peer_pull(plan("prefill-2", 48, dest="prefill-1"), hashes) == ({}, 0)
    assert c.peer_pull(plan("store", 48), hashes) == ({}, 0)
    assert c.peer_pull(plan("prefill-2", 48), hashes) == ({}, 0)
    assert c.peer_pulled_tokens == 64 * BS


def test_the_engine_counts_the_pulled_blocks_as_cached_and_computes_the_rest():
    c, loop = cluster()
    prefill_on(c, loop, "prefill-1", PREFIX)
    hashes = block_hashes(PROMPT, BS)
    load, pulled = c.peer_pull(plan("prefill-1", 48), hashes)
    assert [f.cached_tokens for f in prefill_on(c, loop, "prefill-2", PROMPT, **load)] == [pulled] == [48 * BS]
    # and the pulled blocks are its own now: the same prompt again hits them on the device
    whole = (len(PROMPT) - 1) // BS * BS  # every complete block short of the last token
    assert [f.cached_tokens for f in prefill_on(c, loop, "prefill-2", PROMPT)] == [whole]


def test_off_no_pull_is_run_even_for_a_plan():
    c, loop = cluster(peer_pull=False)
    prefill_on(c, loop, "prefill-1", PREFIX)
    assert c.peer_pull(plan("prefill-1", 48), block_hashes(PROMPT, BS)) == ({}, 0)
    assert c.scheduler.policy.params.peer_pull is False  # conductor plans no pull from a peer


def test_peer_pulls_with_a_store_are_refused():
    with pytest.raises(ValueError, match="peer pulls with a shared store"):
        SimCluster(ClusterSpec(prefill=1, decode=1, peer_pull=True, store=StoreSpec(nodes=2)), SchedulerSpec(),
                   EventLoop())


def test_conductor_pulls_from_a_busy_holder_in_a_run_and_records_it():
    # conversations sharing their prefixes at a rate one instance cannot absorb: the holder queues,
    # and the other instance pulls the prefix instead of recomputing it
    kw = dict(n=120, rate=40.0, cluster=ClusterSpec(prefill=2, decode=2, seed=3, peer_pull=True))
    on = run(**kw)
    pulled = [x for x in on.records if x.extra.get("peer_pulled_tokens")]
    assert pulled, "no request pulled a prefix from a peer"
    for x in pulled:  # pulled where the plan said, from another prefill instance, no more than planned
        assert x.transfer_from.startswith("prefill-") and x.transfer_from != x.prefill_instance
        assert 0 < x.extra["peer_pulled_tokens"] <= x.transfer_tokens
        assert x.cached_tokens >= x.extra["peer_pulled_tokens"]
    off = run(**{**kw, "cluster": ClusterSpec(prefill=2, decode=2, seed=3)})
    assert not any(x.transfer_from not in (None, "store") for x in off.records)
    assert not any("peer_pulled_tokens" in x.extra for x in off.records)
