import json

import pytest

from gateway.errors import RequestError
from gateway.requests import parse_body, slo_override
from gateway.streaming import StreamTally


def body(**kw):
    return json.dumps(kw).encode()


def test_unknown_fields_pass_through_untouched():
    raw = body(model="m", messages=[{"role": "user", "content": "x"}], top_k=7, vendor_thing={"a": [1]})
    req = parse_body(raw, "chat", 256)
    assert req.body["top_k"] == 7 and req.body["vendor_thing"] == {"a": [1]}
    assert req.max_tokens == 256 and req.stream is False


@pytest.mark.parametrize("raw, param", [
    (b"{not json", None),
    (b"[1,2]", None),
    (body(messages=[{"role": "user", "content": "x"}]), "model"),
    (body(model="m"), "messages"),
    (body(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=0), "max_tokens"),
    (body(model="m", messages=[{"role": "user", "content": "x"}], stream="yes"), "stream"),
    (body(model="m", messages=[{"role": "user", "content": "x"}], n=2), "n"),
])
def test_bad_bodies_are_400(raw, param):
    with pytest.raises(RequestError) as e:
        parse_body(raw, "chat", 16)
    assert e.value.status == 400 and e.value.param == param


def test_completions_need_prompt():
    with pytest.raises(RequestError):
        parse_body(body(model="m"), "completions", 16)
    assert parse_body(body(model="m", prompt="hi", max_tokens=3), "completions", 16).max_tokens == 3


def test_slo_headers():
    assert slo_override({}) is None
    slo = slo_override({"x-slo-ttft-ms": "250", "x-slo-tbt-ms": "50"})
    assert slo.ttft_s == pytest.approx(0.25) and slo.tbt_s == pytest.approx(0.05)
    with pytest.raises(RequestError):
        slo_override({"x-slo-ttft-ms": "soon"})


def test_tally_counts_content_chunks_not_role_chunks():
    t = StreamTally()
    role = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    tok = b'data: {"choices":[{"delta":{"content":"ab"}}]}\n\n'
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2}}\n\ndata: [DONE]\n\n'
    t.scan_events(role, 1.0)
    assert t.token_times == []
    t.scan_events(tok + tok, 2.0)
    t.scan_events(usage, 3.0)
    assert t.token_times == [2.0, 2.0]
    assert t.usage["completion_tokens"] == 2
