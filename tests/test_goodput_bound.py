"""The attainment bound (loadgen/simulate/bound.py): its LP on hand-built instances with known
optima, its cost decomposition against the engine's step timer, and soundness against real
simulated runs (no request beats its least TTFT; no policy beats the bound)."""
from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest

from engines_adapters.sim.profiles import load_profile
from engines_adapters.sim.timing import chunk_ctx
from loadgen.arrivals import sped_up
from loadgen.simulate.bound import (
    Segments,
    attainment_bound,
    decode_work,
    lp_bound,
    prefill_wall,
    shared_prefixes,
    shared_segments,
    step_costs,
)
from loadgen.simulate.cluster import ClusterSpec, SchedulerSpec
from loadgen.simulate.reuse import prompt_blocks
from loadgen.simulate.run import simulate
from loadgen.workload import BUNDLED_TRACES, read_trace
from predictors.telemetry import SLO

GAP = "llama3-70b-a800x8-gap"


def lp(arrivals, ends, work, instances, slot):
    return lp_bound(np.array(arrivals, float), np.array(ends, float), np.array(work, float), instances, slot)


def test_lp_fills_capacity_with_the_cheapest_work():
    # one instance, two 1 s slots: B (1 s) whole, then half of A (2 s)
    r = lp([0.0, 0.0], [2.0, 2.0], [2.0, 1.0], 1, 1.0)
    assert r["optimum"] == pytest.approx(1.5)
    assert r["x"][1] == pytest.approx(1.0) and r["x"][0] == pytest.approx(0.5)


def test_lp_respects_windows_and_one_instance_at_a_time():
    # three 1 s requests, two in slot 0 and one in slot 1, one instance: 2 fit
    assert lp([0.0, 0.0, 1.0], [1.0, 1.0, 2.0], [1, 1, 1], 1, 1.0)["optimum"] == pytest.approx(2.0)
    # 2 s of work in a 1 s window: 4 idle instances do not help (a prefill runs on one at a time)
    assert lp([0.0], [1.0], [2.0], 4, 1.0)["optimum"] == pytest.approx(0.5)
    # a window partly overlapping slots works in them only while it overlaps them: [0.5, 1.2] holds
    # 0.7 s of work (the first request, without a window, only sets the grid's origin)
    assert lp([0.0, 0.5], [0.0, 1.2], [1.0, 1.4], 1, 1.0)["optimum"] == pytest.approx(0.5)


def test_lp_gives_no_share_to_a_request_without_a_window_or_with_infinite_work():
    r = lp([0.0, 0.0, 0.0], [-1.0, 1.0, 1.0], [0.1, math.inf, 0.1], 1, 1.0)
    assert list(r["x"]) == pytest.approx([0.0, 0.0, 1.0])


