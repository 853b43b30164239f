"""`conductor sim-engine --flavor sglang`: SGLang's server surface, its KV events (read here with a
plain msgpack decoder and hashlib, independently of the engine's own wire code), and its PD
handover through bootstrap rooms."""
from __future__ import annotations

import concurrent.futures
import hashlib
import struct

import msgpack
import msgspec
import pytest
import zmq

from engines_adapters.net import free_port
from tests.sim_helpers import SimEngineProcess, wait_until

pytestmark = pytest.mark.slow  # starts sim engine processes

GEN = {"sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}


def sglang(*args: str, role: str = "both", **kw) -> SimEngineProcess:
    return SimEngineProcess("--flavor", "sglang", "--noise", "0", *args, role=role, **kw)


# --- an independent reader of SGLang's KV events ------------------------------------------------

def sglang_page_ids(tokens: list[int], page: int, salt: str | None = None) -> list[int]:
    """SGLang 0.5.23's event ids, from its recipe: SHA-256 chained over u32-LE pages, signed int64
    of the first 8 digest bytes; a salted chain starts from SHA256("sglang-cache-salt-v1\\0"+salt)."""
    prev = hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode()).digest() if salt else b""
    out = []
    for i in range(len(tokens) // page):
        prev = hashlib.sha256(prev + struct.pack(f"<{page}I", *tokens[i * page:(i + 1) * page])).digest()
        out.append(struct.unpack(">q", prev[:8])[0])
    return out


def test_the_independent_recipe_matches_sglangs_published_vectors():
    assert sglang_page_ids([1, 2, 3, 4, 5, 6, 7, 8], 4) == [-3488128144981237669, 5674439469042975057]
    assert sglang_page_ids([1, 2], 1) == [7470307888890966271, -1634645291211865391]


def replay_all(replay_port: int) -> list[list]:
    """Every buffered batch from the engine's replay socket, decoded as plain values by another
    msgpack library than the engine's (msgspec)."""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        batches = []
        while True:
            assert dealer.poll(5000), "replay did not answer"
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                return batches
            _, topic, seq, payload = frames
            batches.append([int.from_bytes(seq, "big"), msgpack.unpackb(payload)])
    finally:
        dealer.close()


def test_kv_events_are_sglangs_wire_with_its_page_hashes():
    kv, replay = free_port(), free_port()
    with sglang("--kv-events", f"tcp://*:{kv}", "--kv-events-replay", f"tcp://127.0.0.1:{replay}",
                "--page-size", "4", "--kv-capacity-tokens", "64", "--host-tier-tokens", "64") as e:
        prompt = list(range(1, 10))  # two complete pages and one token
        st, _, body = e.post("/generate", {"input_ids": prompt, **GEN})
        assert st == 200 and body["meta_info"]["prompt_tokens"] == 9
        batches = wait_until(lambda: replay_all(replay) or None, what="a KV event batch")
        ts, events, dp = batches[0][1]
        assert isinstance(ts, float) and dp == 0 and [b[0] for b in batches] == list(range(len(batches)))
        stored = [ev for _, b in batches for ev in b[1] if ev["type"] == "BlockStored"]
        first = stored[0]
        # SGLang's msgspec struct: optional fields left out when unset, lora_id always there
        assert set(first) == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                              "medium"}
        assert first["lora_id"] is None and first["medium"] == "GPU" and first["block_size"] == 4
        assert first["block_hashes"][:2] == sglang_page_ids(prompt, 4)
        assert first["token_ids"][:8] == prompt[:8] and first["parent_block_hash"] is None
        # fill the 16-page GPU pool with other prompts: evictions offload to the host tier as CPU_PINNED
        for k in range(6):
            e.post("/generate", {"input_ids": [100 + k] * 12, **GEN})
        events = [ev for _, b in replay_all(replay) for ev in b[1]]
        removed = [ev for ev in events if ev["type"] == "BlockRemoved"]
        assert removed and removed[0]["medium"] == "GPU"
        host = [ev for ev in events if ev["type"] == "BlockStored" and ev["medium"] == "CPU_PINNED"]
        on_gpu = {h for ev in events if ev["type"] == "BlockStored" and ev["medium"] == "GPU"
                  for h in ev["block_hashes"]}
        assert host and all(h in on_gpu for ev in host for h in ev["block_hashes"])  # the same page, moved
        # a later page's parent is the page before it, by SGLang's own id
        chained = [ev for ev in stored if ev["parent_block_hash"] is not None]
        assert all(ev["parent_block_hash"] in {h for s in stored for h in s["block_hashes"]} for ev in chained)
        wait_until(lambda: e.get("/sim/stats")[2]["running"] == 0, what="idle")
        assert e.get("/flush_cache")[0] == 200
        cleared = wait_until(lambda: [ev for _, b in replay_all(replay) for ev in b[1]
                                      if ev["type"] == "AllBlocksCleared"], what="AllBlocksCleared")
        assert cleared == [{"type": "AllBlocksCleared"}]


