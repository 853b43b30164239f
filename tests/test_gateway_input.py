"""Request-level hardening of the gateway, without servers: strict JSON, sampling values, prompt
and id limits, SLO headers that can only tighten, PD usage, the decisions page, error types."""
from __future__ import annotations

import json

import pytest

from gateway.admin import MAX_PAGE, NumberedLog, decisions_page
from gateway.errors import RequestError, error_body
from gateway.requests import (
    MAX_JSON_DEPTH,
    check_prompt_size,
    check_request_id,
    json_depth,
    load_json,
    parse_body,
    slo_override,
)
from gateway.streaming import StreamTally, prefill_usage, rewrite_usage
from predictors.telemetry import SLO


def chat(**kw) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def refused(raw: bytes, endpoint: str = "chat") -> RequestError:
    with pytest.raises(RequestError) as e:
        parse_body(raw, endpoint, 16)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',  # lone high surrogate
    b'{"model": "m", "messages": [{"role": "user", "content": "a\\udfffb"}]}',  # lone low surrogate
    b'{"model": "m", "prompt": "x", "temperature": NaN}',
    b'{"model": "m", "prompt": "x", "top_p": Infinity}',
    b'{"model": "m", "prompt": "x", "seed": -Infinity}',
])
def test_bodies_no_engine_or_tokenizer_can_take_are_400(raw):
    assert refused(raw, "completions").code == "invalid_json"


def test_an_escaped_surrogate_pair_is_a_character():
    req = parse_body(b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}', "chat", 16)
    assert req.body["messages"][0]["content"] == "\U0001F600"


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1000, 5000, 200_000])
def test_deep_nesting_is_400_not_a_recursion_error(depth):
    raw = b'{"model": "m", "prompt": "x", "extra": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
    assert "nested" in refused(raw, "completions").message


def test_nesting_up_to_the_limit_and_many_flat_brackets_pass():
    raw = b'{"model": "m", "prompt": "x", "extra": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    assert json_depth(load_json(raw)) == MAX_JSON_DEPTH
    many = [{"role": "user", "content": f"[{i}] {{}}"} for i in range(500)]  # brackets, shallow
    assert len(parse_body(json.dumps(chat(messages=many)).encode(), "chat", 16).body["messages"]) == 500


def test_client_kv_transfer_params_are_refused():
    """They tell an engine where to pull KV from: only the gateway's PD driver sets them."""
    bad = chat(kv_transfer_params={"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9,
                                   "remote_request_id": "x"})
    assert refused(json.dumps(bad).encode()).param == "kv_transfer_params"


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", "hot"), ("temperature", True),
    ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("top_k", 1.5), ("min_p", 2),
    ("presence_penalty", 3), ("frequency_penalty", -2.5), ("repetition_penalty", 0),
    ("max_tokens", 0), ("max_tokens", 2.5), ("max_completion_tokens", -1), ("n", 2), ("n", True),
    ("min_tokens", -1), ("seed", 1.5), ("top_logprobs", -1), ("stop", 5), ("stop", ["a", 1]),
    ("stream_options", "yes"),
])
def test_invalid_sampling_values_name_the_parameter(field, value):
    assert refused(json.dumps(chat(**{field: value})).encode()).param == field


def test_valid_sampling_values_and_nulls_pass():
    ok = chat(temperature=0, top_p=1, top_k=-1, min_p=0.1, presence_penalty=-2, frequency_penalty=2,
              repetition_penalty=1.1, seed=-3, stop=["\n"], top_logprobs=0, n=1, max_tokens=3,
              stream_options=None, logit_bias=None)
    assert parse_body(json.dumps(ok).encode(), "chat", 16).max_tokens == 3
    nulls = chat(temperature=None, top_p=None, stop=None, seed=None)
    assert parse_body(json.dumps(nulls).encode(), "chat", 16).max_tokens == 16


def test_prompt_length_is_bounded_before_tokenizing():
    def req(endpoint, **kw):
        return parse_body(json.dumps({"model": "m", **kw}).encode(), endpoint, 16)

    check_prompt_size(req("completions", prompt="x" * 100), 100, 1.0)
    with pytest.raises(RequestError) as e:
        check_prompt_size(req("completions", prompt="x" * 101), 100, 1.0)
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"
    parts = [{"type": "text", "text": "y" * 300}, {"type": "text", "text": "z" * 300}]
    check_prompt_size(req("chat", messages=[{"role": "user", "content": parts}]), 100, 8.0)
    with pytest.raises(RequestError) as e:
        check_prompt_size(req("chat", messages=[{"role": "user", "content": parts}]), 100, 5.0)
    assert e.value.param == "messages"
    with pytest.raises(RequestError):
        check_prompt_size(req("completions", prompt=list(range(101))), 100, 1.0)  # token ids count one each


