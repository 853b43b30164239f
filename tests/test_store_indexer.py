"""The Mooncake Conductor indexer API served from the gateway's hit index, against the documented
examples (Mooncake docs/source/api-reference/http/conductor-indexer.md)."""
from __future__ import annotations

import pytest
import zmq.asyncio
from starlette.applications import Starlette
from starlette.testclient import TestClient

from engines_adapters.net import free_port
from gateway.indexer import Indexer, rfc1527_seq_hashes
from scheduler.hashing import block_hashes
from scheduler.hit_index import HitIndex

BS = 4


class FakeCluster:
    """What the indexer reads of gateway.cluster.Cluster."""

    def __init__(self):
        self.scheduler = type("S", (), {})()
        self.scheduler.index = HitIndex(BS)
        self.engines = {"prefill-1": type("E", (), {"kv_events": None})(),
                        "prefill-2": type("E", (), {"kv_events": None})()}
        for e in self.engines:
            self.scheduler.index.register(e)
        self.store_tier = None
        self._zmq = zmq.asyncio.Context()
        self.watched = []

    def watch_subscriber(self, sub):
        self.watched.append(sub)

    def unwatch_subscriber(self, sub):
        self.watched.remove(sub)
        sub.close()


@pytest.fixture()
def api():
    cluster = FakeCluster()
    ix = Indexer(cluster, BS)
    app = Starlette()
    for path, fn in ix.routes():
        app.add_route(path, fn, methods=["POST"])
    with TestClient(app) as c:
        yield c, cluster, ix
    cluster._zmq.term()


def store_tokens(cluster, iid, tokens, medium="GPU"):
    h = block_hashes(tokens, BS)
    assert cluster.scheduler.index.block_stored(iid, list(range(1, len(h) + 1)), None, tokens[:len(h) * BS], BS, medium)


def test_rfc1527_worked_example():
    # docs/protocols.md, from RFC #1527: block size 4, tokens 1..9 (token 9 is a partial block)
    assert rfc1527_seq_hashes(list(range(1, 10)), 4) == [14643705804678351452, 4945711292740353085]


def test_query_answers_per_instance_and_medium_in_the_documented_shape(api):
    c, cluster, _ = api
    tokens = list(range(100, 120))  # 5 blocks
    store_tokens(cluster, "prefill-1", tokens[:12])  # 3 blocks on its GPU
    store_tokens(cluster, "prefill-2", tokens[:8], medium="CPU")  # 2 blocks in host memory
    r = c.post("/query", json={"model": "deepseek", "token_ids": tokens + [7], "block_size": BS})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"default"}
    p1, p2 = body["default"]["prefill-1"], body["default"]["prefill-2"]
    assert p1 == {"longest_matched": 12, "GPU": 12, "CPU": 12, "DISK": 0, "DP": {"0": 12}}
    assert p2 == {"longest_matched": 8, "GPU": 0, "CPU": 8, "DISK": 0, "DP": {"0": 8}}
    one = c.post("/query", json={"model": "m", "token_ids": tokens, "block_size": BS, "instance_id": "prefill-2"})
    assert list(one.json()["default"]) == ["prefill-2"]
    # namespaces the index does not track find nothing rather than a false hit
    assert c.post("/query", json={"model": "m", "token_ids": tokens, "block_size": BS,
                                  "lora_name": "sql-adapter"}).json() == {"default": {}}
    assert c.post("/query", json={"model": "m", "token_ids": tokens, "block_size": BS,
                                  "tenant_id": "acme"}).json() == {"acme": {}}


def test_query_by_hash_maps_rfc_hashes_of_prompts_seen(api):
    c, cluster, _ = api
    tokens = list(range(200, 216))
    store_tokens(cluster, "prefill-1", tokens)
    seq = rfc1527_seq_hashes(tokens, BS)
    assert c.post("/query_by_hash", json={"model": "m", "seq_hashes": seq, "block_size": BS}).json() == {
        "default": {"prefill-1": {"longest_matched": 0, "GPU": 0, "CPU": 0, "DISK": 0, "DP": {"0": 0}},
                    "prefill-2": {"longest_matched": 0, "GPU": 0, "CPU": 0, "DISK": 0, "DP": {"0": 0}}}}
    c.post("/query", json={"model": "m", "token_ids": tokens, "block_size": BS})  # the gateway sees the tokens
    r = c.post("/query_by_hash", json={"model": "m", "block_hash": seq[:3], "block_size": BS})  # the old alias
    assert r.json()["default"]["prefill-1"]["longest_matched"] == 3 * BS


