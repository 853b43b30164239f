"""KV cache events from a sim-engine process, read with plain ZMQ and the independent ``msgpack``
package, checked against the engine's own /tokenize output and vLLM's sha256 block-hash recipe."""
from __future__ import annotations

import msgpack
import pytest
import zmq

from engines_adapters.net import free_port
from scheduler.hashing import vllm_block_hashes
from tests.sim_helpers import HASH_SEED, SimEngineProcess, wait_until

# starts real servers or subprocesses: `make test-fast` skips these
pytestmark = pytest.mark.slow

BS = 16
TOPIC = b"kv@sim@llama3-8b"


class Subscriber:
    """Binds a SUB socket (the engine connects: vLLM's rule for tcp://127.0.0.1:PORT)."""

    def __init__(self, ctx: zmq.Context):
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.messages: list[tuple[bytes, int, bytes]] = []

    def drain(self) -> list:
        while self.sock.poll(50):
            frames = self.sock.recv_multipart()
            assert len(frames) == 3, "a KV event message has three frames"
            self.messages.append((frames[0], int.from_bytes(frames[1], "big"), frames[2]))
        return self.messages

    def events(self) -> list[dict]:
        out = []
        for _, _, payload in self.drain():
            ts, events, dp = msgpack.unpackb(payload)
            assert isinstance(ts, float) and dp == 0
            out.extend(events)
        return out


@pytest.fixture(scope="module")
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture(scope="module")
def setup(ctx):
    sub = Subscriber(ctx)
    replay_port = free_port()
    with SimEngineProcess("--kv-events", f"tcp://127.0.0.1:{sub.port}", "--kv-events-topic", TOPIC.decode(),
                          "--kv-events-replay", f"tcp://127.0.0.1:{replay_port}", "--kv-capacity-tokens", "640",
                          "--host-tier-tokens", "4096", "--noise", "0", time_scale=0.05) as engine:
        # a warm-up request until events flow: the PUB connects after start (ZMQ slow joiner)
        attempt = iter(range(10**6))

        def flowing():  # a fresh prompt each time: a cached one would store no new blocks
            engine.post("/v1/completions", {"prompt": f"warm-up {next(attempt)} of the event stream", "max_tokens": 1})
            return sub.drain()
        wait_until(flowing, timeout=15, what="KV events to arrive")
        yield engine, sub, replay_port
    sub.sock.close()


def stored(events, medium="GPU"):
    return [e for e in events if e["type"] == "BlockStored" and e["medium"] == medium]


def test_block_stored_matches_tokenize_and_vllm_hashes(setup):
    engine, sub, _ = setup
    sub.drain()
    n0 = len(sub.messages)
    messages = [{"role": "user", "content": "Events must name the very blocks /tokenize describes. " * 3}]
    tokens = engine.post("/tokenize", {"messages": messages})[2]["tokens"]
    assert len(tokens) % BS != 0 and len(tokens) > 5 * BS
    engine.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    wait_until(lambda: stored([e for _, _, p in sub.drain()[n0:] for e in msgpack.unpackb(p)[1]]),
               what="BlockStored for the prompt")
    new = [e for _, _, p in sub.messages[n0:] for e in msgpack.unpackb(p)[1]]
    ev = stored(new)
    full = len(tokens) // BS
    assert set(ev[0]) == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                          "medium", "lora_name", "extra_keys", "group_idx"}
    # as vLLM's BlockPool: one extra-keys entry per block (none for an unsalted base-model request), group 0
    assert all(e["extra_keys"] == [None] * len(e["block_hashes"]) and e["group_idx"] == 0 for e in ev)
    assert [h for e in ev for h in e["block_hashes"]] == vllm_block_hashes(tokens, BS, seed_text=HASH_SEED)
    assert [t for e in ev for t in e["token_ids"]] == tokens[: full * BS]
    assert all(e["block_size"] == BS and e["lora_id"] is None and e["lora_name"] is None for e in ev)
    assert ev[0]["parent_block_hash"] is None
    chain = [h for e in ev for h in e["block_hashes"]]
    assert all(e["parent_block_hash"] == chain[chain.index(e["block_hashes"][0]) - 1] for e in ev[1:])


def test_frames_topic_and_sequence(setup):
    _, sub, _ = setup
    msgs = sub.drain()
    assert all(topic == TOPIC for topic, _, _ in msgs)
    seqs = [s for _, s, _ in msgs]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # per-publisher, contiguous


def test_extension_chains_to_cached_prefix(setup):
    engine, sub, _ = setup
    base = "Conversation turn one, long enough to fill some blocks. " * 2
    t1 = engine.post("/tokenize", {"prompt": base})[2]["tokens"]
    engine.post("/v1/completions", {"prompt": base, "max_tokens": 1})
    n0 = len(sub.drain())
    _, _, body = engine.post("/v1/completions", {"prompt": base + "And turn two adds more text here.", "max_tokens": 1})
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(t1) // BS * BS
    wait_until(lambda: stored([e for _, _, p in sub.drain()[n0:] for e in msgpack.unpackb(p)[1]]),
               what="BlockStored for the extension")
    ev = stored([e for _, _, p in sub.messages[n0:] for e in msgpack.unpackb(p)[1]])
    assert ev[0]["parent_block_hash"] == vllm_block_hashes(t1, BS, seed_text=HASH_SEED)[-1]


