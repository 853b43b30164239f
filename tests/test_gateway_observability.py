"""Tracing spans, telemetry records and timeouts of `conductor serve`, read from the outside."""
from __future__ import annotations

import json
import time

import pytest
import requests

from predictors.telemetry import RequestRecord
from tests.servers import gateway, stop

# starts real servers or subprocesses: `make test-fast` skips these
pytestmark = pytest.mark.slow


def test_spans_and_telemetry_record(tmp_path):
    telemetry = tmp_path / "telemetry.jsonl"
    cfg = (f'otel_exporter = "console"\ntelemetry_path = "{telemetry}"\n'
           "[embedded]\nprefill = 1\ndecode = 1\n")
    with gateway(cfg, log_dir=str(tmp_path)) as g:
        model = requests.get(g["url"] + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "trace me " * 40}], "max_tokens": 6,
                "ignore_eos": True, "stream": True}
        for _ in range(12):  # each client hangs up as soon as it has read [DONE]
            with requests.post(g["url"] + "/v1/chat/completions", json=body, stream=True) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line == b"data: [DONE]":
                        break
        # the last client hung up after [DONE], its stream may still be finishing in the gateway:
        # stop once nothing is in flight, not mid-way (a shutdown then ends it as an error)
        in_flight = 1.0
        for _ in range(600):  # bounded: 30 s
            metrics = requests.get(g["url"] + "/metrics", timeout=10).text
            in_flight = next(float(line.split()[-1]) for line in metrics.splitlines()
                             if line.startswith("conductor_requests_in_flight"))
            if in_flight == 0:
                break
            time.sleep(0.05)
        assert in_flight == 0
        stop(g["proc"])  # flushes the batch span processor
    spans = []
    log = (tmp_path / "gateway.log").read_text()
    for block in log.split("\n}\n"):
        start = block.find("{")
        if start >= 0 and '"name"' in block:
            try:
                spans.append(json.loads(block[start:] + "\n}"))
            except ValueError:
                continue
    records = [RequestRecord.from_dict(json.loads(line)) for line in telemetry.read_text().splitlines()]
    assert [r.status for r in records] == ["ok"] * 12  # a hang-up after [DONE] is not an abort
    rec = records[-1]
    # the last request's spans, found by its id and trace (not by export order)
    root = next(s for s in spans if s["name"] == "conductor.request"
                and s["attributes"]["conductor.request_id"] == rec.request_id)
    children = {s["name"]: s for s in spans if s["context"]["trace_id"] == root["context"]["trace_id"]
                and s is not root}
    assert set(children) == {"decide", "prefill", "transfer", "decode"}
    assert root["attributes"]["conductor.prefill"] == "prefill-1"
    assert root["attributes"]["conductor.actual_ttft_s"] > 0
    assert all(c["parent_id"] == root["context"]["span_id"] for c in children.values())
    assert rec.status == "ok" and rec.output_tokens == 6 and len(rec.token_times) == 6
    assert rec.prefill_instance == "prefill-1" and rec.decode_instance == "decode-1"
    assert rec.predicted_ttft_s > 0 and rec.ttft_s > 0
    assert rec.prefill_start_s <= rec.prefill_end_s <= rec.first_token_s <= rec.end_s


def test_upstream_timeout_before_first_byte_is_504():
    cfg = "upstream_first_byte_timeout_s = 0.05\n[slo]\nttft_ms = 600000\n[embedded]\nprefill = 1\ndecode = 1\n"
    with gateway(cfg) as g:
        model = requests.get(g["url"] + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "q" * 60000}], "max_tokens": 4}
        r = requests.post(g["url"] + "/v1/chat/completions", json=body)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "upstream_timeout"
        # the reservation was released
        view = requests.get(g["url"] + "/admin/cluster").json()
        assert all(i["active_requests"] == 0 and i["reserved_prefill_tokens"] == 0 for i in view["instances"])


def test_engine_tokenizer_mode_matches_builtin_hashing():
    """tokenizer = "engine" asks an engine's /tokenize; the sim engine's ids equal the built-in
    ones, so prefix routing works the same and the prompt length is exact."""
    with gateway('tokenizer = "engine"\n[embedded]\nprefill = 1\ndecode = 1\n') as g:
        model = requests.get(g["url"] + "/v1/models").json()["data"][0]["id"]
        text = "tokenize me remotely " * 50
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
        first = requests.post(g["url"] + "/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["prompt_tokens"] == len(f"<|user|>\n{text}\n<|assistant|>\n")
        bad = requests.post(g["url"] + "/v1/chat/completions",
                            json={"model": model, "messages": [{"role": "user", "content": 5}]})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_prompt"