@pytest.mark.parametrize("path, body, field", [
    ("/query", {"token_ids": [1, 2], "block_size": BS}, "model"),
    ("/query", {"model": "m", "token_ids": "1 2", "block_size": BS}, "token_ids"),
    ("/query", {"model": "m", "token_ids": [1, -2], "block_size": BS}, "token_ids"),
    ("/query", {"model": "m", "token_ids": [1]}, "block_size"),
    ("/query", {"model": "m", "token_ids": [1], "block_size": 64}, "block_size"),
    ("/query", {"model": "m", "token_ids": [1], "block_size": BS, "tenant_id": 3}, "tenant_id"),
    ("/query_by_hash", {"model": "m", "seq_hashes": [2**64], "block_size": BS}, "seq_hashes"),
    ("/register", {"type": "vLLM", "modelname": "m", "instance_id": "x", "block_size": BS, "dp_rank": 0},
     "endpoint"),
    ("/register", {"endpoint": "tcp://10.1.1.1:5557", "type": "vLLM", "modelname": "m", "instance_id": "x",
                   "block_size": BS, "dp_rank": 0}, "endpoint"),
    ("/register", {"endpoint": "tcp://127.0.0.1:5557", "type": "TRT", "modelname": "m", "instance_id": "x",
                   "block_size": BS, "dp_rank": 0}, "type"),
    ("/unregister", {"type": "vLLM", "modelname": "m", "instance_id": "x", "block_size": BS}, "dp_rank"),
])
def test_malformed_bodies_get_400_naming_the_field(api, path, body, field):
    c, _, _ = api
    r = c.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.json()
    assert c.post(path, content=b"{not json").status_code == 400


def test_register_subscribes_to_a_publisher_and_unregister_removes_it(api):
    c, cluster, _ = api
    port = free_port()
    body = {"endpoint": f"tcp://127.0.0.1:{port}", "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
            "type": "vLLM", "modelname": "deepseek", "lora_name": "sql-adapter", "tenant_id": "default",
            "instance_id": "vllm-prefill-node1", "block_size": BS, "dp_rank": 0, "additionalsalt": "w8a8"}
    r = c.post("/register", json=body)
    assert r.json() == {"status": "registered successfully", "instance_id": "vllm-prefill-node1"}
    assert "vllm-prefill-node1" in cluster.scheduler.index and len(cluster.watched) == 1
    assert c.post("/register", json=body).status_code == 409
    q = c.post("/query", json={"model": "m", "token_ids": list(range(8)), "block_size": BS}).json()
    assert "vllm-prefill-node1" in q["default"]
    r = c.post("/unregister", json={k: v for k, v in body.items() if k not in ("endpoint", "replay_endpoint")})
    assert r.json() == {"status": "unregistered successfully", "removed_instances": ["vllm-prefill-node1|default|0"]}
    assert "vllm-prefill-node1" not in cluster.scheduler.index and not cluster.watched


def test_blocks_an_engine_announced_in_the_store_medium_count_as_its_cpu_hits(api):
    """vLLM's MooncakeStoreConnector announces blocks it wrote to the store with medium ``cpu``
    (lower case; ``CPU`` is host memory): the instance's CPU answer covers its device prefix plus
    what it wrote to the store, GPU only the device; the shared store's entry shows them too."""
    c, cluster, _ = api
    tokens = list(range(200, 220))  # 5 blocks
    index = cluster.scheduler.index
    ids = list(range(1, 6))
    assert index.block_stored("prefill-1", ids[:2], None, tokens[:8], BS, "GPU")
    assert index.block_stored("prefill-1", ids, None, tokens, BS, "cpu")  # written through: all 5
    assert index.cached_blocks("prefill-1") == {"device": 2, "host": 0, "store": 5}
    body = c.post("/query", json={"model": "m", "token_ids": tokens + [1], "block_size": BS}).json()["default"]
    assert body["prefill-1"] == {"longest_matched": 20, "GPU": 8, "CPU": 20, "DISK": 0, "DP": {"0": 20}}
    assert "prefill-2" not in body or body["prefill-2"]["longest_matched"] == 0
    assert body["store"]["CPU"] == 20
    # the store evicted block 4 (the engine learned it): CPU stops before it, the device prefix stays
    assert index.block_removed("prefill-1", [4], "cpu")
    body = c.post("/query", json={"model": "m", "token_ids": tokens + [1], "block_size": BS}).json()["default"]
    assert body["prefill-1"]["GPU"] == 8 and body["prefill-1"]["CPU"] == 12