def test_unreachable_request_gets_nothing():
    prof = load_profile(GAP)
    long_prompt = 100_000  # ~15 s of prefill alone on 8 x A800: over a 5 s SLO on any instance
    blocks = [(long_prompt, list(range(1, long_prompt // 16 + 1))), (500, list(range(10**7, 10**7 + 31)))]
    r = attainment_bound([0.0, 0.0], blocks, prof, prefill=8, ttft_s=5.0)
    assert r["unreachable"] == 1
    assert r["least_ttft_s"][0] > 5.0 > r["least_ttft_s"][1]
    assert r["x"][0] == 0.0 and r["x"][1] == pytest.approx(1.0)
    assert r["attainment_bound"] == pytest.approx(0.5)
    # a later request extending it: its prefix is cached no earlier than the first could compute it
    shared = [(long_prompt, blocks[0][1]), (long_prompt + 16, [*blocks[0][1], 999])]
    r = attainment_bound([0.0, 1.0], shared, prof, prefill=8, ttft_s=5.0)
    assert r["unreachable"] == 2
    alone = prefill_wall(step_costs(prof), long_prompt, 0)  # ~25 s
    assert alone - 1.0 - 0.2 < r["least_ttft_s"][1] < r["least_ttft_s"][0]
    # ... but 40 s later, all of it may be cached: only its last block is left to compute
    r = attainment_bound([0.0, 40.0], shared, prof, prefill=8, ttft_s=5.0)
    assert r["unreachable"] == 1 and r["least_ttft_s"][1] < 1.0 and r["x"][1] == pytest.approx(1.0)


def test_shared_prefixes_earlier_and_within_the_deadline():
    a, b, c = [1, 2, 3], [1, 2, 9], [1, 7]
    earlier, window, holders = shared_prefixes([a, b, c], [0.0, 1.0, 10.0], [5.0, 6.0, 15.0])
    assert earlier == [0, 2, 1]
    assert window == [2, 2, 1]  # a may reuse b's prefix (b arrives before a's deadline)
    assert holders == [[], [(2, 0)], [(1, 0)]]


def test_shared_segments_cut_a_holders_tokens_where_later_prefixes_end():
    # a holds blocks 1-4 first; b shares its first two, c its first three (16-token blocks)
    a, b, c = [1, 2, 3, 4], [1, 2, 9], [1, 2, 3, 7]
    earlier, _, holders = shared_prefixes([a, b, c], [0.0, 1.0, 2.0], [5.0, 6.0, 7.0])
    private, segments, needs, chain = shared_segments([64, 48, 64], earlier, holders, 16)
    assert segments == [(0, 0, 32), (0, 32, 48)]  # a's tokens 0-31 (b and c need them), 32-47 (c)
    assert private == [48, 32, 48]  # each request's own work starts there
    assert sorted(needs) == [(0, 1), (1, 0), (2, 1)]  # a needs all of its shared tokens
    assert chain == [(1, 0)]  # needing 32-47 needs 0-31


def _segments(starts, ends, work, needs, chain=()):
    return Segments(np.array(starts, float), np.array(ends, float), np.array(work, float),
                    np.array(needs, np.int64).reshape(-1, 2), np.array(chain, np.int64).reshape(-1, 2))


def test_lp_pays_a_shared_segment_once_for_whoever_needs_it():
    # h and its follow-up i share a 2 s prefix; a and b take 1 s each; one instance, 2 s
    arrivals, ends = np.zeros(4), np.full(4, 2.0)
    first_holder = lp_bound(arrivals, ends, np.array([2.0, 0.0, 1.0, 1.0]), 1, 1.0)
    assert first_holder["optimum"] == pytest.approx(3.0)  # i served free, its prefix never computed
    once = lp_bound(arrivals, ends, np.array([0.0, 0.0, 1.0, 1.0]), 1, 1.0,
                    shared=_segments([0.0], [2.0], [2.0], [(0, 0), (1, 0)]))
    assert once["optimum"] == pytest.approx(2.0)  # the prefix (h and i) or a and b
    # a request needing a chain's second segment needs the first: 1.5 s for 2 s of prefix
    one = np.zeros(1)
    chained = lp_bound(one, np.full(1, 1.5), one, 1, 0.5,
                       shared=_segments([0.0, 0.0], [1.5, 1.5], [1.0, 1.0], [(0, 1)], [(1, 0)]))
    assert chained["optimum"] == pytest.approx(0.75)
    unchained = lp_bound(one, np.full(1, 1.5), one, 1, 0.5, shared=_segments([0.0, 0.0], [1.5, 1.5], [1.0, 1.0],
                                                                              [(0, 1)]))
    assert unchained["optimum"] == pytest.approx(1.0)


def test_a_refused_holders_prefix_is_not_free_to_its_follow_up():
    """A 20k-token prompt, a follow-up extending it and 30 distinct 2k-token prompts at once, one
    instance, TTFT 5 s: the first-holder accounting serves the follow-up for its last block alone;
    paid once, it costs the prefix, and the bound is the lower of the two."""
    prof = load_profile(GAP)
    h = list(range(1, 1251))
    blocks = [(20000, h), (20016, [*h, 5000])] + [(2000, list(range(10**6 * k, 10**6 * k + 125))) for k in range(1, 31)]
    r = attainment_bound([0.0] * len(blocks), blocks, prof, prefill=1, ttft_s=5.0)
    acc = r["accounting"]
    assert acc["paid_once"] < acc["first_holder"] - 0.5 / len(blocks)
    assert r["attainment_bound"] == min(acc.values())
    assert r["x"][0] == pytest.approx(0.0, abs=1e-9) and r["x"][1] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("name", ["llama3-70b-a800x8-gap", "llama3-8b-h200-gap", "llama3-70b-a800x8"])
def test_costs_never_exceed_the_step_timer(name):
    """Every step of random prefill chunks lasts at least the sum of its chunks' work shares, and at
    least each chunk's own lone-chunk-plus-densest-attention share (what prefill_wall sums)."""
    c = step_costs(load_profile(name), 8192)
    rng = random.Random(0)
    for _ in range(300):
        chunks, room = [], 8192
        while room > 0 and len(chunks) < rng.randint(1, 6):
            n = rng.randint(1, room)
            chunks.append((n, rng.choice([0, rng.randint(0, 120_000)])))
            room -= n
        sampled = rng.randint(0, len(chunks))
        tokens = sum(n for n, _ in chunks)
        ctx = sum(chunk_ctx(start, n) for n, start in chunks)
        step = c.timer.duration(tokens, sampled, ctx, 0, tokens)
        work = sum(n * c.token_s + c.ctx_s * chunk_ctx(start, n) for n, start in chunks) + sampled * c.sample_s
        assert work <= step * (1 + 1e-12)
        for n, start in chunks:
            assert c.chunk_s + n * c.chunk_token_s + c.attention(chunk_ctx(start, n)) <= step * (1 + 1e-12)


@pytest.mark.parametrize("name", ["llama3-8b-h200", "llama3-8b-h200-gap", "llama3-70b-a800x8"])
def test_decode_work_never_exceeds_the_step_timer(name):
    """A decode step of random sequences lasts at least the sum of their tokens' decode shares, so
    summing a request's steps (decode_work) never exceeds the time its tokens take."""
    c = step_costs(load_profile(name), 8192)
    rng = random.Random(1)
    for _ in range(300):
        ctxs = [rng.randint(1, 100_000) for _ in range(rng.randint(1, 256))]
        step = c.timer.duration(len(ctxs), len(ctxs), 0.0, sum(ctxs), 0)
        assert sum(c.token_s + c.sample_s + c.kv_s * x for x in ctxs) <= step * (1 + 1e-12)
    # a request's tokens after the first read contexts prompt + 1 .. prompt + output - 1
    assert decode_work(c, 1000, 4) == pytest.approx(3 * (c.token_s + c.sample_s) + c.kv_s * (1001 + 1002 + 1003))
    assert decode_work(c, 1000, 1) == 0.0


def test_lp_decode_pool_is_shared_by_the_served_fraction():
    # prefill is free room for both; one decode instance has 1 s for 2 s of decode work: one request
    arrivals, ends, work = np.zeros(2), np.full(2, 1.0), np.full(2, 0.1)
    assert lp_bound(arrivals, ends, work, 2, 1.0)["optimum"] == pytest.approx(2.0)
    decode = (np.zeros(2), np.full(2, 1.0), np.full(2, 1.0), 1)
    assert lp_bound(arrivals, ends, work, 2, 1.0, decode=decode)["optimum"] == pytest.approx(1.0)
    # a later window for the second request's decode: both fit
    decode = (np.array([0.0, 1.0]), np.array([1.0, 2.0]), np.full(2, 1.0), 1)
    assert lp_bound(arrivals, ends, work, 2, 1.0, decode=decode)["optimum"] == pytest.approx(2.0)


def test_decode_pool_binds_a_decode_heavy_burst():
    """200 distinct 8000-token prompts at once with 2000-token outputs, one decode instance: the
    decode work (~0.75 s each) over the window [first token, 5 s + 1999 x 20 ms] caps the bound."""
    prof = load_profile("llama3-8b-h200")
    blocks = [(8000, list(range(i * 1000, i * 1000 + 500))) for i in range(200)]
    kw = dict(prefill=8, ttft_s=5.0)
    alone = attainment_bound([0.0] * 200, blocks, prof, **kw)
    both = attainment_bound([0.0] * 200, blocks, prof, decode=1, outputs=[2000] * 200, tbt_s=0.02, **kw)
    c = step_costs(prof)
    cap = (5.0 + 1999 * 0.02) / decode_work(c, 8000, 2000) / 200  # one instance's whole window
    assert both["attainment_bound"] < alone["attainment_bound"]
    assert both["attainment_bound"] <= cap * 1.01
    with pytest.raises(ValueError, match="output tokens"):
        attainment_bound([0.0], blocks[:1], prof, decode=1, **kw)


@pytest.fixture(scope="module")
def conversation():
    w = read_trace(str(BUNDLED_TRACES / "mooncake_conversation_trace.jsonl"), limit=150)
    return sped_up(w, 2.0)


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_no_simulated_policy_beats_the_bound(conversation, noise):
    """conductor and round robin on a simulated 2P+2D gap cluster: no request's TTFT is below its
    least TTFT, and no run's attainment above the bound (noise on: steps at -4 sigma)."""
    slo = SLO(5.0, None)
    spec = ClusterSpec(prefill=2, decode=2, profile=GAP, noise=noise,
                       engine={"max_num_batched_tokens": 8192, "max_num_seqs": 256, "host_tier_tokens": 0})
    prof = load_profile(GAP)
    sigma = math.hypot(noise, prof.efficiency["extra_noise"]) if noise else 0.0
    blocks = list(prompt_blocks(conversation, 16, "chat", "sim"))
    b = attainment_bound([r.arrival_s for r in conversation.requests], blocks, prof, prefill=2, ttft_s=5.0,
                         noise_sigma=sigma, noise_z=4.0)
    with_decode = attainment_bound([r.arrival_s for r in conversation.requests], blocks, prof, prefill=2, ttft_s=5.0,
                                   noise_sigma=sigma, noise_z=4.0, decode=2, tbt_s=0.2,
                                   outputs=[r.output_length for r in conversation.requests])
    index = {f"sim-r{r.index}": i for i, r in enumerate(conversation.requests)}
    for policy in ("conductor", "round_robin"):
        run = simulate(conversation, dataclasses.replace(spec), SchedulerSpec(policy=policy, slo=SLO(5.0, 0.2)),
                       progress=None, salt="sim")
        done = [r for r in run.records if r.ttft_s is not None]
        assert done, "the run served nothing: the check would be empty"
        assert all(r.ttft_s >= b["least_ttft_s"][index[r.request_id]] for r in done)
        attained = sum(r.meets(slo) for r in run.records) / len(conversation.requests)
        assert 0 < attained <= b["attainment_bound"] == min(b["accounting"].values())
        assert set(b["accounting"]) == {"first_holder", "paid_once"}  # the slice shares prefixes
        both = sum(r.meets(SLO(5.0, 0.2)) for r in run.records) / len(conversation.requests)
        assert 0 < both <= with_decode["attainment_bound"] <= b["attainment_bound"] + 1e-9


@pytest.mark.slow
def test_no_simulated_policy_beats_the_paid_once_bound():
    """Where paid once is the lower accounting (300 conversation requests at 4x on 2P+2D, TTFT 5 s):
    conductor with the wait room (a shared prefix costed once among waiters), prefix_only and round
    robin, noise off, stay under it, and no request beats its least TTFT."""
    w = sped_up(read_trace(str(BUNDLED_TRACES / "mooncake_conversation_trace.jsonl"), limit=300), 4.0)
    prof = load_profile(GAP)
    b = attainment_bound([r.arrival_s for r in w.requests], list(prompt_blocks(w, 16, "chat", "sim")), prof,
                         prefill=2, ttft_s=5.0)
    assert b["accounting"]["paid_once"] < b["accounting"]["first_holder"]
    spec = ClusterSpec(prefill=2, decode=2, profile=GAP, noise=0.0,
                       engine={"max_num_batched_tokens": 8192, "max_num_seqs": 256, "host_tier_tokens": 0})
    index = {f"sim-r{r.index}": i for i, r in enumerate(w.requests)}
    room = {"defer": True, "defer_share": True, "defer_join": True}
    for policy, params in (("conductor", room), ("prefix_only", {}), ("round_robin", {})):
        run = simulate(w, dataclasses.replace(spec), SchedulerSpec(policy=policy, policy_params=params,
                                                                   slo=SLO(5.0, 0.2)), progress=None, salt="sim")
        done = [r for r in run.records if r.ttft_s is not None]
        assert done and all(r.ttft_s >= b["least_ttft_s"][index[r.request_id]] for r in done)
        attained = sum(r.meets(SLO(5.0, None)) for r in run.records) / len(w.requests)
        print(policy, attained, b["accounting"])  # shown with pytest -rP
        assert 0 < attained <= b["attainment_bound"], policy
