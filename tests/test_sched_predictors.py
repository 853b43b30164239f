"""Analytic predictors: the prior-based roofline's shape, from public deployment facts only."""
import ast
import pathlib
import subprocess
import sys

import pytest
from hypothesis import given, strategies as st

from predictors.analytic import (
    AnalyticPrefill,
    AnalyticQueue,
    AnalyticTBT,
    AnalyticTransfer,
    DeploymentBook,
    Prior,
    Roofline,
    analytic_predictors,
    roofline_decode_step_s,
    roofline_prefill_s,
)
from predictors.base import DecodeState, PrefillPredictor, PrefillState, QueuePredictor, TBTPredictor, TransferPredictor
from predictors.facts import deployment_names, load_deployment
from predictors.types import Tier

ROOT = pathlib.Path(__file__).resolve().parents[1]
BOOK = DeploymentBook({"small": "llama3-8b-h200", "big": "llama3-70b-a800x8"})
PRED = analytic_predictors(BOOK)
PRIOR = Prior()


def test_analytic_predictors_satisfy_the_protocols():
    assert isinstance(PRED.queue, QueuePredictor) and isinstance(AnalyticQueue(), QueuePredictor)
    assert isinstance(PRED.prefill, PrefillPredictor) and isinstance(AnalyticPrefill(BOOK), PrefillPredictor)
    assert isinstance(PRED.transfer, TransferPredictor) and isinstance(AnalyticTransfer(BOOK), TransferPredictor)
    assert isinstance(PRED.tbt, TBTPredictor) and isinstance(AnalyticTBT(BOOK), TBTPredictor)
    assert PRED.group("small") != PRED.group("big")
    book = DeploymentBook({"a": "llama3-8b-h200", "b": "llama3-8b-h200", "c": "llama3-70b-a800x8"})
    group = analytic_predictors(book).group
    assert group("a") == group("b") != group("c")  # one group per deployment: terms are shared


def test_register_hooks_keep_the_book_in_step():
    pred = analytic_predictors()
    pred.register("x", load_deployment("llama3-70b-a800x8"), 100_000)
    pred.register("y", load_deployment("llama3-8b-h200"), 100_000)
    assert pred.prefill.prefill_time("x", 8000, 0) > pred.prefill.prefill_time("y", 8000, 0)
    pred.unregister("x")  # unknown again: the default deployment (8B)
    assert pred.prefill.prefill_time("x", 8000, 0) == pred.prefill.prefill_time("y", 8000, 0)
    with pytest.raises(KeyError, match="known: .*llama3-8b-h200"):
        DeploymentBook().set("z", "gpt-5-on-a-toaster")


@given(st.integers(1, 130_000), st.integers(0, 130_000), st.integers(1, 4096))
def test_prefill_shrinks_with_cache_and_grows_with_prompt(prompt, cached, more):
    t = PRED.prefill.prefill_time("small", prompt, cached)
    assert t > 0  # at least one token is always computed
    assert PRED.prefill.prefill_time("small", prompt, min(prompt, cached + more)) <= t
    assert PRED.prefill.prefill_time("small", prompt + more, cached) >= t


@given(st.integers(1, 512), st.integers(0, 2_000_000), st.integers(1, 64), st.integers(1, 100_000))
def test_decode_step_grows_with_batch_and_kv(batch, kv, more_seqs, more_kv):
    r = BOOK.roofline("small")
    t = roofline_decode_step_s(r, batch, kv)
    assert t >= r.step_overhead_s > 0
    assert roofline_decode_step_s(r, batch + more_seqs, kv) >= t
    assert roofline_decode_step_s(r, batch, kv + more_kv) >= t


def test_prefill_is_superlinear_for_long_prompts_and_slower_on_the_bigger_model():
    p = PRED.prefill.prefill_time
    assert p("small", 64_000, 0) > 2 * p("small", 32_000, 0)  # attention grows with tokens x context
    assert p("big", 8_000, 0) > p("small", 8_000, 0)
    assert p("small", 4096, 4096) == p("small", 4096, 4095)  # a full hit still recomputes one token
    # the cached prefix is cheaper to keep than to recompute, but attending to it is not free
    assert p("small", 20_000, 16_000) > p("small", 4_000, 0)


