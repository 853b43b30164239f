"""The gateway's store tier: follows store puts and evictions (events and query modes), drops to
stale when the store goes and resyncs when it is back; the embedded cluster loads a prefix from
the store on another prefill instance and says so in /admin/decisions."""
from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time

import pytest
import requests

from engines_adapters.net import free_port
from engines_adapters.store.keys import KeyRecipe
from gateway.config import StoreConfig
from gateway.store_tier import StoreTier
from scheduler.hashing import block_hashes, vllm_block_digests
from tests.servers import ROOT, conductor, gateway, stop, wait_until

MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
BS = 16


def start_store(port: int, events: int | None = None, *extra: str) -> subprocess.Popen:
    args = ["sim-store", "--port", str(port), *extra]
    if events:
        args += ["--kv-events", f"tcp://127.0.0.1:{events}"]
    p = conductor(*args)
    wait_until(f"http://127.0.0.1:{port}/health", p)
    return p


def prompt_keys(n_blocks: int, seed: int = 1):
    rng = random.Random(seed)
    tokens = [rng.randrange(1000, 30000) for _ in range(n_blocks * BS + 1)]
    recipe = KeyRecipe("vllm", MODEL, BS, seed_text="0")
    keys = [recipe.key(d) for d in vllm_block_digests(tokens, BS, seed_text="0")]
    return tokens, block_hashes(tokens, BS), keys


