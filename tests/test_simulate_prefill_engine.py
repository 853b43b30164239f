"""``ClusterSpec.prefill_engine``: engine settings for the prefill side only (the store
experiment shrinks the prefill engines' prefix cache and gives them a host tier without touching
the decode engines' KV pool)."""
from loadgen.simulate.cluster import ClusterSpec, SchedulerSpec, SimCluster
from loadgen.simulate.loop import EventLoop


def test_prefill_engine_settings_apply_to_prefill_capable_instances_only():
    spec = ClusterSpec(prefill=1, decode=1, both=1, profile="llama3-8b-h200", engine={"max_num_seqs": 64},
                       prefill_engine={"kv_capacity_tokens": 32768, "host_tier_tokens": 16384})
    c = SimCluster(spec, SchedulerSpec(), EventLoop())
    p, d, b = (c.instances[i].model for i in ("prefill-1", "decode-1", "both-1"))
    for m in (p, b):
        assert m.kv.capacity * spec.block_size == 32768
        assert m.kv.host_capacity * spec.block_size == 16384
    assert d.kv.capacity * spec.block_size > 32768  # the profile's whole pool
    assert d.kv.host_capacity == 0
    assert {m.max_num_seqs for m in (p, d, b)} == {64}  # ``engine`` still applies to every role
    # the scheduler is told each engine's own capacity, as the gateway reads it from /metrics
    rows = {r["id"]: r for r in c.scheduler.snapshot()["instances"]}
    assert rows["prefill-1"]["kv_capacity_tokens"] == 32768
    assert rows["decode-1"]["kv_capacity_tokens"] == d.kv.capacity * spec.block_size