def test_server_surface_as_a_router_reads_it():
    with sglang() as e:
        st, _, body = e.post("/generate", {"text": "hello there", **GEN})
        meta = body["meta_info"]
        assert st == 200 and len(body["output_ids"]) == 6 and body["text"]
        assert meta["finish_reason"] == {"type": "length", "length": 6}
        assert meta["prompt_tokens"] == len("hello there") and meta["completion_tokens"] == 6
        assert meta["cached_tokens"] == 0 and meta["e2e_latency"] >= 0
        # streaming: cumulative chunks, finish_reason only on the last, then [DONE]
        st, h, text = e.post("/generate", {"input_ids": list(range(40)), "stream": True, **GEN})
        chunks = [msgspec.json.decode(x[6:]) for x in text.split("\n\n") if x.startswith("data: {")]
        assert st == 200 and h["Content-Type"].startswith("text/event-stream") and text.endswith("data: [DONE]\n\n")
        assert [len(c["output_ids"]) for c in chunks] == list(range(1, 7))
        assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
        # a repeated prompt: SGLang reports the cached prefix (whole pages, never the last token)
        st, _, body = e.post("/generate", {"input_ids": list(range(40)), **GEN})
        assert body["meta_info"]["cached_tokens"] == 32
        for bad in ({"sampling_params": {}}, {"text": "x", "input_ids": [1]}, {"text": ["a", "b"]},
                    {"text": "x", "sampling_params": {"max_new_tokens": -1}}):
            st, _, body = e.post("/generate", bad)
            assert st == 400 and body["error"]["message"], bad
        for path in ("/health", "/health_generate"):
            assert e.get(path)[0] == 200
        for path in ("/model_info", "/get_model_info"):
            info = e.get(path)[2]
            assert info["is_generation"] and info["disaggregation_mode"] == "null" and info["model_path"]
        for path in ("/server_info", "/get_server_info"):
            info = e.get(path)[2]
            assert info["page_size"] == 16 and info["dp_size"] == 1 and info["version"] == "0.5.23"
            assert info["max_total_num_tokens"] > 0 and info["kv_events"] is None
        assert e.get("/version")[0] == 404  # SGLang has none: how routers tell it from vLLM
        assert e.get("/v1/models")[2]["data"][0]["owned_by"] == "sglang"
        load = e.get("/get_load")[2]
        assert load[0]["dp_rank"] == 0 and load[0]["num_reqs"] == 0
        metrics = e.get("/metrics")[2]
        for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                     "sglang:max_total_num_tokens", "sglang:cache_hit_rate", "sglang:prompt_tokens_total",
                     "sglang:time_to_first_token_seconds_bucket", "sglang:num_decode_prealloc_queue_reqs"):
            assert name in metrics, name
        assert 'engine_type="unified"' in metrics and "vllm:" not in metrics
        assert e.metric("sglang:cached_tokens_total") >= 32
        st, _, text = e.post("/flush_cache")
        assert st == 200 and text.startswith("Cache flushed.")
        st, _, body = e.post("/generate", {"input_ids": list(range(40)), **GEN})
        assert body["meta_info"]["cached_tokens"] == 0  # flushed


@pytest.fixture(scope="module")
def pd():
    boot = free_port()
    with sglang("--disaggregation-bootstrap-port", str(boot), "--kv-hold-timeout", "40",
                role="prefill") as p, \
            sglang("--disaggregation-mode", "decode", "--disaggregation-waiting-timeout", "1.5", role="decode") as d:
        yield p, d, boot


def dual(p, d, body, path="/generate"):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        fp, fd = pool.submit(p.post, path, body), pool.submit(d.post, path, body)
        return fp.result(), fd.result()


def test_pd_handover_by_bootstrap_room(pd):
    p, d, boot = pd
    body = {"text": "disaggregated " * 30, **GEN, "bootstrap_host": "127.0.0.1", "bootstrap_port": boot,
            "bootstrap_room": 2**62 + 1}
    (ps, _, pb), (ds, _, db) = dual(p, d, body)
    assert ps == 200 and pb["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert ds == 200 and db["meta_info"]["completion_tokens"] == 6
    # the decode pulled the prompt's KV instead of computing it
    assert db["meta_info"]["cached_tokens"] >= len("disaggregated " * 30) - 1
    chat = {"model": "llama3-8b", "messages": [{"role": "user", "content": "pd chat"}], "max_tokens": 4,
            "ignore_eos": True, "stream": True, "bootstrap_host": "127.0.0.1", "bootstrap_port": boot,
            "bootstrap_room": 7}
    (ps, _, _), (ds, _, text) = dual(p, d, chat, "/v1/chat/completions")
    assert ps == 200 and ds == 200 and text.endswith("data: [DONE]\n\n") and text.count('"content"') >= 4
    assert p.get("/model_info")[2]["disaggregation_mode"] == "prefill"
    wait_until(lambda: p.stats()["held"] == 0, what="the prefill's KV released")
    # the bootstrap server answers SGLang's own routes
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{boot}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
                                f"&target_tp_rank=-1&target_pp_rank=-1", timeout=5) as r:
        assert json.loads(r.read())["page_size"] == 16


