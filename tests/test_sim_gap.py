"""The gap profiles: sim engine timing that departs from the roofline as measured hardware does,
while the public deployment (what the gateway schedules on) stays the plain one."""
from __future__ import annotations

import math
import random

import pytest

from engines_adapters.sim.model import EngineModel, SimRequest
from engines_adapters.sim.profiles import load_profile, profile_names
from engines_adapters.sim.timing import GAP_KEYS, StepTimer, chunk_ctx

GAPS = [n for n in profile_names() if n.endswith("-gap")]


def test_gap_profiles_exist_and_share_the_plain_public_deployment():
    assert {"llama3-8b-h200-gap", "llama3-70b-a800x8-gap"} <= set(GAPS)
    for name in GAPS:
        gap, plain = load_profile(name), load_profile(name.removesuffix("-gap"))
        assert gap.deployment == plain.deployment  # the gateway cannot tell them apart
        assert any(k in gap.efficiency for k in GAP_KEYS)
        assert gap.sources


def _prefill(t: StepTimer, prompt: int, chunk: int = 8192) -> float:
    done, s = 0, 0.0
    while done < prompt:
        n = min(chunk, prompt - done)
        s += t.duration(n, 1, chunk_ctx(done, n), 0, n)
        done += n
    return s


@pytest.mark.parametrize("name", GAPS)
def test_efficiency_rises_with_batch_tokens(name):
    """Seconds per prefill token fall faster with batch tokens than in the plain profile."""
    gap, plain = StepTimer(load_profile(name)), StepTimer(load_profile(name.removesuffix("-gap")))
    ratio = [gap.duration(n, 1, 0.0, 0, n) / plain.duration(n, 1, 0.0, 0, n) for n in (32, 256, 2048, 8192)]
    assert ratio == sorted(ratio, reverse=True) and ratio[0] > ratio[-1] * 1.2


@pytest.mark.parametrize("name", GAPS)
def test_attention_slows_at_long_contexts(name):
    gap = StepTimer(load_profile(name))
    short = gap.duration(1024, 1, chunk_ctx(0, 1024), 0, 1024)
    long_ = gap.duration(1024, 1, chunk_ctx(200_000, 1024), 0, 1024)
    no_knee = StepTimer(load_profile(name).with_overrides(efficiency={"attn_ctx_knee": 0}))
    plain_long = no_knee.duration(1024, 1, chunk_ctx(200_000, 1024), 0, 1024)
    assert long_ > plain_long * 1.5 and short < no_knee.duration(1024, 1, chunk_ctx(0, 1024), 0, 1024) * 1.02


@pytest.mark.parametrize("name", GAPS)
def test_cpu_overhead_per_sequence(name):
    gap = StepTimer(load_profile(name))
    per_seq = load_profile(name).efficiency["seq_overhead_us"] * 1e-6
    assert per_seq > 0
    no_seq = StepTimer(load_profile(name).with_overrides(efficiency={"seq_overhead_us": 0.0}))
    assert gap.duration(200, 200, 0.0, 0, 0) - no_seq.duration(200, 200, 0.0, 0, 0) == pytest.approx(200 * per_seq)


def test_plain_profiles_ignore_prefill_tokens_bit_for_bit():
    rng = random.Random(1)
    for name in profile_names():
        t = StepTimer(load_profile(name))
        if t._gap:
            continue
        for _ in range(200):
            tok, ctx = rng.randrange(1, 9000), rng.random() * 1e8
            assert t.duration(tok, 3, ctx, 1000) == t.duration(tok, 3, ctx, 1000, rng.randrange(1, tok + 1))


def test_gap_engine_is_noisier_and_its_network_congested():
    gap, plain = load_profile("llama3-8b-h200-gap"), load_profile("llama3-8b-h200")
    g, p = EngineModel(gap, "decode"), EngineModel(plain, "decode")
    assert g.noise == pytest.approx(math.hypot(0.02, gap.efficiency["extra_noise"])) and p.noise == 0.02
    assert EngineModel(gap, "decode", noise=0.0).noise == 0.0  # noise 0 still means none
    assert g.net_bytes_per_s == pytest.approx(plain.net_bytes_per_s * gap.efficiency["net_efficiency"])
    assert p.net_bytes_per_s == plain.net_bytes_per_s


def test_gap_engine_prefills_as_its_timer_says():
    """The engine model hands the timer the step's prefill tokens: a lone prefill on an idle
    engine takes the chunked sum of the gap timer's steps (noise off)."""
    prof = load_profile("llama3-8b-h200-gap")
    e = EngineModel(prof, "both", noise=0.0)
    prompt = 20_000
    e.add_request(SimRequest("r", [random.Random(2).randrange(1000, 100_000) for _ in range(prompt)], 1,
                             output_len=1), 0.0)
    now = 0.0
    first = None
    while e.has_work():
        r = e.step(now)
        now = r.end
        if r.first_tokens:
            first = r.first_tokens[0].first_token
    # the last chunk also samples the first token (LM head for one sequence)
    expect = _prefill(StepTimer(prof), prompt)
    assert first == pytest.approx(expect, rel=0.01)
