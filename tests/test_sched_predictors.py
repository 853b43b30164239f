"""Analytic predictors: the roofline's shape, from the profiles' public facts."""
import pytest
from hypothesis import given, strategies as st

from engines_adapters.sim.profiles import load_profile
from predictors.analytic import (
    AnalyticPrefill,
    AnalyticQueue,
    AnalyticTBT,
    AnalyticTransfer,
    ProfileBook,
    analytic_predictors,
)
from predictors.base import (
    DecodeState,
    PrefillPredictor,
    PrefillState,
    QueuePredictor,
    TBTPredictor,
    TransferPredictor,
)
from predictors.types import Tier

BOOK = ProfileBook({"small": "llama3-8b-h200", "big": "llama3-70b-a800x8"})
PRED = analytic_predictors(BOOK)


def test_analytic_predictors_satisfy_the_protocols():
    assert isinstance(PRED.queue, QueuePredictor) and isinstance(AnalyticQueue(), QueuePredictor)
    assert isinstance(PRED.prefill, PrefillPredictor) and isinstance(AnalyticPrefill(BOOK), PrefillPredictor)
    assert isinstance(PRED.transfer, TransferPredictor) and isinstance(AnalyticTransfer(BOOK), TransferPredictor)
    assert isinstance(PRED.tbt, TBTPredictor) and isinstance(AnalyticTBT(BOOK), TBTPredictor)
    assert PRED.group("small") != PRED.group("big")
    book = ProfileBook({"a": "llama3-8b-h200", "b": "llama3-8b-h200", "c": "llama3-70b-a800x8"})
    group = analytic_predictors(book).group
    assert group("a") == group("b") != group("c")  # one group per profile: terms are shared


@given(st.integers(1, 130_000), st.integers(0, 130_000), st.integers(1, 4096))
def test_prefill_shrinks_with_cache_and_grows_with_prompt(prompt, cached, more):
    t = PRED.prefill.prefill_time("small", prompt, cached)
    assert t > 0  # at least one token is always computed
    assert PRED.prefill.prefill_time("small", prompt, min(prompt, cached + more)) <= t
    assert PRED.prefill.prefill_time("small", prompt + more, cached) >= t


def test_prefill_is_superlinear_for_long_prompts_and_slower_on_the_bigger_model():
    p = PRED.prefill.prefill_time
    assert p("small", 64_000, 0) > 2 * p("small", 32_000, 0)  # attention grows with tokens x context
    assert p("big", 8_000, 0) > p("small", 8_000, 0)
    assert p("small", 4096, 4096) == p("small", 4096, 4095)  # a full hit still recomputes one token
    # the cached prefix is cheaper to keep than to recompute, but attending to it is not free
    assert p("small", 20_000, 16_000) > p("small", 4_000, 0)


def test_transfer_is_latency_plus_bytes_over_bandwidth():
    t = PRED.transfer.transfer_time
    big = load_profile("llama3-70b-a800x8")
    assert big.kv_bytes_per_token == 327_680  # Mooncake's 320 KB per token for LLaMA3-70B
    lat = big.efficiency["transfer_latency_ms"] / 1e3
    assert t(1000, Tier.STORE, "big") == pytest.approx(lat + 1000 * big.kv_bytes_per_token / big.net_bytes_per_s)
    # linear in tokens
    assert t(4000, Tier.STORE, "big") - t(2000, Tier.STORE, "big") == pytest.approx(t(2000, Tier.STORE, "big") - lat)
    # host-tier loads use host bandwidth; instance to instance the slower NIC
    host_bw = big.hardware["host_gbps"] * 1e9
    assert t(1000, Tier.HOST, "big") == pytest.approx(lat + 1000 * big.kv_bytes_per_token / host_bw)
    small = load_profile("llama3-8b-h200")
    assert t(1000, "big", "small") == pytest.approx(
        max(lat, small.efficiency["transfer_latency_ms"] / 1e3)
        + 1000 * small.kv_bytes_per_token / min(small.net_bytes_per_s, big.net_bytes_per_s))
    assert t(1000, "small", "small") == 0.0 and t(0, Tier.STORE, "small") == 0.0


def test_tbt_grows_with_batch_and_kv_and_respects_the_memory_roofline():
    tbt = PRED.tbt.tbt
    small = load_profile("llama3-8b-h200")
    idle = tbt(DecodeState("small"), 100, 10)
    floor = small.weight_bytes / (small.hardware["hbm_gbps"] * 1e9 * small.efficiency["mbu"])
    assert idle >= floor  # a decode step reads every weight at least once
    assert tbt(DecodeState("small", 10, 50_000), 100, 10) > tbt(DecodeState("small", 10, 1_000), 100, 10) > idle
    assert tbt(DecodeState("small", 200, 1_000), 100, 10) >= tbt(DecodeState("small", 10, 1_000), 100, 10)
    cap = small.kv_capacity_tokens
    within = tbt(DecodeState("small", 10, cap - 200), 100, 10)
    over = tbt(DecodeState("small", 10, 2 * cap), 100, 10)
    assert over > 1.8 * within  # overcommitting KV stretches every step


def test_queue_is_the_ledgers_queued_seconds():
    assert PRED.queue.queue_time(PrefillState("small", 100, 1.25, 2)) == 1.25
    assert PRED.queue.queue_time(PrefillState("small")) == 0.0


def test_unknown_instances_fall_back_to_the_default_profile_instead_of_raising():
    assert PRED.prefill.prefill_time("nobody", 1000, 0) == PRED.prefill.prefill_time("small", 1000, 0)
    assert PRED.tbt.tbt(DecodeState("nobody"), 10, 10) == PRED.tbt.tbt(DecodeState("small"), 10, 10)


def test_time_scaled_profile_predicts_in_wall_seconds():
    """An engine at --time-scale 0.1 runs ten times faster in wall time; so must the predictions."""
    from engines_adapters.sim.profiles import load_profile, register_profile, time_scaled
    from predictors.analytic import Roofline, roofline_decode_step_s, roofline_prefill_s

    base = load_profile("llama3-8b-h200")
    fast = time_scaled(base, 0.1)
    register_profile(fast)
    assert load_profile(fast.name) is fast and fast.kv_capacity_tokens == base.kv_capacity_tokens
    rb, rf = Roofline.from_profile(base), Roofline.from_profile(fast)
    for prompt, cached in ((1000, 0), (8000, 2000), (32000, 0)):
        assert roofline_prefill_s(rf, prompt, cached) == pytest.approx(0.1 * roofline_prefill_s(rb, prompt, cached))
    assert roofline_decode_step_s(rf, 32, 32000) == pytest.approx(0.1 * roofline_decode_step_s(rb, 32, 32000))
    assert time_scaled(base, 1) is base