async def _wait(cond, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        if await cond():
            return True
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def _subscribed(tier: StoreTier, url: str) -> None:
    """Events mode: a PUB drops what it sends before a subscriber's connection is up (ZeroMQ's
    slow joiner), so put probe objects until the tier hears one, then remove them again."""
    if tier.mode != "events":
        return
    for i in range(200):  # bounded: ~10 s
        await tier.client.put(prompt_keys(1, seed=1000 + i)[2], [1000])
        await asyncio.sleep(0.05)
        if tier.events:
            break
    else:
        raise AssertionError("the tier never heard the store's events")
    requests.post(url + "/api/v1/remove_all", timeout=5)

    async def cleared():
        return not tier.resident
    await _wait(cleared)


@pytest.mark.parametrize("mode", ["events", "query"])
def test_the_tier_follows_puts_and_removals_and_survives_an_outage(mode):
    port, events = free_port(), free_port()
    proc = start_store(port, events if mode == "events" else None)
    url = f"http://127.0.0.1:{port}"

    async def run():
        nonlocal proc
        cfg = StoreConfig(url=url, kv_events=f"tcp://127.0.0.1:{events}" if mode == "events" else None,
                          model=MODEL, cache_ttl_s=0.0)
        tier = StoreTier(cfg, BS, MODEL)
        assert await tier.start() and not tier.stale and tier.mode == mode
        tokens, hashes, keys = prompt_keys(20)
        assert await tier.lookup(tokens, hashes, 20) == 0
        await _subscribed(tier, url)
        await tier.client.put(keys[:12], [1000] * 12)

        async def holds(n):
            return await tier.lookup(tokens, hashes, 20) == n
        await _wait(lambda: holds(12))
        assert await tier.lookup(tokens, hashes, 5) == 5  # never beyond the usable blocks
        r = requests.post(url + "/api/v1/remove_all", timeout=5).json()
        assert r["removed_count"] == 12
        await _wait(lambda: holds(0))
        # the store goes away: the tier is dropped and stale, lookups answer None
        stop(proc)
        assert not await tier.check() and tier.stale
        assert await tier.lookup(tokens, hashes, 20) is None
        # it comes back (a fresh store) with blocks put meanwhile: resync
        proc = start_store(port, events if mode == "events" else None)
        await tier.client.put(keys[:7], [1000] * 7)
        await _wait(tier.check)
        assert not tier.stale and tier.resyncs >= 2
        await _wait(lambda: holds(7))
        await tier.stop()

    try:
        asyncio.run(run())
    finally:
        stop(proc)


def test_unreachable_explicit_store_at_serve_exits_2_naming_the_url(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[store]\nurl = "{url}"\n')
    p = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg), "--port", str(free_port())],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and url in p.stderr and len(p.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_embedded_store_lets_a_second_prefill_instance_load_the_prefix():
    cfg = "policy = \"round_robin\"\n[embedded]\nprefill = 2\ndecode = 1\ntime_scale = 0.2\n"
    with gateway(cfg) as g:
        store = requests.get(g["url"] + "/admin/store").json()
        assert store["mode"] == "events" and store["stale"] is False
        model = requests.get(g["url"] + "/v1/models").json()["data"][0]["id"]
        text = "a long shared system prompt about KV stores " * 120
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
        r1 = requests.post(g["url"] + "/v1/chat/completions", json=body, timeout=60)
        assert r1.status_code == 200
        first = r1.headers["x-conductor-prefill"] if "x-conductor-prefill" in r1.headers else None

        def stored():
            return requests.get(g["url"] + "/admin/store").json()["resident_blocks"] > 50
        for _ in range(200):
            if stored():
                break
            time.sleep(0.05)
        assert stored()
        r2 = requests.post(g["url"] + "/v1/chat/completions", json=body, timeout=60)
        assert r2.status_code == 200
        decisions = requests.get(g["url"] + "/admin/decisions?limit=2").json()["decisions"]
        d1, d2 = decisions
        assert d1["chosen"]["prefill"] != d2["chosen"]["prefill"]  # round robin: the other instance
        assert first is None or first == d1["chosen"]["prefill"]
        assert d2["store_hit_tokens"] > 1000 and d2["terms"]["transfer_from"] == "store"
        assert d2["store_load"]["tokens"] > 1000 and "from the store in" in d2["store_load"]["note"]
        # the indexer API answers from the same index: both prefill instances and the store hold the prefix
        engine = requests.get(g["url"] + "/admin/cluster").json()["instances"][0]["url"]
        tokens = requests.post(engine + "/tokenize", json={"messages": body["messages"]}).json()["tokens"]
        q = requests.post(g["url"] + "/query", json={"model": model, "token_ids": tokens, "block_size": 16}).json()
        hits = q["default"]
        assert hits[d1["chosen"]["prefill"]]["GPU"] >= d2["store_hit_tokens"]
        assert hits["store"]["CPU"] == d2["store_hit_tokens"]


@pytest.mark.parametrize("section, needle", [
    ('url = "127.0.0.1:9003"', "store: url must be http"),
    ('url = "http://127.0.0.1:9003"\nkey_recipe = "lmcache"', "key_recipe"),
    ('url = "http://127.0.0.1:9003"\nkv_events = "ipc:///x"', "kv_events"),
    ('url = "http://127.0.0.1:9003"\nbogus = 1', "unknown key(s) bogus"),
    ('url = "http://127.0.0.1:9003"\ncache_ttl_s = -1', "cache_ttl_s"),
])
def test_bad_store_sections_are_named(section, needle):
    import tomllib

    from gateway.config import ConfigError, parse_config
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse_config(tomllib.loads("[store]\n" + section + "\n"))


def test_a_store_with_configured_engines_needs_the_model_name():
    import tomllib

    from gateway.config import ConfigError, parse_config
    eng = '[[engines]]\nid = "p"\nrole = "both"\nurl = "http://127.0.0.1:1"\n'
    with pytest.raises(ConfigError, match="store: model is required"):
        parse_config(tomllib.loads('[store]\nurl = "http://127.0.0.1:9003"\n' + eng))
    cfg = parse_config(tomllib.loads('[store]\nurl = "http://127.0.0.1:9003"\nmodel = "m"\n' + eng))
    assert cfg.store is not None and cfg.store.model == "m" and cfg.store.kv_events is None


@pytest.mark.parametrize("mode", ["events", "query"])
def test_salted_and_lora_lookups_find_their_own_namespaces_objects_only(mode):
    """The gateway looks a salted or LoRA request up under its namespace's keys (vLLM's extra
    keys in the digests): one tenant's objects are found by its repeat, never by another tenant
    or the base namespace."""
    from scheduler.hashing import namespace_parent
    port, events = free_port(), free_port()
    proc = start_store(port, events if mode == "events" else None)

    async def run():
        cfg = StoreConfig(url=f"http://127.0.0.1:{port}", model=MODEL, cache_ttl_s=0.0,
                          kv_events=f"tcp://127.0.0.1:{events}" if mode == "events" else None)
        tier = StoreTier(cfg, BS, MODEL)
        assert await tier.start()
        tokens, base_hashes, _ = prompt_keys(20)
        recipe = KeyRecipe("vllm", MODEL, BS, seed_text="0")
        a_keys = [recipe.key(d) for d in vllm_block_digests(tokens, BS, seed_text="0", cache_salt="tenant-a")]
        await _subscribed(tier, f"http://127.0.0.1:{port}")
        await tier.client.put(a_keys[:12], [1000] * 12)

        def chain(salt=None, lora=None):
            return block_hashes(tokens, BS, parent=namespace_parent(salt, lora))

        async def found(salt=None, lora=None):
            ns = (salt, lora) if salt or lora else None
            return await tier.lookup(tokens, chain(salt, lora), 20, ns)
        await _wait(lambda: _eq(found("tenant-a"), 12))
        assert await found("tenant-b") == 0 and await found() == 0 and await found(None, "sql") == 0
        lora_keys = [recipe.key(d) for d in vllm_block_digests(tokens, BS, seed_text="0", lora_name="sql")]
        await tier.client.put(lora_keys[:9], [1000] * 9)
        await _wait(lambda: _eq(found(None, "sql"), 9))
        assert await found("tenant-a") == 12 and await found() == 0
        await tier.stop()

    try:
        asyncio.run(run())
    finally:
        stop(proc)


async def _eq(aw, want) -> bool:
    return await aw == want


def test_a_next_turn_finds_the_mapped_prefix_and_a_removal_since_cuts_it():
    """Events mode without a process: the resident set is fed as the master's events would."""
    from engines_adapters.store.events import StoreEvent
    tier = StoreTier(StoreConfig(url="http://127.0.0.1:1", kv_events="tcp://127.0.0.1:1", model=MODEL), BS, MODEL)
    tier.stale = False
    tokens, hashes, keys = prompt_keys(60)
    turn1 = tokens[:40 * BS + 1]

    async def run():
        tier.apply([StoreEvent("stored", k, "cpu", []) for k in keys[:40]])
        assert await tier.lookup(turn1, hashes[:40], 40) == 40
        await asyncio.sleep(0)  # the deferred bookkeeping
        tier.apply([StoreEvent("stored", k, "cpu", []) for k in keys[40:]])
        assert await tier.lookup(tokens, hashes, 59) == 59 and len(tier._held) == 40  # (59 once remembered)
        await asyncio.sleep(0)
        tier.apply([StoreEvent("removed", keys[17], "cpu", [])])
        assert await tier.lookup(tokens, hashes, 59) == 17 and len(tier._held) == 17
        await asyncio.sleep(0)
        tier.apply([StoreEvent("stored", keys[17], "cpu", [])])  # back: the walk goes on past the cut
        assert await tier.lookup(tokens, hashes, 59) == 59
    asyncio.run(run())


def test_blocks_written_for_prompts_never_looked_up_are_still_found():
    """A lookup skips hashing blocks its digest memo does not know only while every resident
    block is known to it: a block another router's engine wrote (a "foreign" one) is hashed and
    found; once the store forgets it, new prompts cost no hashing again."""
    from engines_adapters.store.events import StoreEvent
    tier = StoreTier(StoreConfig(url="http://127.0.0.1:1", kv_events="tcp://127.0.0.1:1", model=MODEL), BS, MODEL)
    tier.stale = False
    seen, seen_hashes, seen_keys = prompt_keys(30, seed=1)
    other, other_hashes, other_keys = prompt_keys(30, seed=2)

    async def run():
        assert await tier.lookup(seen, seen_hashes, 30) == 0
        await asyncio.sleep(0)  # its digests are remembered: its write-through is known
        tier.apply([StoreEvent("stored", k, "cpu", []) for k in seen_keys])
        assert not tier._foreign and len(tier._held) == 30  # mapped as the events came
        before = tier.book.hashed
        novel, novel_hashes, _ = prompt_keys(30, seed=3)
        assert await tier.lookup(novel, novel_hashes, 30) == 0 and tier.book.hashed == before  # no SHA
        await asyncio.sleep(0)
        tier.apply([StoreEvent("stored", k, "cpu", []) for k in other_keys[:20]])  # never looked up
        assert len(tier._foreign) == 20
        assert await tier.lookup(other, other_hashes, 30) == 20  # hashed and found
        assert await tier.lookup(seen, seen_hashes, 30) == 30
        await asyncio.sleep(0)
        assert not tier._foreign  # the lookup taught the memo their digests
        tier.apply([StoreEvent("removed", k, "cpu", []) for k in other_keys[:20]])
        before = tier.book.hashed
        assert await tier.lookup(*prompt_keys(30, seed=4)[:2], 30) == 0 and tier.book.hashed == before
    asyncio.run(run())


def test_the_embedded_engines_store_write_policy_is_checked():
    import tomllib

    from gateway.config import ConfigError, parse_config
    assert parse_config(tomllib.loads('[embedded]\nstore_write = "back"\n')).embedded.store_write == "back"
    assert parse_config(tomllib.loads("")).embedded.store_write == "through"
    with pytest.raises(ConfigError, match="store_write must be 'through' or 'back'"):
        parse_config(tomllib.loads('[embedded]\nstore_write = "sideways"\n'))


def test_a_full_digest_memo_keeps_resident_blocks_digests():
    from engines_adapters.store.events import StoreEvent
    tier = StoreTier(StoreConfig(url="http://127.0.0.1:1", kv_events="tcp://127.0.0.1:1", model=MODEL), BS, MODEL)
    tier.stale = False
    tier.book.max_entries = 40
    tokens, hashes, keys = prompt_keys(30, seed=1)

    async def run():
        await tier.lookup(tokens, hashes, 30)
        await asyncio.sleep(0)
        tier.apply([StoreEvent("stored", k, "cpu", []) for k in keys[:20]])
        for seed in (5, 6, 7):  # other prompts' digests push the memo past its bound
            t, h, _ = prompt_keys(30, seed=seed)
            await tier.lookup(t, h, 30)
            await asyncio.sleep(0)
        memo = set(tier.book._memo.values())
        assert len(tier.book._memo) == 40 and tier.resident <= memo and not tier._foreign
    asyncio.run(run())
