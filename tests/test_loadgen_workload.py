"""Trace readers, bad input, arrivals and synthetic workloads."""
import json
import math
import statistics
from datetime import datetime
from itertools import islice, pairwise
from pathlib import Path

import pytest

from loadgen.arrivals import arrival_times, rate_of, retimed, sped_up
from loadgen.synthetic import parse_dist, synthetic_workload, to_mooncake_jsonl
from loadgen.workload import TraceError, read_azure, read_mooncake, read_trace
from tests.traces import AZURE, MOONCAKE


def head(path: Path, n: int) -> list[str]:
    with open(path) as f:
        return list(islice(f, n))


def test_mooncake_slice_read_as_recorded(tmp_path):
    lines = head(MOONCAKE, 200)
    p = tmp_path / "t.jsonl"
    p.write_text("".join(lines))
    w = read_trace(str(p))
    assert w.kind == "mooncake" and w.skipped == 0 and len(w.requests) == 200
    raw = [json.loads(line) for line in lines]
    t0 = min(d["timestamp"] for d in raw)
    for r, d in zip(w.requests, sorted(raw, key=lambda d: d["timestamp"]), strict=True):
        assert r.arrival_s == pytest.approx((d["timestamp"] - t0) / 1000)
        assert (r.input_length, r.output_length, list(r.hash_ids)) == (d["input_length"], d["output_length"],
                                                                         d["hash_ids"])
    assert [r.index for r in w.requests] == list(range(200))


def test_limit_stops_reading_early():
    w = read_mooncake(str(MOONCAKE), limit=25)
    assert len(w.requests) == 25
    assert w.requests[-1].line == 25


def test_after_skips_a_prefix_renumbered_and_retimed_from_zero():
    whole = read_mooncake(str(MOONCAKE), limit=30)
    tail = whole.after(20)
    assert len(tail.requests) == 10 and [r.index for r in tail.requests] == list(range(10))
    assert tail.requests[0].arrival_s == 0 and [r.line for r in tail.requests] == list(range(21, 31))
    t20 = whole.requests[20].arrival_s
    for r, w in zip(tail.requests, whole.requests[20:], strict=True):
        assert r.arrival_s == pytest.approx(w.arrival_s - t20) and r.hash_ids == w.hash_ids
    assert whole.after(0) is whole
    with pytest.raises(TraceError, match="cannot skip 30 requests: only 30 were read"):
        whole.after(30)


def test_malformed_lines_skipped_and_counted_or_strict(tmp_path):
    good = head(MOONCAKE, 3)
    p = tmp_path / "bad.jsonl"
    p.write_text(good[0] + "{not json\n" + '{"timestamp": 5, "input_length": 600, "output_length": 3}\n'
                 + '{"timestamp": 6, "input_length": 600, "output_length": 3, "hash_ids": [0]}\n' + "\n" + good[1])
    warnings = []
    w = read_mooncake(str(p), warn=warnings.append)
    assert len(w.requests) == 2 and w.skipped == 3
    assert [m.split(": ")[0] for m in w.problems] == [f"{p}:2", f"{p}:3", f"{p}:4"]
    assert "not JSON" in w.problems[0] and "hash_ids" in w.problems[1] and "expected ceil(600/512) = 2" in w.problems[2]
    assert len(warnings) == 3
    with pytest.raises(TraceError, match=rf"^{p}:2: not JSON"):
        read_mooncake(str(p), strict=True)


def test_unreadable_and_empty_traces(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(str(tmp_path / "missing.jsonl"))
    (tmp_path / "junk.jsonl").write_text("x\ny\n")
    with pytest.raises(TraceError, match="no usable requests .*2 malformed"):
        read_trace(str(tmp_path / "junk.jsonl"))
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceError, match="not UTF-8"):
        read_trace(str(tmp_path / "bin.jsonl"))


def test_azure_slice_relative_times_and_unique_prompts(tmp_path):
    lines = head(AZURE, 51)
    p = tmp_path / "a.csv"
    p.write_text("".join(lines))
    w = read_trace(str(p))
    assert w.kind == "azure" and len(w.requests) == 50
    stamps = [datetime.strptime(line.split(",")[0][:26], "%Y-%m-%d %H:%M:%S.%f").timestamp() for line in lines[1:]]
    for r, t in zip(w.requests, sorted(stamps), strict=True):
        assert r.arrival_s == pytest.approx(t - min(stamps), abs=1e-5)
    ids = [h for r in w.requests for h in r.hash_ids]
    assert len(ids) == len(set(ids))  # no prefix information: no sharing
    assert all(len(r.hash_ids) == math.ceil(r.input_length / 512) for r in w.requests)


def test_azure_bad_rows_and_header(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,100,0\n"
                 "yesterday,5,5\n2023-11-16 18:17:04.5,abc,1\n2023-11-16 18:17:05,10\n")
    w = read_azure(str(p))
    assert len(w.requests) == 1 and w.requests[0].output_length == 1 and w.skipped == 3
    assert w.problems[0].startswith(f"{p}:3: bad TIMESTAMP")
    q = tmp_path / "h.csv"
    q.write_text("time,in,out\n1,2,3\n")
    with pytest.raises(TraceError, match=rf"{q}:1: expected header"):
        read_azure(str(q))