def test_pd_requests_without_a_room_are_refused(pd):
    p, d, _ = pd
    for e in (p, d):
        st, _, body = e.post("/generate", {"text": "no room", **GEN})
        assert st == 400 and "without bootstrap room" in body["error"]["message"]


def test_room_collision_and_absent_prefill_time_out_on_the_decode_and_free_it(pd):
    p, d, boot = pd
    base = {**GEN, "bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": 424242}
    a, b = {"text": "first prompt " * 10, **base}, {"text": "second prompt " * 10, **base}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        pa = pool.submit(p.post, "/generate", a)
        wait_until(lambda: p.stats()["held"] == 1, what="A's prefill holding its KV")
        pb = pool.submit(p.post, "/generate", b)  # the same room while A holds it: refused
        assert pb.result()[0] == 409
        st, _, body = d.post("/generate", b)  # B's decode finds only A's KV under the room
        assert st == 504 and "room collision" in body["error"]["message"]
        assert d.metric("sglang:num_decode_prealloc_queue_reqs") == 0  # nothing left waiting
        st, _, body = d.post("/generate", a)  # A's own decode still gets it
        assert st == 200 and pa.result()[0] == 200
    st, _, body = d.post("/generate", {**a, "bootstrap_room": 99})  # no prefill ever had room 99
    assert st == 504 and "never received it" in body["error"]["message"]
    assert d.stats()["running"] == 0 and d.stats()["waiting"] == 0


def test_page_size_mismatch_is_refused_by_the_decode():
    boot = free_port()
    with sglang("--disaggregation-bootstrap-port", str(boot), role="prefill") as p, \
            sglang("--page-size", "32", role="decode") as d:
        body = {"text": "x" * 100, **GEN, "bootstrap_host": "127.0.0.1", "bootstrap_port": boot,
                "bootstrap_room": 5}
        st, _, err = d.post("/generate", body)
        assert st == 500 and "--page-size" in err["error"]["message"]
        assert p.stats()["running"] == 0


def test_salted_pages_chain_from_the_salt_and_name_it_on_the_wire():
    kv, replay = free_port(), free_port()
    with sglang("--kv-events", f"tcp://*:{kv}", "--kv-events-replay", f"tcp://127.0.0.1:{replay}",
                "--page-size", "4") as e:
        prompt = list(range(1, 14))
        for salt in ("tenant-a", None):
            body = {"input_ids": prompt, **GEN, **({"cache_salt": salt} if salt else {})}
            assert e.post("/generate", body)[2]["meta_info"]["cached_tokens"] == 0  # salts never share pages
        def roots():
            found = [ev for _, b in replay_all(replay) for ev in b[1]
                     if ev["type"] == "BlockStored" and ev["parent_block_hash"] is None]
            return found if len(found) >= 2 else None

        stored = wait_until(roots, what="both requests' first pages")
        salted = next(ev for ev in stored if ev.get("cache_salt") == "tenant-a")
        plain = next(ev for ev in stored if "cache_salt" not in ev)
        assert salted["block_hashes"][:3] == sglang_page_ids(prompt, 4, "tenant-a")
        assert plain["block_hashes"][:3] == sglang_page_ids(prompt, 4)


def test_extra_key_separates_pages_but_not_their_event_ids():
    kv, replay = free_port(), free_port()
    with sglang("--kv-events", f"tcp://*:{kv}", "--kv-events-replay", f"tcp://127.0.0.1:{replay}",
                "--page-size", "4") as e:
        prompt = list(range(50, 63))

        def cached(**extra):
            return e.post("/generate", {"input_ids": prompt, **GEN, **extra})[2]["meta_info"]["cached_tokens"]

        assert (cached(extra_key="a"), cached(extra_key="b"), cached(extra_key="a"), cached()) == (0, 0, 12, 0)
        assert e.post("/generate", {"input_ids": prompt, **GEN, "extra_key": ""})[0] == 400

        def roots():
            found = [ev for _, b in replay_all(replay) for ev in b[1]
                     if ev["type"] == "BlockStored" and ev["parent_block_hash"] is None]
            return found if len(found) >= 3 else None

        stored = wait_until(roots, what="three chains' first pages")
        assert all(ev["block_hashes"][:3] == sglang_page_ids(prompt, 4) for ev in stored)  # SGLang: no key in ids
        assert all("cache_salt" not in ev for ev in stored)
