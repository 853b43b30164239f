"""Speed work must not move a single figure: fixed runs compared, bit for bit, with golden values
that the code before the speed work produced (tests/data/simulate_golden.json).

Scenarios: the benchmark's own setting (Mooncake conversation trace, 8P+8D llama3-70b-a800x8,
conductor); a small cluster under pressure (a small KV cache with a host tier, the trace sped up:
evictions, offloads, host reloads, preemptions); a colocated cluster; and the bare EngineModel
with vLLM-hashed KV events and a host tier (every step's duration, tokens and events).

Regenerate (only when a change is *meant* to move figures):
    .venv/bin/python -m tests.test_simulate_golden --write
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from engines_adapters.sim.model import EngineModel, SimRequest
from engines_adapters.sim.profiles import load_profile
from loadgen.arrivals import sped_up
from loadgen.simulate.cluster import ClusterSpec, SchedulerSpec
from loadgen.simulate.run import simulate
from loadgen.workload import bundled_trace, read_trace

GOLDEN = Path(__file__).parent / "data" / "simulate_golden.json"
#: RequestRecord fields added after the golden runs (more decision features, no figure moved)
ADDED_SINCE = frozenset({"predicted_decode_wait_s", "predicted_kv_transfer_s", "predicted_first_step_s",
                         "prefill_deployment", "decode_deployment", "transfer_from", "host_load_tokens",
                         "store_write_recent_bytes", "store_busy_s", "store_loads_inflight",
                         "decode_cluster_running", "decode_kv_share"})


def _trace(n: int, speedup: float = 1.0):
    w = read_trace(str(bundled_trace("mooncake_conversation_trace.jsonl")), limit=n)
    return sped_up(w, speedup) if speedup != 1.0 else w


# conductor as it was when the golden runs were made (before its work term, in-flight prefixes, the
# FIFO decode wait and the wait room became defaults): the golden runs pin the simulator and the
# engine model, not the policy
_CONDUCTOR_THEN = SchedulerSpec(policy="conductor", policy_params={
    "work_weight": 0.0, "inflight": False, "decode_fifo": False, "defer": False})

SCENARIOS: dict[str, Any] = {
    "mooncake-8p8d-70b": lambda: (_trace(120), ClusterSpec(prefill=8, decode=8, profile="llama3-70b-a800x8"),
                                  _CONDUCTOR_THEN),
    "mooncake-2p2d-pressure": lambda: (
        _trace(150, 8.0),
        ClusterSpec(prefill=2, decode=2, profile="llama3-70b-a800x8", seed=5,
                    engine={"kv_capacity_tokens": 120_000, "host_tier_tokens": 60_000}),
        _CONDUCTOR_THEN),
    "mooncake-both-8b": lambda: (_trace(80, 4.0), ClusterSpec(both=2, profile="llama3-8b-h200", seed=2,
                                                              engine={"kv_capacity_tokens": 200_000}),
                                 SchedulerSpec(policy="least_loaded")),
}


def _record_row(r) -> dict[str, Any]:
    return {"id": r.request_id, "prefill": r.prefill_instance, "decode": r.decode_instance,
            "first_token_s": r.first_token_s, "end_s": r.end_s, "cached": r.cached_tokens,
            "out": r.output_tokens, "status": r.status}


def run_scenario(name: str) -> dict[str, Any]:
    w, cluster, sched = SCENARIOS[name]()
    run = simulate(w, cluster, sched, progress=None)
    full = hashlib.sha256()
    for r in run.records:
        row = {k: v for k, v in dataclasses.asdict(r).items() if k not in ADDED_SINCE}
        full.update(json.dumps(row, sort_keys=True, default=str).encode())
    return {"stats": run.stats.as_dict(wall=False), "counts": run.scheduler_counts,
            "records_sha256": full.hexdigest(), "records": [_record_row(r) for r in run.records]}


def run_engine() -> dict[str, Any]:
    """The bare model: random shared-prefix workload, vLLM event hashes, host tier, aborts."""
    rng = random.Random(7)
    e = EngineModel(load_profile("llama3-8b-h200"), role="both", kv_capacity_tokens=90 * 16,
                    host_tier_tokens=60 * 16, max_num_batched_tokens=512, max_num_seqs=12, seed=3,
                    kv_events=True, kv_hold_timeout=0.5)
    bases = [[rng.randrange(32, 127) for _ in range(rng.randrange(40, 400))] for _ in range(5)]
    h = hashlib.sha256()
    now, live, n, steps = 0.0, [], 0, 0
    for _ in range(1500):
        if n < 150 and rng.random() < 0.25:
            tail = [rng.randrange(32, 127) for _ in range(rng.randrange(1, 60))]
            p = rng.choice(bases)[: rng.randrange(17, 400)] + tail
            rid = f"q{n}"
            n += 1
            e.add_request(SimRequest(rid, p, rng.randrange(1, 120), output_len=rng.choice([None, 5, 40, 90]),
                                     hold_kv=rng.random() < 0.15), now)
            live.append(rid)
        if live and rng.random() < 0.03:
            e.abort(live.pop(rng.randrange(len(live))))
        if live and rng.random() < 0.05:
            e.release_kv(rng.choice(live))
        r = e.step(now)
        steps += 1
        h.update(repr((r.start, r.duration, r.end, r.prefill_tokens, r.decode_seqs, r.idle, r.emitted,
                       r.first_tokens, r.finished, r.kv_loaded, r.expired, r.preempted, r.events)).encode())
        h.update(repr(e.stats()).encode())
        now = r.end if not r.idle else now + 0.01
    return {"steps": steps, "sha256": h.hexdigest(), "stats": repr(e.stats())}


def produce() -> dict[str, Any]:
    out = {name: run_scenario(name) for name in SCENARIOS}
    out["engine-model"] = run_engine()
    return out


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_simulated_records_match_the_golden_run(golden, name):
    got, want = run_scenario(name), golden[name]
    assert got["stats"] == want["stats"] and got["counts"] == want["counts"]
    for a, b in zip(got["records"], want["records"], strict=True):
        assert a == b
    assert got["records_sha256"] == want["records_sha256"]


def test_engine_model_steps_match_the_golden_run(golden):
    assert run_engine() == golden["engine-model"]


if __name__ == "__main__":
    if "--write" not in sys.argv:
        sys.exit("usage: python -m tests.test_simulate_golden --write")
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(produce(), indent=0, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
