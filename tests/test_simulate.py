"""``conductor simulate``: the live scheduler and the sim engine's model in virtual time."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loadgen.simulate.cluster import ClusterSpec, SchedulerSpec
from loadgen.simulate.run import simulate
from loadgen.synthetic import parse_dist, synthetic_workload
from predictors.telemetry import SLO
from tests.servers import ROOT


def workload(n=60, rate=4.0, turns=3, seed=1):
    return synthetic_workload(n, rate, input_tokens=parse_dist("lognormal:1500:0.6"),
                              output_tokens=parse_dist("lognormal:64:0.5"), turns=turns, turn_gap_s=2.0,
                              shared_prefix_blocks=1, seed=seed)


def run(policy="conductor", n=60, rate=4.0, cluster=None, **sched):
    spec = cluster or ClusterSpec(prefill=2, decode=2, seed=3)
    return simulate(workload(n, rate), spec, SchedulerSpec(policy=policy, **sched), progress=None)


def test_every_request_ends_exactly_once_and_the_ledger_ends_empty():
    # overloaded on purpose: 1P+1D at 60 req/s and a tight TTFT SLO, with early rejection
    r = run(n=120, rate=60.0, cluster=ClusterSpec(prefill=1, decode=1, seed=3), early_rejection=True,
            slo=SLO(ttft_s=0.3, tbt_s=0.05))
    ids = [x.request_id for x in r.records]
    assert len(ids) == 120 and len(set(ids)) == 120  # simulate() itself raises if anything is still held
    statuses = {x.status for x in r.records}
    assert statuses <= {"ok", "rejected", "error"} and {"ok", "rejected"} <= statuses
    assert r.scheduler_counts["placed"] == sum(x.status != "rejected" for x in r.records)


def test_late_rejection_wastes_the_prefill_and_still_ends_every_request_once():
    slo = SLO(ttft_s=5.0, tbt_s=0.008)
    late = run(n=120, rate=60.0, cluster=ClusterSpec(prefill=2, decode=1, seed=3), late_rejection=True, slo=slo)
    assert len({x.request_id for x in late.records}) == 120  # simulate() raises if anything is still held
    wasted = [x for x in late.records if x.status == "rejected" and x.prefill_end_s is not None]
    assert wasted and all(x.first_token_s is None and x.reject_reason.startswith("tbt_slo") for x in wasted)
    early = run(n=120, rate=60.0, cluster=ClusterSpec(prefill=2, decode=1, seed=3), slo=slo)
    assert not [x for x in early.records if x.status == "rejected" and x.prefill_end_s is not None]


def test_a_disaggregated_request_walks_the_live_path():
    r = run(n=30, rate=2.0)
    w = {f"sim-r{q.index}": q for q in workload(30, 2.0).requests}
    for rec in r.records:
        assert rec.status == "ok"
        q = w[rec.request_id]
        assert rec.prefill_instance.startswith("prefill-") and rec.decode_instance.startswith("decode-")
        assert rec.arrival_s <= rec.decided_s <= rec.prefill_start_s < rec.prefill_end_s
        assert rec.prefill_end_s < rec.first_token_s <= rec.end_s
        assert rec.output_tokens == len(rec.token_times) == q.output_length  # ignore_eos replay: exact lengths
        assert rec.predicted_ttft_s > 0 and rec.cached_tokens is not None
    # later turns of a conversation find their earlier turn's prefix on the prefill side
    assert sum(rec.cached_tokens for rec in r.records) > 0


def test_colocated_instances_serve_whole_requests():
    r = run(n=20, rate=2.0, cluster=ClusterSpec(both=2, seed=3))
    assert all(x.status == "ok" and x.prefill_instance == x.decode_instance and x.prefill_start_s is None
               for x in r.records)


def test_same_seed_same_results_and_a_new_seed_changes_them():
    a, b = run(seed=0), run(seed=0)
    key = lambda r: [(x.request_id, x.prefill_instance, x.first_token_s, x.end_s) for x in r.records]  # noqa: E731
    assert key(a) == key(b)
    c = simulate(workload(), ClusterSpec(prefill=2, decode=2, seed=4), SchedulerSpec(), progress=None)
    assert key(c) != key(a)  # the engines' noise follows the seed


def test_oracle_predictors_predict_the_engine_better_than_the_public_prior():
    from loadgen.simulate.oracle import predictors_factory

    spec = ClusterSpec(prefill=2, decode=2, seed=3, noise=0.0)
    errs = {}
    for name in ("analytic", "oracle"):
        r = simulate(workload(40, 1.0), spec, SchedulerSpec(), predictors=predictors_factory(name, spec), progress=None)
        pairs = [(x.predicted_ttft_s, x.ttft_s) for x in r.records if x.queue_requests == 0 and x.ttft_s]
        errs[name] = sorted(abs(p - t) / t for p, t in pairs)[len(pairs) // 2]
    assert errs["oracle"] < errs["analytic"]


def test_the_oracle_tbt_reads_only_the_kv_that_fits_as_the_analytic_tbt_does():
    """KV the ledger reserved past a decode instance's capacity waits for room (the decode wait);
    a step reads at most a full cache. An oracle stretching the step with it counted that wait twice."""
    from engines_adapters.sim.profiles import load_profile
    from loadgen.simulate.oracle import oracle_predictors
    from predictors.base import DecodeState

    spec = ClusterSpec(prefill=1, decode=1, profile="llama3-8b-h200", engine={"kv_capacity_tokens": 100_000})
    tbt = oracle_predictors(spec).tbt.tbt
    at_cap = tbt(DecodeState("d", 49, 100_000 - 2_000), 1_000, 1_000)  # 50 sequences filling the cache
    past = tbt(DecodeState("d", 149, 300_000 - 2_000), 1_000, 1_000)  # 3x as much reserved, same per sequence
    under = tbt(DecodeState("d", 24, 50_000 - 2_000), 1_000, 1_000)  # half the cache
    assert past == pytest.approx(at_cap, rel=1e-9)
    assert under < at_cap  # below the capacity the step still grows with the KV it reads
    default = oracle_predictors(ClusterSpec(prefill=1, decode=1, profile="llama3-8b-h200")).tbt.tbt
    cap = load_profile("llama3-8b-h200").kv_capacity_tokens  # no override: the profile's own capacity
    full = default(DecodeState("d", 99, cap - 2_000), 1_000, 1_000)
    assert default(DecodeState("d", 299, 3 * cap), 1_000, 1_000) < 1.5 * full


def conductor(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "gateway.cli", "simulate", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


@pytest.mark.parametrize("args, message", [
    (["--prefill", "2", "--decode", "2", "--policy", "fastest"], "unknown policy 'fastest'; known: conductor"),
    (["--prefill", "2"], "disaggregated prefill needs decode instances"),
    ([], "the cluster is empty"),
    (["--both", "1", "--policy-param", "pull_rule=always"], "pull_rule must be one of"),
    (["--both", "1", "--predictors", "crystal"], "unknown predictors 'crystal'"),
    (["--prefill", "1", "--decode", "1", "--peer-pull", "--store"], "--peer-pull with --store is not modelled"),
    (["--both", "1", "--offset", "3"], "--offset applies to --trace"),
])
def test_bad_arguments_get_one_line_and_exit_2(tmp_path, args, message):
    p = conductor("--synthetic", "--requests", "5", "--out", str(tmp_path / "o"), *args)
    assert p.returncode == 2 and message in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_unwritable_out_and_bad_trace_lines_are_named(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    p = conductor("--synthetic", "--both", "1", "--out", str(blocker / "o"))
    assert p.returncode == 2 and "cannot write to --out" in p.stderr
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n{broken\n')
    p = conductor("--trace", str(trace), "--strict", "--both", "1", "--out", str(tmp_path / "o"))
    assert p.returncode == 2 and f"{trace}:2" in p.stderr


def test_offset_replays_the_requests_after_it_and_says_which(tmp_path):
    lines = [json.dumps({"timestamp": 1000 * i, "input_length": 600, "output_length": 4, "hash_ids": [i, 100 + i]})
             for i in range(6)]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    p = conductor("--trace", str(trace), "--offset", "2", "--limit", "3", "--both", "1", "--quiet",
                  "--out", str(tmp_path / "o"))
    assert p.returncode == 0, p.stderr
    assert f"workload: {trace} (mooncake, requests 3-5, 2.0 s of trace time)" in p.stderr
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["requests"] == 3


def test_the_bound_over_the_requests_a_policy_served_is_the_trace_bound_when_it_served_them_all():
    from loadgen.simulate.reuse import completed, reuse_bound, served_bound

    w = workload(40, 2.0)
    cap = 20_000
    total, hit = served_bound(w, [r.index for r in w.requests], 16, cap)
    assert total > 0 and hit / total == pytest.approx(reuse_bound(w, 16, cap)["lru_hit_ratio"])
    # every first turn alone: nothing earlier in the set shares their prefix but the one shared block
    firsts = [r.index for r in w.requests if r.turn in (None, 0)]
    sub_total, sub_hit = served_bound(w, firsts, 16, 10**8)
    assert 0 < sub_total < total and sub_hit / sub_total < reuse_bound(w, 16, 10**8)["infinite_hit_ratio"]
    # overloaded, so some are refused: the set is the records completed, by trace index
    r = run(n=120, rate=60.0, cluster=ClusterSpec(prefill=1, decode=1, seed=3), early_rejection=True,
            slo=SLO(ttft_s=0.5, tbt_s=None))
    done = completed(r.records)
    assert done == {x.extra["trace_index"] for x in r.records if x.status == "ok"}
    assert 0 < len(done) < 120


def test_the_report_gives_each_policys_hit_beside_the_bound_over_its_completed_requests(tmp_path):
    p = conductor("--synthetic", "--requests", "60", "--turns", "3", "--rate", "30", "--prefill", "1", "--decode",
                  "1", "--compare", "round_robin", "--slo-ttft-ms", "1000", "--reuse-bound", "--quiet",
                  "--out", str(tmp_path / "o"))
    assert p.returncode == 0, p.stderr
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    for t in s["targets"]:
        assert 0 < t["served_reuse_bound"] <= 1
        assert f"{t['target']}: prefix hit {t['cached_tokens']['hit_ratio']:.1%}" in p.stdout
    assert s["served_reuse_bound"] == s["targets"][0]["served_reuse_bound"]


def test_the_command_writes_loadgens_outputs_and_is_byte_deterministic(tmp_path):
    args = ["--synthetic", "--requests", "40", "--turns", "2", "--rate", "3", "--prefill", "1", "--decode", "1",
            "--compare", "round_robin", "--slo-ttft-ms", "5000", "--slo-tbt-ms", "100", "--quiet"]
    p1 = conductor(*args, "--out", str(tmp_path / "a"), "--telemetry", str(tmp_path / "t.jsonl"))
    assert p1.returncode == 0, p1.stderr
    p2 = conductor(*args, "--out", str(tmp_path / "b"), "--workers", "1")
    assert p2.returncode == 0, p2.stderr
    for name in ("summary.json", "requests.jsonl", "goodput.png", "latency.png", "capacity.png", "compare.md",
                 "compare.png"):
        assert (tmp_path / "a" / name).stat().st_size > 0
    assert (tmp_path / "a" / "summary.json").read_bytes() == (tmp_path / "b" / "summary.json").read_bytes()
    s = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert [t["target"] for t in s["targets"]] == ["conductor", "round_robin"] and s["requests"] == 40
    assert set(s["capacity_by_tbt"]) == {"conductor", "round_robin"}
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 80
    assert "round_robin / conductor: goodput ratio" in p1.stdout


def test_the_reuse_bound_grows_with_capacity_and_never_exceeds_the_unbounded_one():
    from loadgen.simulate.reuse import reuse_bound

    w = workload(40, 2.0)  # the workload run() below replays
    small, big = reuse_bound(w, 16, 20_000), reuse_bound(w, 16, 10**8)
    assert 0 <= small["lru_hit_ratio"] < big["lru_hit_ratio"] == pytest.approx(big["infinite_hit_ratio"])
    assert big["infinite_hit_ratio"] > 0.2  # later turns repeat their conversation's context
    r = run(n=40, rate=2.0, cluster=ClusterSpec(both=1, seed=3))  # one instance, a cache holding it all
    served = sum(x.cached_tokens for x in r.records) / sum(x.prompt_tokens for x in r.records)
    assert served <= big["infinite_hit_ratio"] + 1e-9
