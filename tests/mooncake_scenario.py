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


if __name__ == "__main__":
    print("RESULT " + json.dumps(asyncio.run(main())), flush=True)
