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
    from predictors.telemetry import SLO

    assert slo_override({}, SLO(30.0, 0.2)) is None
    slo = slo_override({"x-slo-ttft-ms": "250", "x-slo-tbt-ms": "50"}, SLO(30.0, 0.2))
    assert slo.ttft_s == pytest.approx(0.25) and slo.tbt_s == pytest.approx(0.05)
    with pytest.raises(RequestError):
        slo_override({"x-slo-ttft-ms": "soon"}, SLO(30.0, 0.2))


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


def test_tally_tells_the_first_token_once_not_the_role_chunk():
    """The first content chunk tells the ledger the decode engine admitted the request (its
    ``kv_share`` learns from those); the role chunk an engine sends before any token does not."""
    seen: list[int] = []
    t = StreamTally(on_first=lambda: seen.append(len(t.token_times)))
    t.scan_events(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n', 1.0)
    assert seen == []
    tok = b'data: {"choices":[{"delta":{"content":"ab"}}]}\n\n'
    t.scan_events(tok + tok, 2.0)
    t.scan_events(tok, 3.0)
    assert seen == [0]  # once, before its tokens were counted


def test_nulls_mean_defaults_and_max_completion_tokens_wins():
    req = parse_body(body(model="m", messages=[{"role": "user", "content": "x"}], stream=None, n=None), "chat", 16)
    assert req.stream is False and req.max_tokens == 16
    req = parse_body(body(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=50,
                          max_completion_tokens=7), "chat", 16)
    assert req.max_tokens == 7  # vLLM takes max_completion_tokens over max_tokens


def test_prefill_leg_body():
    from engines_adapters.drivers.vllm import decode_body, prefill_body

    original = {"model": "m", "messages": [], "max_tokens": 50, "max_completion_tokens": 40, "min_tokens": 8,
                "stream": True, "stream_options": {"include_usage": True}, "top_k": 3}
    p = prefill_body(original)
    assert p["stream"] is False and p["max_tokens"] == 1 and p["max_completion_tokens"] == 1
    assert "min_tokens" not in p and "stream_options" not in p and p["top_k"] == 3
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    d = decode_body(original, {"remote_host": "h"})
    assert d["max_tokens"] == 50 and d["stream"] is True and d["kv_transfer_params"] == {"remote_host": "h"}
    assert "kv_transfer_params" not in original  # the client's body is never mutated


def test_metrics_parsing_sums_counts_and_takes_the_fullest_kv():
    from engines_adapters.drivers import parse_metrics

    text = "\n".join([
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 3',
        'vllm:num_requests_running{engine="1",model_name="m"} 4',
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.7',
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.4',
        ""])
    s = parse_metrics("vllm", text)
    assert (s.running, s.waiting) == (7, 2) and s.kv_usage == pytest.approx(0.7)
    old = parse_metrics("vllm", '# TYPE vllm:gpu_cache_usage_perc gauge\n'
                                'vllm:gpu_cache_usage_perc{model_name="m"} 0.5\n')
    assert old.kv_usage == pytest.approx(0.5)
    assert s.kv_capacity_tokens is None and old.kv_capacity_tokens is None  # not published: unknown


def test_metrics_parsing_reads_the_kv_capacity_from_cache_config_info():
    from engines_adapters.drivers.vllm import parse_vllm_metrics

    info = ('vllm:cache_config_info{block_size="%s",cache_dtype="auto",enable_prefix_caching="True",'
            'engine="%s",gpu_memory_utilization="0.9",num_cpu_blocks="0",num_gpu_blocks="%s"} 1.0')
    text = "\n".join(["# TYPE vllm:cache_config_info gauge", info % (16, 0, 1000), info % (16, 1, 500), ""])
    assert parse_vllm_metrics(text).kv_capacity_tokens == 24_000  # two DP engines' caches
    assert parse_vllm_metrics(info % (16, 0, "None") + "\n").kv_capacity_tokens is None  # before profiling


def test_in_band_engine_error_is_not_a_success():
    t = StreamTally()
    t.scan_events(b'data: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n', 1.0)
    assert t.error and t.done


def test_load_polls_read_the_same_sample_from_a_whole_metrics_page_as_the_full_parser():
    """The parsers filter a page down to the gauges they read before parsing it: on a page of
    histograms, counters, several DP engines, lookalike names and label values holding spaces,
    braces and escaped quotes, the sample equals the one the whole page parsed gives."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from engines_adapters.drivers import sglang, vllm

    def page(prefix: str, gauges: list[str]) -> str:
        r = CollectorRegistry()
        labels = ["model_name", "engine"]
        values = [("m {odd}", "0"), ('q"uote\\d', "1")]
        for i, name in enumerate(gauges):
            g = Gauge(name, "doc", labels, registry=r)
            for j, lv in enumerate(values):
                g.labels(*lv).set(i + 1 + j)
            look = Gauge(name + "_lookalike", "doc", labels, registry=r)  # a longer name, never read
            look.labels(*values[0]).set(1000)
        h = Histogram(prefix + "time_to_first_token_seconds", "doc", labels, registry=r)
        c = Counter(prefix + "prompt_tokens", "doc", labels, registry=r)
        for lv in values:
            for x in (0.01, 0.3, 7.0):
                h.labels(*lv).observe(x)
            c.labels(*lv).inc(123)
        return generate_latest(r).decode()

    text = page("vllm:", ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"])
    text += ('vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0\n'
             'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="50"} 1.0\n')
    stext = page("sglang:", ["sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                             "sglang:max_total_num_tokens", "sglang:num_decode_prealloc_queue_reqs",
                             "sglang:num_decode_transfer_queue_reqs"])
    filtered = vllm.parse_vllm_metrics(text), sglang.parse_sglang_metrics(stext)
    assert (filtered[0].running, filtered[0].waiting, filtered[0].kv_capacity_tokens) == (3, 5, 2400)
    assert (filtered[1].running, filtered[1].kv_usage) == (3, 4)
    whole = pytest.MonkeyPatch()
    whole.setattr(vllm, "_LOAD_SAMPLES", lambda t: t)
    whole.setattr(sglang, "_LOAD_SAMPLES", lambda t: t)
    try:
        assert filtered == (vllm.parse_vllm_metrics(text), sglang.parse_sglang_metrics(stext))
    finally:
        whole.undo()
