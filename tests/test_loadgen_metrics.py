"""Attainment, goodput, percentiles and effective capacity on hand-built cases."""
import random

import numpy as np
import pytest

from loadgen.metrics import describe_capacity, effective_capacity, percentile, summarize
from loadgen.sweep import compare
from predictors.telemetry import SLO, RequestRecord


def ok(i, arrival, ttft, gaps, tokens=None):
    """A finished request sent at ``arrival`` with the given TTFT and token gaps."""
    times = [arrival + ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord(f"r{i}", arrival_s=arrival, sent_s=arrival, first_token_s=times[0], token_times=times,
                         end_s=times[-1], status="ok", output_tokens=tokens or len(times), prompt_tokens=100)


def test_percentile_matches_numpy():
    rng = random.Random(1)
    for n in (1, 2, 7, 100):
        xs = [rng.expovariate(1) for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert percentile([], 50) is None


def test_attainment_and_goodput_by_hand():
    slo = SLO(ttft_s=1.0, tbt_s=0.1)
    recs = [ok(i, arrival=i, ttft=0.5, gaps=[0.05] * 9) for i in range(6)]  # meet both
    recs.append(ok(6, arrival=6, ttft=1.5, gaps=[0.05] * 9))  # TTFT miss
    recs.append(ok(7, arrival=7, ttft=0.2, gaps=[0.05] * 8 + [0.4]))  # slowest 10% of 9 gaps = 0.4: TBT miss
    recs.append(RequestRecord("rej", arrival_s=8, sent_s=8, end_s=8.01, status="rejected", reject_reason="ttft",
                              http_status=429))
    recs.append(RequestRecord("err", arrival_s=9, sent_s=9, end_s=9.5, status="error", error="HTTP 500: boom"))
    recs.append(RequestRecord("abt", arrival_s=19, status="aborted"))  # never sent: not in the denominator
    recs.append(ok(11, arrival=10, ttft=0.5, gaps=[0.05] * 9))  # the last to end: 10 + 0.5 + 9 * 0.05
    s = summarize(recs, slo)
    assert (s["requests"], s["completed"], s["rejected"], s["errors"], s["aborted"]) == (11, 9, 1, 1, 1)
    assert s["slo_met"] == 7
    assert s["slo_attainment"] == pytest.approx(7 / 11)
    duration = 10.95  # first arrival to the last response end (the aborted request never ran)
    assert s["duration_s"] == pytest.approx(duration)
    assert s["goodput_rps"] == pytest.approx(7 / duration)
    assert s["ttft_s"]["n"] == 9 and s["ttft_s"]["p50"] == pytest.approx(0.5)
    assert s["tbt_s"]["max"] == pytest.approx(0.4)
    assert s["reject_reasons"] == {"ttft": 1} and s["error_samples"] == ["HTTP 500: boom"]
    # without SLOs every completed request counts
    assert summarize(recs, SLO())["slo_attainment"] == pytest.approx(9 / 11)
    # an explicit duration wins
    assert summarize(recs, slo, duration_s=7.0)["goodput_rps"] == pytest.approx(1.0)


def test_tpot_and_itl_pool():
    r = ok(0, arrival=0, ttft=0.3, gaps=[0.1, 0.2, 0.3])
    s = summarize([r], SLO())
    assert s["tpot_s"]["p50"] == pytest.approx(0.2)  # (E2E - TTFT) / (tokens - 1)
    assert s["itl_s"]["n"] == 3 and s["itl_s"]["max"] == pytest.approx(0.3)
    assert s["e2e_s"]["p50"] == pytest.approx(0.9)


def test_an_ok_record_without_a_first_token_counts_as_a_miss_not_a_crash():
    """A lifecycle can finish "ok" with no token (a gateway's record of an empty answer): it has
    no TTFT, so it misses any SLO and is left out of the latency distributions."""
    recs = [ok(0, arrival=0, ttft=0.3, gaps=[0.1]),
            RequestRecord("empty", arrival_s=1, sent_s=1, status="ok", output_tokens=0, prompt_tokens=100)]
    s = summarize(recs, SLO(ttft_s=1.0))
    assert s["completed"] == 2 and s["slo_met"] == 1
    assert s["ttft_s"]["n"] == 1 and s["e2e_s"]["n"] == 1


def test_prompt_token_check_counts_mismatches():
    a, b = ok(0, 0, 0.1, [0.1]), ok(1, 1, 0.1, [0.1])
    a.extra["usage_prompt_tokens"] = 100
    b.extra["usage_prompt_tokens"] = 93
    p = summarize([a, b], SLO())["prompt_tokens"]
    assert (p["requests_checked"], p["requests_mismatched"], p["max_abs_error"]) == (2, 1, 7)


def test_effective_capacity_interpolates_the_first_crossing():
    cap = effective_capacity([1, 2, 4, 8], [1.0, 0.95, 0.85, 0.5], target=0.9)
    assert cap["method"] == "interpolated" and cap["between"] == [2, 4]
    assert cap["value"] == pytest.approx(3.0)  # 2 + 2 * (0.95 - 0.9) / (0.95 - 0.85)
    assert "interpolated" in describe_capacity(cap, "x")
    # unsorted input, a recovery after the first crossing does not count ("stays")
    cap = effective_capacity([8, 1, 4, 2, 16], [0.95, 1.0, 0.7, 0.9, 0.2])
    assert cap["between"] == [2, 4] and cap["value"] == pytest.approx(2.0)


def test_effective_capacity_bounds():
    assert effective_capacity([1, 2], [0.99, 0.97])["method"] == "lower_bound"
    assert effective_capacity([1, 2], [0.99, 0.97])["value"] == 2
    low = effective_capacity([1, 2], [0.5, 0.2])
    assert low["method"] == "below_range" and low["value"] is None
    assert effective_capacity([1, 2], [None, None])["method"] == "no_data"
    assert effective_capacity([1, 2, 3], [0.95, None, 0.85])["value"] == pytest.approx(2.0)


def test_compare_gives_candidate_over_baseline():
    def t(url, good, att, cap):
        return {"target": url, "effective_capacity": {"value": cap, "method": "interpolated"},
                "steps": [{"load": 1, "goodput_rps": good, "slo_attainment": att,
                           "ttft_s": {"p50": 0.2, "p90": 0.4, "p99": 0.0},
                           "tbt_s": {"p50": None, "p90": 0.1, "p99": 0.2}}]}
    c = compare(t("a", 2.0, 0.5, 4.0), t("b", 3.0, 1.0, 6.0))
    row = c["steps"][0]
    assert row["goodput_rps_ratio"] == pytest.approx(1.5) and row["slo_attainment_ratio"] == pytest.approx(2.0)
    assert row["ttft_s_p99_ratio"] is None and row["tbt_s_p50_ratio"] is None  # zero or missing baseline
    assert c["effective_capacity_ratio"] == pytest.approx(1.5)


def test_effective_capacity_averages_a_repeated_load():
    from loadgen.metrics import effective_capacity

    cap = effective_capacity([1, 2, 2, 4], [0.99, 0.97, 0.87, 0.5], 0.9)  # load 2 means 0.92
    assert cap["method"] == "interpolated" and cap["between"] == [2, 4]
    assert cap["value"] == pytest.approx(2 + 2 * (0.92 - 0.9) / (0.92 - 0.5))