def test_speedup_divides_trace_time():
    w = read_mooncake(str(MOONCAKE), limit=100)
    fast = sped_up(w, 4)
    assert [r.arrival_s * 4 for r in fast.requests] == pytest.approx([r.arrival_s for r in w.requests])
    assert fast.span_s == pytest.approx(w.span_s / 4)


@pytest.mark.parametrize("process,cv", [("poisson", 1.0), ("gamma", 3.0), ("gamma", 0.5)])
def test_arrival_processes_have_the_asked_rate_and_burstiness(process, cv):
    t = arrival_times(6000, rate=20.0, process=process, cv=cv, seed=7)
    gaps = [b - a for a, b in pairwise(t)]
    assert t[0] == 0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / 20, rel=0.08)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(cv, rel=0.15)


def test_rate_replacement_keeps_order_and_requests():
    w = read_mooncake(str(MOONCAKE), limit=300)
    r = retimed(w, rate=50, seed=1)
    assert [(q.input_length, q.hash_ids) for q in r.requests] == [(q.input_length, q.hash_ids) for q in w.requests]
    assert rate_of(r.requests) == pytest.approx(50, rel=0.2)
    assert all(a.arrival_s <= b.arrival_s for a, b in pairwise(r.requests))


def test_multi_turn_context_grows_and_reuses_the_previous_turn():
    w = synthetic_workload(120, rate=5, input_tokens=parse_dist("uniform:100:400"), output_tokens=parse_dist("50"),
                           turns=4, turn_gap_s=2.0, shared_prefix_blocks=1, seed=3)
    assert len(w.requests) == 120
    assert all(a.arrival_s <= b.arrival_s for a, b in pairwise(w.requests))
    convs: dict[int, list] = {}
    for r in w.requests:
        convs.setdefault(r.conversation, []).append(r)
        assert r.hash_ids[0] == 0  # the shared system prompt block
        assert len(r.hash_ids) == math.ceil(r.input_length / 512)
    assert len(convs) == 30
    for turns in convs.values():
        assert [t.turn for t in turns] == list(range(len(turns)))  # turns arrive in order
        for a, b in pairwise(turns):
            new_user = b.input_length - a.input_length - a.output_length
            assert 100 <= new_user <= 400  # previous prompt + answer + a new message
            full = a.input_length // 512
            assert b.hash_ids[:full] == a.hash_ids[:full]  # the previous turn's blocks are reused
            assert b.hash_ids[:len(a.hash_ids)] == a.hash_ids  # the stream continues its partial block
    other = [t.hash_ids[1] for t in (c[0] for c in convs.values()) if len(t.hash_ids) > 1]
    assert len(other) == len(set(other))  # conversations share only the system prompt


def test_synthetic_roundtrips_as_a_mooncake_trace(tmp_path):
    w = synthetic_workload(40, rate=8, input_tokens=parse_dist("lognormal:900:0.4"), output_tokens=parse_dist("exp:30"),
                           turns=2, seed=5)
    p = tmp_path / "syn.jsonl"
    to_mooncake_jsonl(w, str(p))
    back = read_mooncake(str(p), strict=True)
    assert [(r.input_length, r.output_length, r.hash_ids) for r in back.requests] == \
        [(r.input_length, r.output_length, r.hash_ids) for r in w.requests]


@pytest.mark.parametrize("bad", ["", "x", "uniform:5", "uniform:9:3", "gauss:1:2", "exp:0", "-3"])
def test_bad_length_distributions(bad):
    with pytest.raises(ValueError):
        parse_dist(bad)


def test_length_distributions_sample_in_range():
    import random

    rng = random.Random(0)
    assert {parse_dist("7").sample(rng) for _ in range(10)} == {7}
    u = [parse_dist("uniform:10:20").sample(rng) for _ in range(2000)]
    assert min(u) == 10 and max(u) == 20
    ln = [parse_dist("lognormal:1000:0.5").sample(rng) for _ in range(4000)]
    assert statistics.median(ln) == pytest.approx(1000, rel=0.06)


def test_a_bad_byte_costs_one_line_not_the_run(tmp_path):
    from loadgen.workload import TraceError, read_mooncake

    good = '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
    p = tmp_path / "t.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + good.encode() + b'{"timestamp": 1, "x": "\xff"}\n' + good.encode())
    w = read_mooncake(str(p))
    assert len(w.requests) == 2 and w.skipped == 1 and f"{p}:2: not UTF-8" in w.problems[0]
    with pytest.raises(TraceError, match=r"t.jsonl:2: not UTF-8"):
        read_mooncake(str(p), strict=True)


def test_hash_ids_beyond_what_prompts_can_encode_are_a_line_error(tmp_path):
    from loadgen.workload import read_mooncake

    p = tmp_path / "t.jsonl"
    good = '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'
    p.write_text(good + '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [281474976710656]}\n')
    w = read_mooncake(str(p))
    assert len(w.requests) == 1 and f"{p}:2: hash_ids" in w.problems[0]


def test_azure_timestamps_are_utc_whatever_the_local_zone(tmp_path, monkeypatch):
    import time as _time

    from loadgen.workload import _parse_azure_time

    monkeypatch.setenv("TZ", "America/New_York")
    _time.tzset()
    try:
        assert _parse_azure_time("2023-11-16 18:17:03.5") == pytest.approx(1700158623.5)
    finally:
        monkeypatch.delenv("TZ")
        _time.tzset()