@pytest.mark.parametrize("rid, ok", [
    ("req-abc_123:4/5", True), ("x" * 128, True), ("x" * 129, False), ("", False), ("has space", False),
    ("caf\u00e9", False), ("\u00e2\u0082\u00ac", False), ("tab\t", False),
])
def test_request_ids_are_bounded_visible_ascii(rid, ok):
    if ok:
        check_request_id(rid)
    else:
        with pytest.raises(RequestError) as e:
            check_request_id(rid)
        assert e.value.status == 400 and e.value.param == "x-request-id"


def test_slo_headers_only_tighten_unless_trusted():
    configured = SLO(ttft_s=2.0, tbt_s=0.1)
    assert slo_override({}, configured) is None
    tight = slo_override({"x-slo-ttft-ms": "250", "x-slo-tbt-ms": "50"}, configured)
    assert tight.ttft_s == pytest.approx(0.25) and tight.tbt_s == pytest.approx(0.05)
    loose = slo_override({"x-slo-ttft-ms": "600000", "x-slo-tbt-ms": "10000"}, configured)
    assert loose.ttft_s == pytest.approx(2.0) and loose.tbt_s == pytest.approx(0.1)  # capped at the configured
    trusted = slo_override({"x-slo-ttft-ms": "600000"}, configured, trusted=True)
    assert trusted.ttft_s == pytest.approx(600.0) and trusted.tbt_s is None
    assert slo_override({"x-slo-tbt-ms": "30"}, SLO(ttft_s=1.0, tbt_s=None)).tbt_s == pytest.approx(0.03)
    for bad in ("soon", "0", "-5", "nan", "inf"):
        with pytest.raises(RequestError):
            slo_override({"x-slo-ttft-ms": bad}, configured)


def test_pd_usage_reports_the_prefill_sides_hits():
    decode_usage = {"prompt_tokens": 100, "completion_tokens": 3, "total_tokens": 103,
                    "prompt_tokens_details": {"cached_tokens": 99}}
    assert prefill_usage(decode_usage, 16)["prompt_tokens_details"] == {"cached_tokens": 16}
    assert decode_usage["prompt_tokens_details"]["cached_tokens"] == 99  # not mutated
    assert prefill_usage({"prompt_tokens": 5}, 0)["prompt_tokens_details"] == {"cached_tokens": 0}
    token = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    usage = b'data: {"choices":[],"usage":' + json.dumps(decode_usage).encode() + b'}\n\ndata: [DONE]\n\n'
    out = rewrite_usage(token + usage, 16)
    assert out.startswith(token) and out.endswith(b"\n\ndata: [DONE]\n\n")
    t = StreamTally()
    t.scan_events(out, 1.0)
    assert t.usage["prompt_tokens_details"]["cached_tokens"] == 16 and t.usage["prompt_tokens"] == 100


def test_decisions_page_is_bounded_and_has_a_stable_cursor():
    log = NumberedLog(maxlen=50)
    for i in range(120):
        log.append({"request_id": f"r{i}"})

    def page(**q):
        return json.loads(decisions_page(log, {k: str(v) for k, v in q.items()}).body)

    first = page(limit=10)
    assert [d["seq"] for d in first["decisions"]] == list(range(110, 120)) and first["total"] == 120
    assert first["decisions"][-1]["request_id"] == "r119"
    older = page(limit=10, before=first["next_before"])
    assert [d["seq"] for d in older["decisions"]] == list(range(100, 110))
    log.append({"request_id": "r120"})  # new decisions do not shift a cursor
    assert page(limit=10, before=first["next_before"])["decisions"] == older["decisions"]
    assert len(page(limit=10_000)["decisions"]) == MAX_PAGE // 2  # capped (and the log keeps 50)
    assert page(limit=10_000)["limit"] == MAX_PAGE
    last = page(limit=5, before=75)
    assert [d["seq"] for d in last["decisions"]] == [71, 72, 73, 74] and last["next_before"] is None
    assert page(before=10)["decisions"] == []
    for bad in ({"limit": 0}, {"limit": "x"}, {"before": -1}):
        with pytest.raises(RequestError):
            page(**bad)


@pytest.mark.parametrize("status, kind", [(405, "invalid_request_error"), (401, "invalid_request_error"),
                                          (413, "invalid_request_error"), (431, "invalid_request_error"),
                                          (404, "not_found_error"), (429, "rate_limit_error"), (500, "server_error")])
def test_error_types_follow_the_status(status, kind):
    assert json.loads(error_body(status, "m"))["error"]["type"] == kind
