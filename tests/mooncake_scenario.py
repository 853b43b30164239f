"""Run inside a private network namespace (loopback only) by tests/test_store_mooncake.py: a real
``mooncake_master`` and a real ``MooncakeDistributedStore`` client (whose transfer engine opens
wildcard listeners, hence the namespace), and the gateway's store tier in query mode reading the
real master's ``/batch_query_keys``. Prints one JSON line with what it saw; exits non-zero on failure."""
from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from engines_adapters.store.keys import KeyRecipe  # noqa: E402
from gateway.config import StoreConfig  # noqa: E402
from gateway.store_tier import StoreTier  # noqa: E402
from scheduler.hashing import block_hashes, vllm_block_digests  # noqa: E402

MODEL, BS, RPC, HTTP = "meta-llama/Meta-Llama-3-8B-Instruct", 16, 50051, 9003


def http(path: str) -> bytes:
    return urllib.request.urlopen(f"http://127.0.0.1:{HTTP}{path}", timeout=2).read()


async def main() -> dict:
    out: dict = {}
    master_bin = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    master = subprocess.Popen([master_bin, "--rpc_address=127.0.0.1", f"--rpc_port={RPC}",
                               "--metrics_host=127.0.0.1", f"--metrics_port={HTTP}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            try:
                out["health"] = json.loads(http("/health"))
                break
            except OSError:
                time.sleep(0.05)
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", f"127.0.0.1:{RPC}") == 0
        rng = random.Random(3)
        tokens = [rng.randrange(1000, 30000) for _ in range(20 * BS + 5)]
        recipe = KeyRecipe("vllm", MODEL, BS, seed_text="0")
        keys = [recipe.key(d) for d in vllm_block_digests(tokens, BS, seed_text="0")]
        for k in keys[:12]:  # the engine's write-through, payload scaled down to 64 bytes a block
            assert store.put(k, b"\0" * 64) == 0
        tier = StoreTier(StoreConfig(url=f"http://127.0.0.1:{HTTP}", model=MODEL, cache_ttl_s=0.0), BS, MODEL)
        out["tier_started"] = await tier.start()
        hashes = block_hashes(tokens, BS)
        out["held_after_put"] = await tier.lookup(tokens, hashes, 20)
        out["remove"] = store.remove(keys[5], True)
        out["held_after_remove"] = await tier.lookup(tokens, hashes, 20)
        batch = json.loads(http("/batch_query_keys?keys=" + keys[0] + ",nope"))
        out["batch_shape"] = sorted(batch["data"][keys[0]]) if batch.get("success") else batch
        out["batch_miss"] = batch["data"]["nope"]["error"]
        metrics = http("/metrics").decode().splitlines()
        out["key_count"] = next(float(x.split()[-1]) for x in metrics if x.startswith("master_key_count "))
        master.terminate()
        master.wait(10)
        out["check_after_stop"] = await tier.check()
        out["stale"] = tier.stale
        out["lookup_when_stale"] = await tier.lookup(tokens, hashes, 20)
        await tier.stop()
        store.close()
    finally:
        if master.poll() is None:
            master.kill()
            master.wait()
    return out


async def engines() -> dict:
    """Two sim engines on one real master (``--kv-store mooncake://``): prefill-1 computes a prompt
    and writes it through as real bytes; prefill-2 loads it instead of recomputing."""
    from gateway.mooncake_master import MooncakeMaster, find_master
    from tests.sim_helpers import SimEngineProcess, wait_until

    out: dict = {}
    master = MooncakeMaster(find_master())
    master.start()
    try:
        await master.wait_ready()
        url = "mooncake://" + master.rpc
        metric = lambda name: next(float(x.split()[-1]) for x in urllib.request.urlopen(  # noqa: E731
            master.http_url + "/metrics", timeout=2).read().decode().splitlines() if x.startswith(name + " "))
        with SimEngineProcess("--kv-store", url, "--noise", "0", role="prefill") as e1, \
                SimEngineProcess("--kv-store", url, "--noise", "0", role="prefill") as e2:
            body = {"model": "llama3-8b", "messages": [{"role": "user", "content": "a shared prefix " * 150}],
                    "max_tokens": 1}
            st, _, r1 = e1.post("/v1/chat/completions", body)
            assert st == 200, r1
            out["prompt_tokens"] = prompt = r1["usage"]["prompt_tokens"]
            out["first_cached"] = r1["usage"]["prompt_tokens_details"]["cached_tokens"]
            blocks = (prompt - 1) // BS
            wait_until(lambda: metric("master_key_count") >= blocks, timeout=20, what="the write-through")
            # the engine counts the bytes once put_batch has returned (after the master's PutEnd)
            wait_until(lambda: e1.metric('sim:store_payload_bytes_total{op="put"}') > 0, timeout=20,
                       what="the engine's put counters")
            out["key_count"] = metric("master_key_count")
            out["allocated_bytes"] = metric("master_allocated_bytes")
            out["e1_put_payload"] = e1.metric('sim:store_payload_bytes_total{op="put"}')
            out["e1_put_modelled"] = e1.metric('sim:store_modelled_bytes_total{op="put"}')
            st, _, r2 = e2.post("/v1/chat/completions", body)
            assert st == 200, r2
            out["second_cached"] = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
            out["kv_store"] = r2.get("kv_store")
            out["e2_store_hits"] = e2.metric("sim:store_hits_total")
            out["e2_load_s"] = e2.metric("sim:store_load_seconds_total")
            out["e2_get_modelled"] = e2.metric('sim:store_modelled_bytes_total{op="get"}')
            out["e2_get_payload"] = e2.metric('sim:store_payload_bytes_total{op="get"}')
            keys = set(urllib.request.urlopen(master.http_url + "/get_all_keys", timeout=2).read().decode().split())
            tok = e1.post("/tokenize", {"messages": body["messages"]})[2]["tokens"]
            recipe = KeyRecipe("vllm", MODEL, BS, seed_text="0")  # vLLM's MooncakeStoreConnector keys
            out["engine_keys_held"] = sum(recipe.key(d) in keys for d in vllm_block_digests(tok, BS, seed_text="0"))
            master.stop()  # the store goes away: the engines keep serving by recompute
            st, _, r3 = e2.post("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "x " * 300}]})
            out["after_master_stop"] = [st, r3.get("kv_store") if isinstance(r3, dict) else r3]
    finally:
        master.stop()
    return out


async def serve() -> dict:
    """``conductor serve`` with ``[store] kind = "mooncake"``, ``start_master = true``: it starts the
    master, its embedded prefill engines write real bytes there, its store tier reads them back
    through ``/batch_query_keys`` for the next decision; stopping serve stops the master."""
    import requests

    from tests.servers import gateway

    out: dict = {}
    # cache_ttl_s = 0: the second request comes within the 1 s a "not held" answer is trusted by default
    cfg = ('policy = "round_robin"\n[store]\nkind = "mooncake"\nstart_master = true\ncache_ttl_s = 0.0\n'
           "[embedded]\nprefill = 2\ndecode = 1\ntime_scale = 0.2\n")
    with gateway(cfg) as g:
        st = requests.get(g["url"] + "/admin/store").json()
        out["store"] = {k: st.get(k) for k in ("mode", "stale", "url")}
        out["master"] = master = st["master"]
        out["health"] = requests.get(master["http"] + "/health", timeout=2).json()
        model = requests.get(g["url"] + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "a long shared prompt about stores " * 120}],
                "max_tokens": 2}
        r1 = requests.post(g["url"] + "/v1/chat/completions", json=body, timeout=60)
        assert r1.status_code == 200, r1.text
        out["blocks"] = blocks = (r1.json()["usage"]["prompt_tokens"] - 1) // BS

        def sample(url: str, name: str) -> float:
            text = requests.get(url + "/metrics", timeout=2).text
            return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(name + " ")), 0.0)
        # the whole write-through: the master counts a key from its PutStart, /batch_query_keys only
        # once its PutEnd is in, and the engine counts the bytes after put_batch returns (after both)
        engine = next(i["url"] for i in requests.get(g["url"] + "/admin/cluster").json()["instances"]
                      if i["id"] == "prefill-1")
        deadline = time.monotonic() + 20
        while (sample(engine, 'sim:store_payload_bytes_total{op="put"}') < blocks * 64
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)
        out["key_count"] = sample(master["http"], "master_key_count")
        r2 = requests.post(g["url"] + "/v1/chat/completions", json=body, timeout=60)
        assert r2.status_code == 200, r2.text
        d1, d2 = requests.get(g["url"] + "/admin/decisions?limit=2").json()["decisions"]
        out["prefills"] = [d1["chosen"]["prefill"], d2["chosen"]["prefill"]]
        out["d2"] = {"store_hit_tokens": d2["store_hit_tokens"], "transfer_from": d2["terms"]["transfer_from"],
                     "store_load": d2.get("store_load")}
        st = requests.get(g["url"] + "/admin/store").json()
        out["tier_queries"], out["tier_resyncs"], out["tier_stale"] = st["queries"], st["resyncs"], st["stale"]
    try:
        os.kill(master["pid"], 0)
        out["master_alive_after_stop"] = True
    except ProcessLookupError:
        out["master_alive_after_stop"] = False
    try:
        urllib.request.urlopen(master["http"] + "/health", timeout=1)
        out["master_answers_after_stop"] = True
    except OSError:
        out["master_answers_after_stop"] = False
    return out


SCENARIOS = {"tier": main, "engines": engines, "serve": serve}

if __name__ == "__main__":
    from engines_adapters.store.mooncake import loopback_only, loopback_up

    loopback_up()  # a fresh namespace has loopback down, and nothing else
    assert loopback_only() is None, loopback_only()
    name = sys.argv[1] if len(sys.argv) > 1 else "tier"
    print("RESULT " + json.dumps(asyncio.run(SCENARIOS[name]())), flush=True)