def test_eviction_offloads_to_host_tier_and_reload(setup):
    engine, sub, _ = setup
    first = "First document that will be evicted to host memory. " * 6
    engine.post("/v1/completions", {"prompt": first, "max_tokens": 1})
    hashes = vllm_block_hashes(engine.post("/tokenize", {"prompt": first})[2]["tokens"], BS, seed_text=HASH_SEED)
    n0 = len(sub.drain())
    for i in range(3):  # 40 GPU blocks: three other 20-block prompts push the first one out
        engine.post("/v1/completions", {"prompt": f"Other document {i}. " * 18, "max_tokens": 1})
    wait_until(lambda: set(hashes) <= {h for _, _, p in sub.drain()[n0:] for e in msgpack.unpackb(p)[1]
                                       if e["type"] == "BlockRemoved" and e["medium"] == "GPU"
                                       for h in e["block_hashes"]},
               what="the first document's blocks to leave the GPU")
    ev = [e for _, _, p in sub.messages[n0:] for e in msgpack.unpackb(p)[1]]
    assert set(hashes) <= {h for e in stored(ev, "CPU") for h in e["block_hashes"]}
    removed = [e for e in ev if e["type"] == "BlockRemoved"]
    assert removed and all(len(e["block_hashes"]) == 1 and e["group_idx"] == 0 for e in removed)  # one per hash
    n1 = len(sub.messages)
    _, headers, body = engine.post("/v1/completions", {"prompt": first, "max_tokens": 1})
    n = body["usage"]["prompt_tokens"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == min(len(hashes), (n - 1) // BS) * BS
    assert float(headers["x-sim-transfer-ms"]) > 0  # reloaded at the host bandwidth
    wait_until(lambda: set(hashes) <= {h for _, _, p in sub.drain()[n1:] for e in stored(msgpack.unpackb(p)[1])
                                       for h in e["block_hashes"]}, what="the reloaded blocks back on the GPU")


def test_replay_returns_buffered_batches_and_end_marker(setup, ctx):
    _, sub, replay_port = setup
    live = {seq: payload for _, seq, payload in sub.drain()}
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        for start in (0, max(live) - 2):
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            got = {}
            for _ in range(100_000):
                assert dealer.poll(5000), "replay did not answer"
                frames = dealer.recv_multipart()
                if frames[2] == (-1).to_bytes(8, "big", signed=True):
                    assert frames == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
                    break
                empty, topic, seq, payload = frames
                assert empty == b"" and topic == TOPIC
                got[int.from_bytes(seq, "big")] = payload
            assert min(got) == start and sorted(got) == list(range(start, max(got) + 1))
            assert all(got[s] == live[s] for s in got if s in live)
    finally:
        dealer.close()


def test_reset_prefix_cache_publishes_all_blocks_cleared(setup):
    engine, sub, _ = setup
    text = "Cached, then forgotten. " * 8
    engine.post("/v1/completions", {"prompt": text, "max_tokens": 1})
    n0 = len(sub.drain())
    status, _, _ = engine.post("/reset_prefix_cache")
    assert status == 200
    wait_until(lambda: any(e["type"] == "AllBlocksCleared" for _, _, p in sub.drain()[n0:]
                           for e in msgpack.unpackb(p)[1]), what="AllBlocksCleared")
    _, _, body = engine.post("/v1/completions", {"prompt": text, "max_tokens": 1})
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_cache_salt_namespaces_hits_and_events(setup):
    """Issue 14: the same prompt under two salts is two cache entries (vLLM's cache_salt): only the
    same salt hits, and the events carry the salt in the first block's extra keys, hashed as vLLM."""
    engine, sub, _ = setup
    prompt = "A tenant's system prompt that another tenant must never see hit. " * 3
    tokens = engine.post("/tokenize", {"prompt": prompt})[2]["tokens"]
    full = (len(tokens) - 1) // BS * BS

    def cached(**extra):
        status, _, body = engine.post("/v1/completions", {"prompt": prompt, "max_tokens": 1, **extra})
        assert status == 200
        return body["usage"]["prompt_tokens_details"]["cached_tokens"]

    n0 = len(sub.drain())
    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0 and cached() == 0  # another tenant, or none: no hit
    assert cached(cache_salt="tenant-a") == full  # the same tenant hits
    wait_until(lambda: len(stored([e for _, _, p in sub.drain()[n0:] for e in msgpack.unpackb(p)[1]])) >= 3,
               what="BlockStored for the three namespaces")
    ev = stored([e for _, _, p in sub.messages[n0:] for e in msgpack.unpackb(p)[1]])
    roots = {e["block_hashes"][0]: e for e in ev if e["parent_block_hash"] is None}
    salted_a = vllm_block_hashes(tokens, BS, seed_text=HASH_SEED, cache_salt="tenant-a")
    assert salted_a[0] in roots and roots[salted_a[0]]["extra_keys"][:2] == [["tenant-a"], None]
    assert vllm_block_hashes(tokens, BS, seed_text=HASH_SEED, cache_salt="tenant-b")[0] in roots
    for bad in ("", 7):
        status, _, body = engine.post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "cache_salt": bad})
        assert status == 400 and "cache_salt" in body["error"]["message"]
