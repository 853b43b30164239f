"""The sim-engine HTTP server as a client sees it: OpenAI API (stdlib and the official SDK),
vLLM extras, errors, metrics, prefix hits, and a disconnect that frees the request's KV."""
from __future__ import annotations

import asyncio
import json
import socket

import openai
import pytest

from tests.sim_helpers import SimEngineProcess, wait_until

# starts real servers or subprocesses: `make test-fast` skips these
pytestmark = pytest.mark.slow

MODEL = "llama3-8b"


@pytest.fixture(scope="module")
def engine():
    with SimEngineProcess("--kv-capacity-tokens", "200000", "--seed", "7", time_scale=0.05) as e:
        yield e


def chat(text: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **kw}


def test_models_health_tokenize(engine):
    assert engine.get("/health")[0] == 200
    status, _, body = engine.get("/v1/models")
    assert status == 200 and body["data"][0]["id"] == MODEL
    assert body["data"][0]["root"] == "meta-llama/Meta-Llama-3-8B-Instruct"
    _, _, tok = engine.post("/tokenize", {"prompt": "héllo"})
    assert tok["tokens"] == list("héllo".encode()) and tok["count"] == 6 and tok["max_model_len"] == 131072
    _, _, tok = engine.post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert bytes(tok["tokens"]).decode() == "<|user|>\nhi\n<|assistant|>\n"
    _, _, de = engine.post("/detokenize", {"tokens": tok["tokens"]})
    assert de["prompt"] == "<|user|>\nhi\n<|assistant|>\n"


def test_chat_completion_ignore_eos_exact_length_and_headers(engine):
    status, headers, body = engine.post("/v1/chat/completions", chat("Tell me a story", max_tokens=37, ignore_eos=True),
                                        headers={"X-Request-Id": "story-1"})
    assert status == 200
    assert headers["X-Request-Id"] == "story-1" and body["id"] == "chatcmpl-story-1"
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["message"]["content"]) == 37
    assert choice["message"]["content"].isprintable()
    u = body["usage"]
    prompt_len = engine.post("/tokenize", {"messages": [{"role": "user", "content": "Tell me a story"}]})[2]["count"]
    assert u["prompt_tokens"] == prompt_len and u["completion_tokens"] == 37
    assert u["total_tokens"] == prompt_len + 37 and u["prompt_tokens_details"]["cached_tokens"] == 0
    for h in ("x-sim-queue-ms", "x-sim-prefill-ms", "x-sim-transfer-ms"):
        assert float(headers[h]) >= 0
    assert float(headers["x-sim-prefill-ms"]) > 0


def test_output_length_without_ignore_eos_is_seeded_and_capped(engine):
    lengths = []
    for i in range(6):
        _, _, b = engine.post("/v1/completions", {"prompt": f"q{i}", "max_tokens": 60},
                              headers={"X-Request-Id": f"len-{i}"})
        n = b["usage"]["completion_tokens"]
        assert 1 <= n <= 60 and b["choices"][0]["finish_reason"] == ("length" if n == 60 else "stop")
        lengths.append(n)
    assert len(set(lengths)) > 1


def test_repeated_prompt_hits_the_prefix_cache(engine):
    text = "A long shared system prompt about caches. " * 40
    before = engine.metric("vllm:prefix_cache_hits_total")
    _, _, first = engine.post("/v1/chat/completions", chat(text, max_tokens=2))
    _, headers, second = engine.post("/v1/chat/completions", chat(text, max_tokens=2))
    n = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (n - 1) // 16 * 16 and int(headers["x-sim-cached-tokens"]) == cached
    assert engine.metric("vllm:prefix_cache_hits_total") - before == cached


