"""The runner against a target with known, fixed TTFT and inter-token delays (its own process on
a free loopback port): what it measures must agree with what the target does."""
import asyncio
import json
import statistics

import pytest

from engines_adapters.net import free_port
from loadgen.fixed_target import spawn
from loadgen.metrics import summarize
from loadgen.prompts import ENDPOINTS, PromptSynth, build_body
from loadgen.runner import RunnerOptions, Send, TargetUnreachable, probe, run_sends
from loadgen.workload import Request
from predictors.telemetry import SLO

# starts real servers or subprocesses: `make test-fast` skips these
pytestmark = pytest.mark.slow

TTFT, ITL = 0.080, 0.020


@pytest.fixture(scope="module")
def fixed():
    with spawn("--ttft-ms", str(TTFT * 1000), "--itl-ms", str(ITL * 1000), "--eos-after", "3") as url:
        yield url


def sends(arrivals, n_out=10, n_in=700, endpoint="chat", fmt="text"):
    synth = PromptSynth(salt="t")
    out = []
    k = -(-n_in // 512)
    for i, t in enumerate(arrivals):
        r = Request(i, t, n_in, n_out, tuple(range(i * k, i * k + k)))
        body, n = build_body(r, synth, model="fixed-model", endpoint=endpoint, prompt_format=fmt)
        out.append(Send(r, json.dumps(body).encode(), n, f"r{i}"))
    return out


def run(url, ss, **kw):
    kw.setdefault("path", ENDPOINTS["chat"])
    return asyncio.run(run_sends(url, ss, RunnerOptions(**kw)))


def test_measured_ttft_and_gaps_agree_with_the_target(fixed):
    n_out = 30
    res = run(fixed, sends([0.1 * i for i in range(12)], n_out=n_out))
    assert [r.status for r in res.records] == ["ok"] * 12
    for r in res.records:
        # the role-only chunk comes at once: TTFT counts to the first content token
        assert TTFT - 0.002 <= r.ttft_s <= TTFT + 0.030
        assert r.output_tokens == n_out == r.extra["content_chunks"]  # ignore_eos was sent: no early stop
        assert len(r.intervals) == n_out - 1
        assert statistics.median(r.intervals) == pytest.approx(ITL, abs=0.004)
        assert r.tpot_s == pytest.approx(ITL, abs=0.004)  # absolute deadlines: no drift
        assert ITL - 0.003 <= r.tbt_s <= ITL + 0.020
        assert r.e2e_s == pytest.approx(r.ttft_s + (n_out - 1) * ITL, abs=0.03)
        assert r.extra["usage_prompt_tokens"] == r.prompt_tokens == 700  # exact through a real server
        assert (r.prefill_instance, r.decode_instance, r.http_status) == ("prefill-0", "decode-0", 200)
    s = summarize(res.records, SLO(ttft_s=TTFT + 0.05, tbt_s=ITL + 0.02))
    assert s["slo_attainment"] == 1.0 and s["prompt_tokens"]["requests_mismatched"] == 0
    assert s["itl_s"]["p50"] == pytest.approx(ITL, abs=0.004)


def test_completions_with_token_ids(fixed):
    res = run(fixed, sends([0.0, 0.05], n_out=5, n_in=1000, endpoint="completions", fmt="token-ids"),
              path=ENDPOINTS["completions"])
    for r in res.records:
        assert r.status == "ok" and r.output_tokens == 5
        assert r.extra["usage_prompt_tokens"] == 1000
        assert TTFT - 0.002 <= r.ttft_s <= TTFT + 0.030


def test_open_loop_sends_on_time_whatever_the_target_does(fixed):
    """40 requests in 0.5 s while each takes over 0.2 s: arrivals never wait for completions."""
    arrivals = [i * 0.0125 for i in range(40)]
    res = run(fixed, sends(arrivals, n_out=8))
    assert all(r.status == "ok" for r in res.records)
    # open loop: no send waited for an answer, so every send's lateness is below the shortest TTFT
    # measured in this same run (a closed loop would delay later sends by at least one)
    late = [r.sent_s - r.arrival_s for r in res.records]
    assert max(late) < min(r.ttft_s for r in res.records)
    first_done = min(r.end_s for r in res.records)
    assert sum(r.sent_s < first_done for r in res.records) >= 10  # many in flight before any answer ended
    assert len(res.send_lags_s) == 40 and len(res.loop_lags_s) > 10


def test_max_concurrency_queues_at_the_client(fixed):
    res = run(fixed, sends([0.0] * 6, n_out=2), max_concurrency=2)
    waits = sorted(r.extra["queue_wait_s"] for r in res.records)
    assert all(r.status == "ok" for r in res.records)
    one = TTFT + ITL  # one request's time in the target
    assert waits[0] < 0.02 and waits[-1] == pytest.approx(2 * one, abs=0.06)  # third wave waited two turns


def test_no_usage_counts_content_chunks():
    with spawn("--ttft-ms", "10", "--itl-ms", "2", "--no-usage") as url:
        res = run(url, sends([0.0, 0.0], n_out=17))
    for r in res.records:
        assert r.status == "ok" and r.output_tokens == 17 and "usage_prompt_tokens" not in r.extra


def test_a_server_that_ignores_stream_still_counts():
    with spawn("--ttft-ms", "30", "--itl-ms", "5", "--never-stream") as url:
        res = run(url, sends([0.0], n_out=9))
    (r,) = res.records
    assert r.status == "ok" and r.output_tokens == 9 and r.extra["streamed"] is False
    assert r.ttft_s == pytest.approx(r.e2e_s) and r.ttft_s >= 0.03 + 8 * 0.005 - 0.002  # the whole answer at once


def test_rejections_and_errors_are_kept_apart():
    with spawn("--ttft-ms", "200", "--itl-ms", "5", "--max-inflight", "2", "--error-every", "4") as url:
        res = run(url, sends([0.0] * 3 + [0.05] * 5, n_out=3))
    by = {}
    for r in res.records:
        by.setdefault(r.status, []).append(r)
    assert len(by["ok"]) == 2 and len(by["error"]) == 2 and len(by["rejected"]) == 4
    for r in by["rejected"]:
        assert r.http_status == 429 and r.retry_after_s == 1.0 and r.reject_reason == "overload: in-flight cap"
    for r in by["error"]:
        assert r.http_status == 500 and r.error == "HTTP 500: injected failure"
    s = summarize(res.records, SLO())
    assert (s["completed"], s["rejected"], s["errors"], s["slo_attainment"]) == (2, 4, 2, 0.25)
    assert s["reject_reasons"] == {"overload: in-flight cap": 4}


def test_timeout_is_its_own_status():
    with spawn("--ttft-ms", "3000") as url:
        res = run(url, sends([0.0], n_out=2), timeout_s=0.4)
    (r,) = res.records
    assert r.status == "timeout" and 0.35 < r.end_s - r.sent_s < 1.5


def test_probe_and_dead_target_abort_quickly(fixed):
    assert asyncio.run(probe(fixed)) == (200, ["fixed-model"])
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TargetUnreachable, match=rf"^target {dead} unreachable: "):
        asyncio.run(probe(dead, timeout_s=1))
    res = run(dead, sends([i * 0.01 for i in range(30)], n_out=2), abort_after_connect_errors=5)
    statuses = [r.status for r in res.records]
    assert res.aborted and "unreachable" in res.aborted
    assert statuses.count("error") >= 5 and statuses.count("aborted") >= 10
    assert all(r.error.startswith("connect:") for r in res.records if r.status == "error")

# The client's send lag and CPU at 50 req/s are wall-clock figures of the machine: bench/loadgen_lag.py
# prints them (docs/loadgen.md has the documented runs).
