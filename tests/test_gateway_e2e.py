"""`conductor serve` end to end, with the official openai SDK as the client; every scenario runs
against both engine families (vLLM's two-step PD and SGLang's bootstrap rooms)."""
from __future__ import annotations

import asyncio
import json
import random
import threading

import openai
import pytest
import requests

from tests.servers import FLAVORS, RestartableEngine, gateway, sim_engine, stop, wait_until

# starts real servers or subprocesses: `make test-fast` skips these
pytestmark = pytest.mark.slow

EMBEDDED = "[embedded]\nprefill = 2\ndecode = 2\nengine = \"{flavor}\"\n"


@pytest.fixture(scope="module", params=FLAVORS)
def flavor(request):
    return request.param


@pytest.fixture(scope="module")
def gw(flavor):
    with gateway(EMBEDDED.format(flavor=flavor)) as g:
        g["model"] = requests.get(g["url"] + "/v1/models").json()["data"][0]["id"]
        g["flavor"] = flavor
        yield g


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw["url"] + "/v1", api_key="none", max_retries=0)


def test_sync_chat_and_completions(gw):
    c = client(gw)
    r = c.chat.completions.create(model=gw["model"], messages=[{"role": "user", "content": "hello"}], max_tokens=5,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].message.content and r.usage.completion_tokens == 5
    r = c.completions.create(model=gw["model"], prompt="once upon a time", max_tokens=4,
                             extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens == len("once upon a time")


def test_sync_streaming_with_usage_and_headers(gw):
    c = client(gw)
    raw = c.chat.completions.with_raw_response.create(
        model=gw["model"], messages=[{"role": "user", "content": "stream please"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": "req-abc"})
    assert raw.headers["x-conductor-prefill"].startswith("prefill-")
    assert raw.headers["x-conductor-decode"].startswith("decode-")
    assert raw.headers["x-request-id"] == "req-abc"
    chunks = list(raw.parse())
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text and chunks[-1].usage.completion_tokens == 8


def test_async_streaming(gw):
    async def go():
        c = openai.AsyncOpenAI(base_url=gw["url"] + "/v1", api_key="none", max_retries=0)
        streams = [await c.chat.completions.create(model=gw["model"], messages=[{"role": "user", "content": f"q{i}"}],
                                                   max_tokens=6, stream=True, extra_body={"ignore_eos": True})
                   for i in range(4)]

        async def drain(s):
            return len([ch async for ch in s if ch.choices and ch.choices[0].delta.content])

        counts = await asyncio.gather(*(drain(s) for s in streams))
        await c.close()
        return counts

    counts = asyncio.run(go())
    assert all(n >= 1 for n in counts) and len(counts) == 4


def test_shared_prefix_lands_on_holder_and_reports_cached_tokens(gw):
    c = client(gw)
    prefix = "".join(random.Random(7).choice("abcdefghij ") for _ in range(6000))
    first = c.chat.completions.with_raw_response.create(
        model=gw["model"], messages=[{"role": "user", "content": prefix + " first question"}], max_tokens=2)
    holder = first.headers["x-conductor-prefill"]
    # the holder's KV events reach the index asynchronously: wait on the observable condition
    for _ in range(100):
        view = requests.get(gw["url"] + "/admin/cluster").json()
        inst = {i["id"]: i for i in view["instances"]}
        if inst[holder]["cached_blocks"]["device"] >= 6000 // 16:
            break
        threading.Event().wait(0.05)
    second = c.chat.completions.with_raw_response.create(
        model=gw["model"], messages=[{"role": "user", "content": prefix + " second question"}], max_tokens=2)
    assert second.headers["x-conductor-prefill"] == holder
    # the scheduler predicted the hit, and the prefill engine reported it from its own cache
    assert int(second.headers["x-conductor-hit-tokens"]) >= 6000 - 32
    assert int(second.headers["x-conductor-prefill-cached-tokens"]) >= 6000 - 32
    assert int(first.headers["x-conductor-prefill-cached-tokens"]) < 100
    assert second.parse().usage.prompt_tokens_details.cached_tokens >= 6000 - 32


def test_tight_ttft_slo_gets_429_with_retry_after(gw):
    body = {"model": gw["model"], "messages": [{"role": "user", "content": "z" * 30000}], "max_tokens": 4}
    r = requests.post(gw["url"] + "/v1/chat/completions", json=body, headers={"x-slo-ttft-ms": "1"})
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["x-conductor-reject-reason"]
    assert r.json()["error"]["type"] == "rate_limit_error"


@pytest.mark.parametrize("send, status, field", [
    (dict(data=b"{oops"), 400, None),
    (dict(json={"model": "m"}), 400, "messages"),
    (dict(json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}), 404, "model"),
    (dict(json={"messages": [{"role": "user", "content": "x"}]}), 400, "model"),
    (dict(json={"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}), 400,
     "max_tokens"),
    (dict(data=b"{" + b" " * (9 * 1024 * 1024) + b"}"), 413, None),
])
def test_bad_inputs_get_openai_errors(gw, send, status, field):
    if "json" in send and send["json"].get("model") == "MODEL":
        send = dict(json={**send["json"], "model": gw["model"]})
    r = requests.post(gw["url"] + "/v1/chat/completions", headers={"content-type": "application/json"}, **send)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if field:
        assert err["param"] == field


def test_unknown_route_is_json_404(gw):
    r = requests.get(gw["url"] + "/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_metrics_and_decisions(gw):
    text = requests.get(gw["url"] + "/metrics").text
    assert "conductor_requests_total" in text and "conductor_time_to_first_token_seconds_bucket" in text
    d = requests.get(gw["url"] + "/admin/decisions", params={"limit": 3}).json()["decisions"]
    assert 1 <= len(d) <= 3
    assert requests.get(gw["url"] + "/admin/decisions", params={"limit": 0}).status_code == 400


def _stream_and_maybe_drop(url: str, model: str, i: int, drop: bool) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": f"load {i} " + "y" * (i % 7 * 100)}],
            "max_tokens": 24, "ignore_eos": True, "stream": True}
    try:
        with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
            if r.status_code != 200:
                return f"status {r.status_code}"
            for n, _ in enumerate(r.iter_lines()):
                if drop and n == 3:
                    return "dropped"  # closing the response mid-stream = client disconnect
            return "ok"
    except requests.RequestException as e:
        return f"exc {e.__class__.__name__}"


def test_no_reservation_leaks_after_disconnects_and_an_engine_killed(flavor):
    with (sim_engine("prefill", flavor=flavor) as p1, sim_engine("prefill", flavor=flavor) as p2,
          sim_engine("decode", flavor=flavor) as d1, sim_engine("decode", flavor=flavor) as d2):
        cfg = ['policy = "conductor"', "health_interval_s = 0.2", "[slo]", "ttft_ms = 600000", "tbt_ms = 600000"]
        for name, e in (("p1", p1), ("p2", p2), ("d1", d1), ("d2", d2)):
            cfg += e["engine"].entry(name)
        with gateway("\n".join(cfg) + "\n") as g:
            model = requests.get(g["url"] + "/v1/models").json()["data"][0]["id"]
            rng = random.Random(3)
            results: list[str] = []
            lock = threading.Lock()
            jobs = [(i, rng.random() < 0.3) for i in range(240)]

            def worker():
                while True:
                    with lock:
                        if not jobs:
                            return
                        i, drop = jobs.pop()
                        if len(jobs) == 120:  # halfway: kill a decode engine under load
                            stop(d2["proc"])
                    out = _stream_and_maybe_drop(g["url"], model, i, drop)
                    with lock:
                        results.append(out)

            threads = [threading.Thread(target=worker) for _ in range(16)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=180)
            assert len(results) == 240
            assert results.count("ok") > 100  # the survivors kept serving
            # disconnects reach the gateway asynchronously: wait (bounded) for the ledger to drain
            for _ in range(200):
                view = requests.get(g["url"] + "/admin/cluster").json()
                if all(i["reserved_prefill_tokens"] == 0 and i["active_requests"] == 0 for i in view["instances"]):
                    break
                threading.Event().wait(0.05)
            for inst in view["instances"]:
                assert inst["reserved_prefill_tokens"] == 0, inst
                assert inst["active_requests"] == 0, inst
            # the killed engine is ejected and traffic still flows
            assert not {i["id"]: i for i in view["instances"]}["d2"]["healthy"]
            after = _stream_and_maybe_drop(g["url"], model, 999, False)
            assert after == "ok"


def test_dead_engine_before_first_byte_is_retried_on_another_pair_then_ejected(flavor):
    with sim_engine("prefill", flavor=flavor) as p1, sim_engine("decode", flavor=flavor) as d1, \
            sim_engine("decode", flavor=flavor) as d2:
        cfg = ['policy = "round_robin"', "health_interval_s = 60", "eject_after_failures = 2",
               "[slo]", "ttft_ms = 600000", "tbt_ms = 600000"]
        for name, e in (("p1", p1), ("d1", d1), ("d2", d2)):
            cfg += e["engine"].entry(name, events=False)
        with gateway("\n".join(cfg) + "\n") as g:
            model = requests.get(g["url"] + "/v1/models").json()["data"][0]["id"]
            stop(d2["proc"])  # dead, but the (slow) health check has not noticed
            body = {"model": model, "messages": [{"role": "user", "content": "retry me"}], "max_tokens": 3}
            answers = [requests.post(g["url"] + "/v1/chat/completions", json=body, timeout=30) for _ in range(6)]
            assert [a.status_code for a in answers] == [200] * 6
            assert {a.headers["x-conductor-decode"] for a in answers} == {"d1"}
            view = {i["id"]: i for i in requests.get(g["url"] + "/admin/cluster").json()["instances"]}
            assert not view["d2"]["healthy"]  # two failed connections ejected it
            stop(d1["proc"])  # no decode left: 503, not a hang
            r = requests.post(g["url"] + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"]


def test_decode_leg_refused_for_lost_kv_is_retried_on_another_pair_once():
    # vLLM only: the prefill instance drops KV nobody pulled at once, so every decode leg finds it
    # gone (410). An SGLang decode is already waiting on its room when the prefill finishes, so
    # its hold cannot run out first; SGLang's failed handovers are in tests/test_drivers_sglang.py
    with sim_engine("prefill", "--kv-hold-timeout", "0.00001") as p1, sim_engine("decode") as d1, \
            sim_engine("decode") as d2:
        cfg = ['policy = "round_robin"', "health_interval_s = 60", "eject_after_failures = 10",
               "[slo]", "ttft_ms = 600000", "tbt_ms = 600000"]
        for name, e in (("p1", p1), ("d1", d1), ("d2", d2)):
            cfg += e["engine"].entry(name, events=False)
        with gateway("\n".join(cfg) + "\n") as g:
            model = requests.get(g["url"] + "/v1/models").json()["data"][0]["id"]
            body = {"model": model, "messages": [{"role": "user", "content": "where did my KV go " * 20}],
                    "max_tokens": 3}
            r = requests.post(g["url"] + "/v1/chat/completions", json=body, headers={"x-request-id": "kv-lost"},
                              timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "upstream_unavailable"
            assert r.headers["x-request-id"] == "kv-lost"
            tried = [d["chosen"]["decode"] for d in requests.get(g["url"] + "/admin/decisions").json()["decisions"]
                     if d["request_id"] == "kv-lost"]
            assert sorted(tried) == ["d1", "d2"]  # the retry avoided the decode instance that failed
            view = requests.get(g["url"] + "/admin/cluster").json()
            assert all(i["active_requests"] == 0 for i in view["instances"])


def test_engine_dying_mid_stream_ends_the_stream_with_an_sse_error(flavor):
    with sim_engine("prefill", flavor=flavor) as p1, sim_engine("decode", flavor=flavor) as d1:
        cfg = ["health_interval_s = 60", "[slo]", "ttft_ms = 600000", "tbt_ms = 600000"]
        for name, e in (("p1", p1), ("d1", d1)):
            cfg += e["engine"].entry(name, events=False)
        with gateway("\n".join(cfg) + "\n") as g:
            model = requests.get(g["url"] + "/v1/models").json()["data"][0]["id"]
            body = {"model": model, "messages": [{"role": "user", "content": "long answer"}], "max_tokens": 5000,
                    "ignore_eos": True, "stream": True}
            events = []
            with requests.post(g["url"] + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line:
                        continue
                    events.append(line)
                    if len(events) == 5:
                        stop(d1["proc"])  # the decode engine dies under our stream
            assert len(events) < 5000
            err = json.loads(events[-2][len(b"data: "):])["error"]
            assert err["code"] == "upstream_failed" and events[-1] == b"data: [DONE]"
            view = requests.get(g["url"] + "/admin/cluster").json()
            assert all(i["active_requests"] == 0 for i in view["instances"])


def test_concurrent_requests_reusing_one_request_id_all_succeed(gw):
    import concurrent.futures

    body = {"model": gw["model"], "messages": [{"role": "user", "content": "same id"}], "max_tokens": 8,
            "ignore_eos": True}

    def send(_):
        return requests.post(gw["url"] + "/v1/chat/completions", json=body, headers={"X-Request-Id": "dup"}, timeout=60)

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(send, range(6)))
    assert [a.status_code for a in answers] == [200] * 6
    assert {a.headers["x-request-id"] for a in answers} == {"dup"}


def test_ejected_engine_is_readmitted_when_it_comes_back(flavor):
    engine = RestartableEngine(flavor=flavor)
    engine.start()
    try:
        cfg = ["health_interval_s = 0.1", "eject_after_failures = 2", *engine.entry("b")]
        with gateway("\n".join(cfg) + "\n") as g:
            engine.stop()
            wait_until(g["url"] + "/ready", g["proc"], status=503, timeout_s=20)  # ejected: no pair left
            engine.start(wait=False)  # the engine restarts on the same address
            wait_until(g["url"] + "/ready", g["proc"], timeout_s=30)  # readmitted
            model = requests.get(g["url"] + "/v1/models").json()["data"][0]["id"]
            r = requests.post(g["url"] + "/v1/chat/completions", timeout=30, json={
                "model": model, "messages": [{"role": "user", "content": "back again"}], "max_tokens": 2})
            assert r.status_code == 200 and r.headers["x-conductor-decode"] == "b"
    finally:
        engine.stop()


def test_non_streamed_client_leaving_frees_its_reservation_at_once(gw):
    body = {"model": gw["model"], "messages": [{"role": "user", "content": "a very long answer"}],
            "max_tokens": 4000, "ignore_eos": True}  # ~20 s of decoding on the 8B profile
    with pytest.raises(requests.Timeout):
        requests.post(gw["url"] + "/v1/chat/completions", json=body, timeout=1.0)
    # the client has gone after 1 s: the gateway must notice, abort upstream and release
    for _ in range(100):
        view = requests.get(gw["url"] + "/admin/cluster").json()
        if all(i["active_requests"] == 0 for i in view["instances"]):
            break
        threading.Event().wait(0.05)
    assert all(i["active_requests"] == 0 for i in view["instances"]), view


def test_engine_restarting_between_health_checks_loses_its_indexed_blocks(flavor):
    """An engine that restarts too quickly to be ejected comes back with an empty cache: the
    gateway must not keep routing for its old prefixes."""
    engine = RestartableEngine(flavor=flavor)
    engine.start()
    try:
        cfg = ["health_interval_s = 0.1", "eject_after_failures = 1000", *engine.entry("b")]
        with gateway("\n".join(cfg) + "\n") as g:
            model = requests.get(g["url"] + "/v1/models").json()["data"][0]["id"]

            def instance():
                return requests.get(g["url"] + "/admin/cluster").json()["instances"][0]

            def until(cond):
                for _ in range(400):
                    if cond(instance()):
                        return
                    threading.Event().wait(0.05)
                raise AssertionError(instance())

            r = requests.post(g["url"] + "/v1/chat/completions", timeout=30, json={
                "model": model, "messages": [{"role": "user", "content": "p" * 3000}], "max_tokens": 2})
            assert r.status_code == 200
            until(lambda i: i["cached_blocks"]["device"] >= 180)
            engine.stop()
            until(lambda i: i["consecutive_failures"] >= 1 and i["healthy"])  # noticed, not ejected
            engine.start(wait=False)
            until(lambda i: i["consecutive_failures"] == 0 and i["cached_blocks"]["device"] == 0)
    finally:
        engine.stop()

def test_the_gateway_learns_each_engines_kv_capacity_from_its_metrics(gw):
    """The scheduler starts from a public estimate and takes the engine's own capacity from
    vllm:cache_config_info (num_gpu_blocks x block_size), or SGLang's sglang:max_total_num_tokens;
    it is told the deployment, nothing else."""
    from predictors.facts import load_deployment

    estimate = load_deployment("llama3-8b-h200").estimated_kv_capacity_tokens()

    def learned():
        rows = requests.get(gw["url"] + "/admin/cluster").json()["instances"]
        return {r["id"]: (r["deployment"], r["kv_capacity_tokens"]) for r in rows}

    for _ in range(100):  # the health poll reads /metrics every health_interval_s
        if all(cap != estimate for _, cap in learned().values()):
            break
        threading.Event().wait(0.05)
    from engines_adapters.drivers import parse_metrics

    urls = {i["id"]: i["url"] for i in requests.get(gw["url"] + "/admin/cluster").json()["instances"]}
    for eid, (deployment, cap) in learned().items():
        url = urls[eid]
        assert deployment == "llama3-8b-h200"
        assert cap == parse_metrics(gw["flavor"], requests.get(url + "/metrics").text).kv_capacity_tokens


def test_cache_salt_tenants_never_see_each_others_hits(gw):
    """Issue 14: the same prompt under another salt (or none) gets zero predicted and zero served
    hits; the same salt gets both. The salt reaches the engines in the forwarded body."""
    c = client(gw)
    prompt = "".join(random.Random(11).choice("klmnopqrst ") for _ in range(4000))

    def ask(salt):
        extra = {"cache_salt": salt} if salt is not None else None
        r = c.completions.with_raw_response.create(model=gw["model"], prompt=prompt, max_tokens=2, extra_body=extra)
        return (r.headers["x-conductor-prefill"], int(r.headers["x-conductor-hit-tokens"]),
                int(r.headers["x-conductor-prefill-cached-tokens"]))

    holder, predicted, served = ask("tenant-a")
    assert predicted == 0 and served < 100
    for _ in range(100):  # the holder's KV events reach the index asynchronously
        inst = {i["id"]: i for i in requests.get(gw["url"] + "/admin/cluster").json()["instances"]}
        if inst[holder]["cached_blocks"]["device"] >= 4000 // 16:
            break
        threading.Event().wait(0.05)
    for other in ("tenant-b", None):
        _, predicted, served = ask(other)
        assert (predicted, served) == (0, 0), other
    again, predicted, served = ask("tenant-a")
    assert again == holder and predicted >= 4000 - 32 and served >= 4000 - 32
    bad = requests.post(gw["url"] + "/v1/completions",
                        json={"model": gw["model"], "prompt": "x", "cache_salt": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


@pytest.mark.parametrize("algo", ["xxhash_cbor", "sha256"])
def test_engine_sending_bytes_block_hashes_fills_the_index(algo, monkeypatch):
    """Issue 13: an engine started with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 names blocks by their
    raw digests (16 bytes with xxhash_cbor): the gateway's index fills and predicts the hit."""
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    engine = RestartableEngine("both", "--prefix-caching-hash-algo", algo)
    engine.start()
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES")
    try:
        with gateway("\n".join(["health_interval_s = 0.2", *engine.entry("b")]) + "\n") as g:
            model = requests.get(g["url"] + "/v1/models").json()["data"][0]["id"]
            body = {"model": model, "prompt": "q" * 2000, "max_tokens": 2}
            assert requests.post(g["url"] + "/v1/completions", json=body, timeout=30).status_code == 200
            for _ in range(200):
                inst = requests.get(g["url"] + "/admin/cluster").json()["instances"][0]
                if inst["cached_blocks"]["device"] >= 2000 // 16 - 1:
                    break
                threading.Event().wait(0.05)
            assert inst["kv_events"]["ignored"] == 0, inst["kv_events"]
            r = requests.post(g["url"] + "/v1/completions", json=body, timeout=30)
            assert int(r.headers["x-conductor-hit-tokens"]) >= 2000 - 32
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2000 - 32  # colocated: its own
    finally:
        engine.stop()