@pytest.mark.parametrize("body,status,needle", [
    (None, 400, "malformed JSON"),
    ([1, 2], 400, "JSON object"),
    ({"model": MODEL}, 400, "'messages' is a required field"),
    ({"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]}, 404, "gpt-17"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 131070}, 400, "131072"),
    ({"messages": [{"role": "user"}], "kv_transfer_params": "yes"}, 400, "kv_transfer_params"),
    ({"messages": [{"role": "user", "content": "x"}], "kv_transfer_params": {"do_remote_prefill": True}}, 400,
     "remote_host"),
    ({"messages": [{"role": "user", "content": "x"}],
      "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.1.2.3", "remote_port": 80,
                             "remote_request_id": "r"}}, 400, "loopback"),
    ({"messages": "hello"}, 400, "messages"),
])
def test_bad_requests_get_openai_errors(engine, body, status, needle):
    raw = b"{not json" if body is None else json.dumps(body).encode()
    got, _, err = engine.post("/v1/chat/completions", raw=raw)
    assert got == status
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["code"] == status
    assert needle in err["error"]["message"] or needle == err["error"]["param"]


def test_prompt_beyond_context_names_both_lengths(engine):
    got, _, err = engine.post("/v1/completions", {"model": MODEL, "prompt": list(range(200)) * 700})
    assert got == 400
    assert "131072" in err["error"]["message"] and "140000" in err["error"]["message"]


def test_openai_sdk_streams_chat_and_completions(engine):
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Stream please"}],
                                            max_tokens=25, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    text, usage, reasons, roles = "", None, [], []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            roles.append(c.delta.role)
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert len(text) == 25 and usage.completion_tokens == 25 and reasons == ["length"] and "assistant" in roles
    assert usage.prompt_tokens_details.cached_tokens == 0

    async def completions() -> tuple[str, int]:
        aclient = openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
        out, n = "", 0
        async for chunk in await aclient.completions.create(model="meta-llama/Meta-Llama-3-8B-Instruct",
                                                            prompt="Once upon", max_tokens=12, stream=True,
                                                            extra_body={"ignore_eos": True}):
            out += "".join(c.text for c in chunk.choices)
            n += 1
        await aclient.close()
        return out, n

    out, chunks = asyncio.run(completions())
    assert len(out) == 12 and chunks >= 12


def test_stream_with_hostile_request_id_stays_valid_json(engine):
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    rid = 'q"uote\\back'
    chunks = list(client.completions.create(model=MODEL, prompt="x", max_tokens=3, stream=True,
                                            extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": rid}))
    assert chunks and all(c.id == f"cmpl-{rid}" for c in chunks)


def test_metrics_use_vllm_names_and_track_a_running_stream(engine):
    sock = _open_stream(engine.port, max_tokens=20000)
    try:
        wait_until(lambda: engine.metric("vllm:num_requests_running") == 1, what="a running request")
        text = engine.get("/metrics")[2]
        for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                     "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_bucket",
                     "vllm:inter_token_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
                     "vllm:request_prefill_time_seconds_bucket", "vllm:e2e_request_latency_seconds_count"):
            assert name in text, name
        assert 'model_name="llama3-8b"' in text
        assert engine.metric("vllm:kv_cache_usage_perc") > 0
        from engines_adapters.drivers.vllm import parse_vllm_metrics

        assert parse_vllm_metrics(text).kv_capacity_tokens == 200_000  # vllm:cache_config_info: blocks x block_size
    finally:
        sock.close()


def _open_stream(port: int, max_tokens: int) -> socket.socket:
    body = json.dumps(chat("Keep going " * 50, max_tokens=max_tokens, ignore_eos=True, stream=True)).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while got.count(b"data: ") < 3:  # the stream is flowing
        chunk = sock.recv(65536)
        assert chunk, "server closed the stream early"
        got += chunk
    assert b"200 OK" in got.split(b"\r\n", 1)[0]
    return sock


def test_client_disconnect_aborts_and_frees_kv(engine):
    wait_until(lambda: engine.stats()["running"] == 0, what="an idle engine")
    sock = _open_stream(engine.port, max_tokens=50000)
    st = engine.stats()
    assert st["running"] == 1 and st["kv_usage"] > 0
    sock.close()
    st = wait_until(lambda: (s := engine.stats())["running"] == 0 and s["kv_usage"] == 0 and s, timeout=10,
                    what="the aborted request's KV to be freed")
    assert st["waiting"] == 0 and st["kv_free_blocks"] == st["kv_capacity_blocks"]
    assert engine.metric("vllm:num_requests_running") == 0
