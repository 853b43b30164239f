"""bench/experiments/siblings.py: unserved requests split by a sibling sharing their prefix, the
served share by uncached tokens, and the prefill instances' busy share, read from a run's records."""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "experiments"))  # siblings imports _common and friends by name

import siblings as S  # noqa: E402


def _req(index, arrival, hash_ids, block=512):
    return SimpleNamespace(index=index, arrival_s=arrival, hash_ids=hash_ids, input_length=block * len(hash_ids))


def _rec(status, ttft=None, prompt=1000, hit=0, start=None, end=None, inst="p0", arrival=0.0):
    return {"status": status, "ttft_s": ttft, "prompt_tokens": prompt, "hit_tokens": hit, "arrival_s": arrival,
            "prefill_start_s": start, "prefill_end_s": end, "prefill_instance": inst}


def test_unserved_requests_are_split_by_their_siblings():
    reqs = [_req(0, 0.0, [1, 2, 3, 4]), _req(1, 8.0, [1, 2, 3, 5]),  # a pair, neither served
            _req(2, 0.0, [7, 8, 9, 10]), _req(3, 4.0, [7, 8, 9, 11]),  # a pair, one served
            _req(4, 0.0, [20, 21, 22, 23, 24]), _req(5, 1.0, [20, 21, 30, 31, 32]),  # 2 of 5 blocks shared
            _req(6, 0.0, [40, 41]), _req(7, 100.0, [40, 41, 42])]  # too far apart at load 1, SLO 30
    recs = {0: _rec("rejected"), 1: _rec("rejected"), 2: _rec("ok", 3.0), 3: _rec("rejected"),
            4: _rec("ok", 40.0), 5: _rec("rejected"), 6: _rec("rejected"), 7: _rec("ok", 1.0)}
    got = S.siblings(reqs, recs, load=1.0, ttft=30.0)
    assert got["shares half or more, no sibling served"] == 2  # 0 and 1
    assert got["shares half or more, a sibling served"] == 1  # 3 (2 served)
    assert got["shares no prefix"] == 1  # 6: its sibling arrives 100 s later
    # 4 was served late (TTFT 40 s > 30 s), so it counts as unserved; it and 5 share 2 of 5 blocks
    assert got["shares under half its prompt"] == 2 and sum(got.values()) == 6


def test_served_by_uncached_tokens_and_busy_share():
    recs = [_rec("ok", 1.0, prompt=5000, hit=4000, start=0.0, end=10.0),  # 1000 uncached
            _rec("ok", 50.0, prompt=9000, start=5.0, end=20.0),  # late
            _rec("rejected", prompt=20000, arrival=10.0)]
    bins = {lo: (n, served) for lo, _, n, served in S.by_uncached(recs, 30.0)}
    assert bins[0] == (1, 1) and bins[8000] == (1, 0) and bins[16000] == (1, 0)
    # one instance busy 0-20 s of [0, last arrival 10 + SLO 30]
    assert S.busy(recs, 30.0) == {"p0": 0.5}