def test_prefill_is_compute_bound_at_the_priors_mfu():
    """A long uncached prompt: linear-layer FLOPs over peak x prior MFU, plus attention, plus overheads."""
    d = load_deployment("llama3-8b-h200")
    n = 16_384
    linear = 2 * d.model.params * n / (d.gpu.peak_tflops * 1e12 * PRIOR.prefill_mfu)
    attn = 4 * d.model.layers * d.model.hidden * n * (n / 2) / (d.gpu.peak_tflops * 1e12 * PRIOR.attn_mfu)
    expected = linear + attn + 2 * PRIOR.step_overhead_ms / 1e3
    assert PRED.prefill.prefill_time("small", n, 0) == pytest.approx(expected)
    # a less efficient prior predicts a slower prefill; nothing else moves it
    slow = DeploymentBook({"small": "llama3-8b-h200"}, prior=Prior(prefill_mfu=0.25, attn_mfu=0.25))
    assert analytic_predictors(slow).prefill.prefill_time("small", n, 0) > 1.9 * (expected - 2 * 2e-3)


def test_transfer_is_latency_plus_bytes_over_bandwidth():
    t = PRED.transfer.transfer_time
    big, small = load_deployment("llama3-70b-a800x8"), load_deployment("llama3-8b-h200")
    assert big.kv_bytes_per_token == 327_680  # Mooncake's 320 KB per token for LLaMA3-70B
    lat = PRIOR.transfer_latency_ms / 1e3
    # a store load: one Transfer Engine transfer (the prior's store_gbps), never above the NIC
    store_bw = min(big.net_bytes_per_s, PRIOR.store_gbps * 1e9)
    assert t(1000, Tier.STORE, "big") == pytest.approx(lat + 1000 * big.kv_bytes_per_token / store_bw)
    fast = analytic_predictors(DeploymentBook({"big": "llama3-70b-a800x8"}, prior=Prior(store_gbps=1e6)))
    assert fast.transfer.transfer_time(1000, Tier.STORE, "big") == pytest.approx(
        lat + 1000 * big.kv_bytes_per_token / big.net_bytes_per_s)
    # linear in tokens
    assert t(4000, Tier.STORE, "big") - t(2000, Tier.STORE, "big") == pytest.approx(t(2000, Tier.STORE, "big") - lat)
    # host-tier loads use host bandwidth; instance to instance the slower NIC
    assert t(1000, Tier.HOST, "big") == pytest.approx(lat + 1000 * big.kv_bytes_per_token / big.host_bytes_per_s)
    assert t(1000, "big", "small") == pytest.approx(
        lat + 1000 * small.kv_bytes_per_token / min(small.net_bytes_per_s, big.net_bytes_per_s))
    assert t(1000, "small", "small") == 0.0 and t(0, Tier.STORE, "small") == 0.0


def test_tbt_grows_with_batch_and_kv_and_respects_the_memory_roofline():
    tbt = PRED.tbt.tbt
    small = load_deployment("llama3-8b-h200")
    idle = tbt(DecodeState("small"), 100, 10)
    floor = small.weight_bytes / (small.gpu.hbm_gbps * 1e9 * PRIOR.decode_mbu)
    assert idle >= floor  # a decode step reads every weight at least once
    assert tbt(DecodeState("small", 10, 50_000), 100, 10) > tbt(DecodeState("small", 10, 1_000), 100, 10) > idle
    assert tbt(DecodeState("small", 200, 1_000), 100, 10) >= tbt(DecodeState("small", 10, 1_000), 100, 10)
    cap = small.estimated_kv_capacity_tokens()
    full = tbt(DecodeState("small", 10, cap - 110), 100, 10)  # this request fills the cache exactly
    assert tbt(DecodeState("small", 10, cap - 50_000), 100, 10) < full
    # reserved past the capacity: the excess waits for room (the ledger's decode wait), the step
    # reads a full cache, not twice one
    assert tbt(DecodeState("small", 10, 2 * cap), 100, 10) <= full
    assert tbt(DecodeState("small", 400, 3 * cap), 100, 10) <= tbt(DecodeState("small", 400, cap - 110), 100, 10)


