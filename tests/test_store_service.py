"""``conductor sim-store`` over HTTP: the master's shapes, the engines' data path, KV events, and
two live sim engines sharing a prefix through it."""
from __future__ import annotations

import pytest
import zmq

from engines_adapters.net import free_port
from engines_adapters.store.events import decode_payload
from engines_adapters.store.keys import KeyRecipe
from scheduler.hashing import vllm_block_digests
from tests.sim_helpers import HASH_SEED, SimEngineProcess, SimStoreProcess, run_cli, wait_until


def test_the_masters_router_facing_http_shapes():
    with SimStoreProcess("--dram-gb", "0.001") as s:
        assert s.get("/health")[2] == {"status": "ok", "role": "leader", "ha_state": "serving",
                                       "service_ready": True, "leader_address": None, "view_version": None}
        st, _, r = s.post("/api/put", {"keys": ["k1", "k2"], "sizes": [11, 100]})
        assert st == 200 and r["stored"] == 2
        wait_until(lambda: s.get("/query_key?key=k1")[0] == 200, what="the put to land")
        st, _, q = s.get("/query_key?key=k1")
        assert q["success"] is True and q["data"][0]["size_"] == 11 and "transport_endpoint_" in q["data"][0]
        st, _, q = s.get("/query_key?key=nope")
        assert st == 404 and q == {"success": False, "error_code": -704, "error_message": "OBJECT_NOT_FOUND"}
        st, _, b = s.get("/batch_query_keys?keys=k1,nope")
        assert b["success"] is True and b["data"]["k1"]["ok"] is True and b["data"]["nope"]["ok"] is False
        assert b["data"]["nope"]["error"] == "OBJECT_NOT_FOUND" and b["data"]["nope"]["values"] is None
        assert s.get("/batch_query_keys")[0] == 400
        assert s.metric("master_key_count") == 2 and s.metric("master_allocated_bytes") == 111
        assert s.metric("master_put_start_requests_total") == 2
        # bad input: too large for the store, malformed bodies
        st, _, r = s.post("/api/put", {"keys": ["huge"], "sizes": [10**9]})
        assert st == 200 and "larger than a store node" in r["failed"]["huge"]
        assert s.post("/api/put", {"keys": ["x"], "sizes": []})[0] == 400
        assert s.post("/api/get", {"keys": "x"})[0] == 400
        assert s.post("/api/v1/remove_all")[2] == {"removed_count": 2}


def test_kv_events_in_the_masters_format():
    ep = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 200)
    try:
        with SimStoreProcess("--kv-events", ep) as s:
            sub.connect(ep)

            def got():
                s.post("/api/put", {"keys": [f"k{got.n}"], "sizes": [10]})  # until the subscription is up
                got.n += 1
                try:
                    return sub.recv_multipart()
                except zmq.Again:
                    return None
            got.n = 0
            topic, seq, payload = wait_until(got, what="a KV event")
            assert topic == b"" and int.from_bytes(seq, "big") >= 1
            ev = decode_payload(payload)
            assert ev[0].kind == "stored" and ev[0].key.startswith("k") and ev[0].medium == "cpu"
            assert s.get("/kv_events/status")[2]["enabled"] is True
    finally:
        sub.close()
        ctx.term()


def test_bad_arguments_exit_2_in_one_line():
    p = run_cli("--help")
    assert p.returncode == 0
    import subprocess

    from tests.sim_helpers import CONDUCTOR, ROOT, _env
    r = subprocess.run([*CONDUCTOR, "sim-store", "--port", "0", "--host", "10.0.0.1"], cwd=ROOT,
                       capture_output=True, text=True, timeout=20, env=_env())
    assert r.returncode == 2 and "loopback" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_an_unreachable_explicit_store_stops_the_engine_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    p = run_cli("--role", "prefill", "--port", "0", "--kv-store", url)
    assert p.returncode == 2 and url in p.stderr
    with SimEngineProcess("--kv-store", url, "--kv-store-optional", role="prefill") as e:  # optional: runs
        assert e.get("/health")[0] == 200


