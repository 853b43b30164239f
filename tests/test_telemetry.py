import pytest

from predictors.telemetry import SLO, RequestRecord, mooncake_tbt, read_jsonl, write_jsonl


def test_mooncake_tbt_is_mean_of_slowest_tenth():
    gaps = [0.01] * 18 + [0.5, 0.3]
    assert mooncake_tbt(gaps) == pytest.approx(0.4)  # 2 slowest of 20
    assert mooncake_tbt([0.2, 0.1]) == pytest.approx(0.2)  # at least one interval
    assert mooncake_tbt([]) == 0.0


def test_derived_metrics_and_slo():
    r = RequestRecord("a", arrival_s=10.0, status="ok", output_tokens=3,
                      first_token_s=10.5, token_times=[10.5, 10.6, 10.9], end_s=10.9)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.intervals == pytest.approx([0.1, 0.3])
    assert r.tpot_s == pytest.approx(0.2)
    assert r.meets(SLO(ttft_s=1.0, tbt_s=0.31))
    assert not r.meets(SLO(ttft_s=0.4))
    assert not r.meets(SLO(tbt_s=0.2))
    r.status = "rejected"
    assert not r.meets(SLO())


def test_jsonl_roundtrip(tmp_path):
    r = RequestRecord("a", arrival_s=1.0, prompt_tokens=5, token_times=[1.1, 1.2], status="ok")
    p = tmp_path / "t.jsonl"
    assert write_jsonl(str(p), [r]) == 1
    (back,) = list(read_jsonl(str(p)))
    assert back == r