def test_a_reported_capacity_bounds_the_kv_a_step_reads():
    book = DeploymentBook({"a": "llama3-8b-h200"})
    tbt = analytic_predictors(book).tbt.tbt
    before = tbt(DecodeState("a", 10, 100_000), 100, 10)
    book.set("a", "llama3-8b-h200", kv_capacity_tokens=50_000)  # the engine reports a smaller cache
    after = tbt(DecodeState("a", 10, 100_000), 100, 10)
    assert after < before
    assert after == pytest.approx(tbt(DecodeState("a", 10, 50_000 - 110), 100, 10), rel=0.02)


def test_queue_is_the_ledgers_queued_seconds():
    assert PRED.queue.queue_time(PrefillState("small", 100, 1.25, 2)) == 1.25
    assert PRED.queue.queue_time(PrefillState("small")) == 0.0


def test_unknown_instances_fall_back_to_the_default_deployment_instead_of_raising():
    assert PRED.prefill.prefill_time("nobody", 1000, 0) == PRED.prefill.prefill_time("small", 1000, 0)
    assert PRED.tbt.tbt(DecodeState("nobody"), 10, 10) == PRED.tbt.tbt(DecodeState("small"), 10, 10)


def test_time_scaled_deployment_predicts_in_wall_seconds():
    """An engine at --time-scale 0.1 runs ten times faster in wall time; so must the predictions."""
    base = load_deployment("llama3-8b-h200")
    fast = base.time_scaled(0.1)
    assert load_deployment(fast.name) == fast and fast.time_scale == pytest.approx(0.1)
    assert fast.estimated_kv_capacity_tokens() == base.estimated_kv_capacity_tokens()
    rb, rf = Roofline.from_deployment(base), Roofline.from_deployment(fast)
    for prompt, cached in ((1000, 0), (8000, 2000), (32000, 0)):
        assert roofline_prefill_s(rf, prompt, cached) == pytest.approx(0.1 * roofline_prefill_s(rb, prompt, cached))
    assert roofline_decode_step_s(rf, 32, 32000) == pytest.approx(0.1 * roofline_decode_step_s(rb, 32, 32000))
    assert base.time_scaled(1) is base
    for bad in ("llama3-8b-h200@time-scale-0", "llama3-8b-h200@time-scale-x", "nope@time-scale-2"):
        with pytest.raises(KeyError):
            load_deployment(bad)


def test_prior_rejects_nonsense():
    for bad in ({"prefill_mfu": 0}, {"decode_mbu": 1.5}, {"step_overhead_ms": -1}, {"chunk_tokens": 0}):
        with pytest.raises(ValueError):
            Prior(**bad)


def test_public_facts_know_their_deployments():
    assert {"llama3-8b-h200", "llama3-70b-a800x8"} <= set(deployment_names())
    d = load_deployment("llama3-8b-h200")
    assert d.kv_bytes_per_token == 131_072 and d.max_model_len == 131_072 and d.sources
    with pytest.raises(KeyError, match="unknown deployment 'gpt5'; known: llama3-70b-a800x8, llama3-8b-h200"):
        load_deployment("gpt5")


def _imports(path: pathlib.Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", ["predictors", "scheduler"])
def test_predictors_and_scheduler_never_import_the_engines(package):
    """Statically (every module's imports) and dynamically (a fresh interpreter's sys.modules)."""
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    for f in files:
        bad = {n for n in _imports(f) if n.split(".")[0] in ("engines_adapters", "gateway", "loadgen")}
        assert not bad, f"{f.relative_to(ROOT)} imports {bad}"
    mods = [f"{package}." + ".".join(f.relative_to(ROOT / package).with_suffix("").parts) for f in files]
    mods = [m.removesuffix(".__init__") for m in mods]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "print(sorted(n for n in sys.modules if n.split('.')[0] in ('engines_adapters', 'gateway', 'loadgen')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