@pytest.mark.slow
def test_two_live_engines_share_a_prefix_through_the_store():
    with SimStoreProcess() as store:
        with SimEngineProcess("--kv-store", store.url, "--noise", "0") as e1, \
                SimEngineProcess("--kv-store", store.url, "--noise", "0") as e2:
            text = "the same long system prompt " * 200
            body = {"model": "llama3-8b", "messages": [{"role": "user", "content": text}], "max_tokens": 1}
            st, h1, r1 = e1.post("/v1/chat/completions", body)
            assert st == 200, r1
            prompt_tokens = r1["usage"]["prompt_tokens"]
            wait_until(lambda: store.metric("master_key_count") >= prompt_tokens // 16, what="the write-through")
            st, h2, r2 = e2.post("/v1/chat/completions", body)
            cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == (prompt_tokens - 1) // 16 * 16  # everything but the last token's block
            assert r2["kv_store"]["loaded_tokens"] == cached and r2["kv_store"]["load_s"] > 0
            assert e2.metric("sim:store_hits_total") == cached
            # the keys are vLLM's MooncakeStoreConnector keys for these tokens
            keys = store.get("/get_all_keys")[2].split()
            tok = e1.post("/tokenize", {"messages": body["messages"]})[2]["tokens"]
            recipe = KeyRecipe("vllm", "meta-llama/Meta-Llama-3-8B-Instruct", 16, seed_text=HASH_SEED)
            assert recipe.key(vllm_block_digests(tok, 16, seed_text=HASH_SEED)[0]) in keys


@pytest.mark.slow
def test_live_write_back_salted_keys_and_store_medium_events():
    """Two live engines on one sim-store. prefill-1 writes back: nothing reaches the store until
    its device evicts the prompt, which prefill-2 then loads; its KV events (on the wire) mark the
    written blocks ``medium: "cpu"`` (vLLM's MooncakeStoreConnector). A salted prompt is written
    under its tenant's keys: the same tenant hits on prefill-2, another tenant does not."""
    from engines_adapters.kv_wire import decode_batch
    port = free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    bs, n = 16, 150
    a = [1 + (i * 7) % 251 for i in range(n * bs)]
    b = [2 + (i * 13) % 241 for i in range(n * bs)]

    def complete(e, tokens, **extra):
        st, _, r = e.post("/v1/completions", {"model": "llama3-8b", "prompt": tokens, "max_tokens": 1, **extra})
        assert st == 200, r
        return r

    try:
        with SimStoreProcess() as store, \
                SimEngineProcess("--kv-store", store.url, "--kv-store-write", "back", "--kv-capacity-tokens",
                                 str(200 * bs), "--noise", "0", "--kv-events", f"tcp://*:{port}",
                                 role="prefill") as e1, \
                SimEngineProcess("--kv-store", store.url, "--noise", "0", role="prefill") as e2:
            complete(e1, a)
            complete(e1, a[:bs * 3])  # a later request on the same engine: still nothing put
            assert store.metric("master_put_start_requests_total") == 0 and store.metric("master_key_count") == 0
            complete(e1, b)  # needs the room: a's blocks are evicted and written back
            wait_until(lambda: store.metric("master_key_count") > 0, what="the write-back")
            stored: set[int] = set()
            while sub.poll(2000):
                _, _, payload = sub.recv_multipart()
                for ev in decode_batch(payload)[1]:
                    if type(ev).__name__ == "BlockStored" and ev.medium == "cpu":
                        stored.update(ev.block_hashes)
                if len(stored) >= store.metric("master_key_count"):
                    break
            assert len(stored) == store.metric("master_key_count")
            # prefill-2 computes a's head itself; the tail prefill-1 evicted comes from the store
            keys = int(store.metric("master_key_count"))
            complete(e2, a[:(n - keys) * bs])
            r = complete(e2, a)
            assert r["kv_store"]["loaded_tokens"] >= (keys - 2) * bs and r["kv_store"]["load_s"] > 0
            # salted: written through by prefill-2 under tenant-a's keys
            before = store.metric("master_key_count")
            complete(e2, b, cache_salt="tenant-a")
            wait_until(lambda: store.metric("master_key_count") >= before + n, what="the salted write-through")
            other = complete(e1, b, cache_salt="tenant-b")
            same = complete(e1, b, cache_salt="tenant-a")
            assert "kv_store" not in other
            assert same["kv_store"]["loaded_tokens"] == (n * bs - 1) // bs * bs
    finally:
        sub.close(0)
        ctx.term()
