"""Learned predictors: calibration recovers what generated the telemetry, extrapolates with the
physics, refuses broken model files, corrects each term online from observations of that term."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from learned_helpers import DEPLOYMENT, TRUE, synth_records
from servers import ROOT

from engines_adapters.sim.profiles import load_profile
from engines_adapters.sim.timing import StepTimer, chunk_ctx
from predictors.analytic import Prior, Roofline, roofline_prefill_s
from predictors.base import DecodeState
from predictors.calibrate import calibrate
from predictors.dataset import DataError, build_dataset
from predictors.facts import load_deployment
from predictors.learned import MODELS_FILE, ModelError, learned_predictors, load_models, parse_models
from predictors.learned_features import FEATURES
from predictors.registry import make_predictors
from predictors.telemetry import RequestRecord, write_jsonl


@pytest.fixture(scope="module")
def exact(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("exact"))
    metrics = calibrate(synth_records(400, seed=1, store_share=0.3), d, draw=False)
    return d, metrics


def test_calibrate_recovers_the_coefficients_that_generated_the_telemetry(exact):
    d, _ = exact
    models = load_models(d)
    for term, want in TRUE.items():
        got = models.terms[term].pooled.coef
        assert got == pytest.approx(want, rel=1e-6), term
        assert models.terms[term].groups[DEPLOYMENT].coef == pytest.approx(want, rel=1e-6)


def test_calibrate_with_noise_stays_close_and_its_p90_covers(tmp_path):
    m = calibrate(synth_records(800, seed=2, noise=0.03), str(tmp_path), draw=False)
    models = load_models(str(tmp_path))
    tbt = models.terms["tbt"].pooled.coef
    assert [tbt[i] for i in (0, 1, 2, 4)] == pytest.approx([TRUE["tbt"][i] for i in (0, 1, 2, 4)], rel=0.1)
    # the gaps' noise (sigma 3%) lifts the slowest 10% of them: the spread weight takes it on top
    assert TRUE["tbt"][3] < tbt[3] < TRUE["tbt"][3] + 0.3
    assert models.terms["transfer"].pooled.coef[1] == pytest.approx(TRUE["transfer"][1], rel=0.05)
    h = m["holdout_metrics"]
    assert h["prefill"]["learned"]["mape"] < 0.05 and h["tbt"]["learned"]["mape"] < 0.05
    assert 0.75 <= h["prefill"]["learned"]["p90_coverage"] <= 1.0
    # the analytic prior shares no constant with the generator: it is further off
    assert h["prefill"]["analytic"]["mape"] > h["prefill"]["learned"]["mape"]


def _gap_lone_prefill(prompt: int, cached: int) -> float:
    t = StepTimer(load_profile("llama3-8b-h200-gap"))
    done, s = min(cached, prompt - 1), 0.0
    while done < prompt:
        n = min(8192, prompt - done)
        s += t.duration(n, 1, chunk_ctx(done, n), 0, n)
        done += n
    return s


def test_extrapolation_beyond_the_longest_prompt_seen_stays_bounded(tmp_path):
    """Fitted on prompts up to 16k tokens of the gap engine's own lone-prefill times (whose
    attention slows at long contexts in a form outside the feature basis), the model answers
    within 10% at 2x and 15% at 4x the longest prompt seen, and stays within a factor of two at
    the model's whole 128k context (measured: -3.5%, -12.6%, -28%)."""
    recs = synth_records(500, seed=3, noise=0.01, max_prompt=16_000, prefill_truth=_gap_lone_prefill)
    calibrate(recs, str(tmp_path), draw=False)
    p = learned_predictors(str(tmp_path), online=False)
    p.register("p-1", load_deployment(DEPLOYMENT), 400_000)
    prior = Roofline.from_deployment(load_deployment(DEPLOYMENT), Prior())
    for prompt, bound in ((32_000, 0.10), (64_000, 0.15)):
        assert p.prefill.prefill_time("p-1", prompt, 0) == pytest.approx(_gap_lone_prefill(prompt, 0), rel=bound)
    ratio = p.prefill.prefill_time("p-1", 128_000, 0) / _gap_lone_prefill(128_000, 0)
    assert 0.5 < ratio < 2.0
    # the analytic prior, for scale, is further off at 4x
    truth = _gap_lone_prefill(64_000, 0)
    learned = p.prefill.prefill_time("p-1", 64_000, 0)
    assert abs(roofline_prefill_s(prior, 64_000, 0) / truth - 1) > abs(learned / truth - 1)
    # monotone in the prompt and never above the recomputed whole prompt for a cached prefix
    xs = [p.prefill.prefill_time("p-1", n, 0) for n in (1000, 4000, 16_000, 64_000, 200_000)]
    assert xs == sorted(xs) and all(math.isfinite(x) and x > 0 for x in xs)
    assert p.prefill.prefill_time("p-1", 50_000, 40_000) < p.prefill.prefill_time("p-1", 50_000, 0)


def _write(path: str, text: str) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, MODELS_FILE), "w") as f:
        f.write(text)
    return path


@pytest.mark.parametrize("mutate, message", [
    (lambda raw: "{not json", "not valid JSON"),
    (lambda raw: json.dumps({**raw, "format": "pickle"}), "not a conductor-learned-predictors file"),
    (lambda raw: json.dumps({**raw, "version": 99}), "unsupported version"),
    (lambda raw: json.dumps(_set(raw, "prefill", "coef", [1.0, float("nan"), 1.0, 1.0])), "finite"),
    (lambda raw: json.dumps(_set(raw, "tbt", "coef", [1.0, -2.0, 1.0, 0.0, 0.0])), ">= 0"),
    (lambda raw: json.dumps(_set(raw, "tbt", "coef", [1.0])), "list of 5 numbers"),
    (lambda raw: json.dumps({**raw, "terms": {**raw["terms"], "prefill": {**raw["terms"]["prefill"],
                                                                         "features": ["tokens"]}}}), "recalibrate"),
    (lambda raw: "\x80\x04\x95pickle", "not valid JSON"),
])
def test_broken_model_files_are_refused_at_reload_and_the_old_models_keep_serving(exact, tmp_path, mutate, message):
    good, _ = exact
    p = learned_predictors(good, online=False)
    p.register("p-1", load_deployment(DEPLOYMENT), 400_000)
    before = p.prefill.prefill_time("p-1", 5000, 0)
    raw = json.load(open(os.path.join(good, MODELS_FILE)))
    bad = _write(str(tmp_path / "bad"), mutate(raw))
    with pytest.raises(ModelError, match=message):
        p.reload(bad)
    assert p.bundle.source == os.path.abspath(good) and p.bundle.reloads == 0
    assert p.prefill.prefill_time("p-1", 5000, 0) == before
    assert not p.reload_if_changed()  # the refused file is not taken for a change of the served one
    missing = str(tmp_path / "nothing")
    with pytest.raises(ModelError, match="no such file"):
        p.reload(missing)


def _set(raw, term, key, value):
    raw = json.loads(json.dumps(raw))
    raw["terms"][term]["pooled"][key] = value
    return raw


def test_reload_swaps_all_terms_at_once(exact, tmp_path):
    good, _ = exact
    raw = json.load(open(os.path.join(good, MODELS_FILE)))
    doubled = json.loads(json.dumps(raw))
    for t in doubled["terms"].values():
        for m in [t["pooled"], *t["groups"].values()]:
            m["coef"] = [2 * c for c in m["coef"]]
    other = _write(str(tmp_path / "other"), json.dumps(doubled))
    p = learned_predictors(good, online=False)
    p.register("p-1", load_deployment(DEPLOYMENT), 400_000)
    p.register("d-1", load_deployment(DEPLOYMENT), 400_000)
    a = (p.prefill.prefill_time("p-1", 5000, 0), p.tbt.tbt(DecodeState("d-1", 3, 9000), 500, 100),
         p.transfer.transfer_time(5000, "p-1", "d-1"))
    p.reload(other)
    b = (p.prefill.prefill_time("p-1", 5000, 0), p.tbt.tbt(DecodeState("d-1", 3, 9000), 500, 100),
         p.transfer.transfer_time(5000, "p-1", "d-1"))
    assert b == pytest.approx([2 * x for x in a]) and p.bundle.reloads == 1


def test_a_term_without_a_model_falls_back_to_analytic_with_a_warning(exact, tmp_path, caplog):
    good, _ = exact
    raw = json.load(open(os.path.join(good, MODELS_FILE)))
    del raw["terms"]["tbt"]
    d = _write(str(tmp_path / "no-tbt"), json.dumps(raw))
    p = learned_predictors(d)
    analytic = make_predictors("analytic")
    for bundle in (p, analytic):
        bundle.register("d-1", load_deployment(DEPLOYMENT), 400_000)
    state = DecodeState("d-1", 5, 20_000)
    with caplog.at_level("WARNING"):
        assert p.tbt.tbt(state, 1000, 200) == analytic.tbt.tbt(state, 1000, 200)
    assert "tbt answered by the analytic prior" in caplog.text
    # host-tier loads are never observed apart from the queue: analytic, whatever the models
    assert p.transfer.transfer_time(4096, "host", "d-1") == analytic.transfer.transfer_time(4096, "host", "d-1")
    st = p.bundle.status(["d-1"])
    assert st["terms"]["tbt"]["instances"]["d-1"]["model"].startswith("analytic")
    assert st["terms"]["prefill"]["instances"]["d-1"]["model"] == f"group:{DEPLOYMENT}"


def test_online_correction_moves_only_the_observed_term_of_the_observed_instance(exact):
    good, _ = exact
    p = learned_predictors(good, alpha=0.2)
    for i in ("p-1", "p-2", "d-1", "d-2"):
        p.register(i, load_deployment(DEPLOYMENT), 400_000)
    assert p.group("p-1") == p.group("p-2") and hash(p.group("p-1")) == hash(p.group("p-2"))
    tbt_before = p.tbt.tbt(DecodeState("d-1", 4, 10_000), 800, 100)
    xfer_before = p.transfer.transfer_time(800, "p-1", "d-1")
    # p-1 prefills 1.5x slower than its model, on requests that found it idle
    for rec in synth_records(60, seed=4):
        base = p.bundle.prefill_base("p-1", rec.prompt_tokens, rec.hit_tokens)
        rec.prefill_end_s = rec.prefill_start_s + 1.5 * base
        rec.token_times = []  # no TBT observation, and no hand-over (first token unknown)
        rec.first_token_s = None
        p.observe(rec)
    assert p.bundle.ewma["prefill"].get("p-1") == pytest.approx(1.5, rel=0.02)
    assert p.prefill.prefill_time("p-1", 4000, 0) == pytest.approx(1.5 * p.prefill.prefill_time("p-2", 4000, 0),
                                                                   rel=0.02)
    # a decision computes prefill terms once per group: p-1 now answers apart, p-2 with the rest
    assert p.group("p-1") != p.group("p-2") == p.group("d-1")
    assert p.tbt.tbt(DecodeState("d-1", 4, 10_000), 800, 100) == tbt_before
    assert p.transfer.transfer_time(800, "p-1", "d-1") == xfer_before
    # a request that queued is not an observation of its prefill
    queued = synth_records(1, seed=5)[0]
    queued.queue_requests = 3
    queued.prefill_end_s = queued.prefill_start_s + 100.0
    p.observe(queued)
    assert p.bundle.ewma["prefill"].get("p-1") == pytest.approx(1.5, rel=0.02)
    # TBT observations move TBT (of the decode instance's whole deployment group: a per-instance
    # factor would herd requests onto whichever instance looked fast), bounded at 2x
    for rec in synth_records(80, seed=6):
        rec.token_times = [rec.token_times[0] + 10 * k for k in range(len(rec.token_times))]  # absurdly slow
        rec.prefill_instance = "p-2"
        p.observe(rec)
    key = f"group:{DEPLOYMENT}"
    assert p.bundle.correction_key("tbt", "d-1") == p.bundle.correction_key("tbt", "d-2") == key
    assert p.bundle.ewma["tbt"].get(key) == pytest.approx(2.0)
    assert p.tbt.tbt(DecodeState("d-2", 4, 10_000), 800, 100) == pytest.approx(2 * tbt_before)
    assert p.bundle.ewma["prefill"].get("p-1") == pytest.approx(1.5, rel=0.02)
    assert p.bundle.ewma["prefill"].get("p-2") == pytest.approx(1.0)  # its model was exact


def test_group_models_answer_their_deployment_and_the_pool_the_others(tmp_path):
    recs = synth_records(200, seed=7) + synth_records(20, seed=8, deployment="llama3-70b-a800x8")
    for r in recs[200:]:
        r.request_id += "-70b"
        r.prefill_instance, r.decode_instance = "p-70", "d-70"
    calibrate(recs, str(tmp_path), draw=False)
    m = load_models(str(tmp_path))
    assert set(m.terms["prefill"].groups) == {DEPLOYMENT}  # 20 rows are too few for the 70B's own model
    p = learned_predictors(str(tmp_path))
    p.register("x", load_deployment("llama3-70b-a800x8"), 1_000_000)
    assert p.bundle.model("prefill", "x") == (m.terms["prefill"].pooled, "pooled")


def test_clear_errors_for_unusable_telemetry(tmp_path):
    with pytest.raises(DataError, match="no finished requests"):
        build_dataset([RequestRecord("a", 0.0, status="rejected")])
    rec = synth_records(1)[0]
    rec.token_times, rec.first_token_s = [], None
    with pytest.raises(DataError, match="no token times"):
        build_dataset([rec])
    old = synth_records(3)
    for r in old:
        r.prefill_deployment = r.decode_deployment = None
    with pytest.raises(DataError, match="--deployment"):
        build_dataset(old)
    assert len(build_dataset(old, DEPLOYMENT).tbt) == 3
    with pytest.raises(DataError, match="too little data"):
        calibrate(synth_records(10), str(tmp_path), draw=False)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway.cli", "calibrate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_calibrate_command_writes_models_metrics_report_and_plots(tmp_path):
    tel = str(tmp_path / "t.jsonl")
    write_jsonl(tel, synth_records(300, seed=9, noise=0.02))
    out = tmp_path / "models"
    r = _cli("--telemetry", tel, "--out", str(out))
    assert r.returncode == 0, r.stderr
    for name in ("models.json", "metrics.json", "report.md", "predicted_vs_actual.png", "error_cdf.png",
                 "coverage_over_time.png"):
        assert (out / name).stat().st_size > 0, name
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["holdout"] == "time" and metrics["holdout_metrics"]["tbt"]["learned"]["n"] > 0
    assert "| prefill |" in (out / "report.md").read_text()
    # no request loaded a prefix from the store or the host tier: those terms stay with the prior, said once each
    assert parse_models(json.loads((out / "models.json").read_text())).terms.keys() == set(FEATURES) - {"store",
                                                                                                       "host"}
    assert "warning: store not fitted" in r.stderr and "warning: host not fitted" in r.stderr


@pytest.mark.parametrize("args, message", [
    (["--telemetry", "/nonexistent.jsonl", "--out", "x"], "no such file"),
    (["--telemetry", "TEL", "--out", "OUT", "--quantile", "1.5"], "--quantile"),
    (["--telemetry", "TEL", "--out", "OUT", "--holdout", "never"], "invalid choice"),
    (["--telemetry", "SMALL", "--out", "OUT"], "too little data"),
])
def test_calibrate_command_refuses_bad_input_in_one_line(tmp_path, args, message):
    tel, small = str(tmp_path / "t.jsonl"), str(tmp_path / "s.jsonl")
    write_jsonl(tel, synth_records(50))
    write_jsonl(small, synth_records(5))
    args = [{"TEL": tel, "SMALL": small, "OUT": str(tmp_path / "o")}.get(a, a) for a in args]
    r = _cli(*args)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) <= 2, r.stderr


def test_gateway_config_names_learned_predictors_and_their_directory():
    from gateway.config import ConfigError, parse_config

    cfg = parse_config({"predictors": "learned", "predictor_models": "/x"})
    assert cfg.predictors == "learned" and cfg.predictor_models == "/x" and cfg.predictor_online
    with pytest.raises(ConfigError, match="needs predictor_models"):
        parse_config({"predictors": "learned"})
    with pytest.raises(ConfigError, match="predictors must be one of"):
        parse_config({"predictors": "xgboost"})


def _simulate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway.cli", "simulate", "--trace",
                           os.path.join(ROOT, "data/traces/mooncake_conversation_trace.jsonl"), "--limit", "40",
                           "--prefill", "1", "--decode", "1", "--profile", "llama3-8b-h200-gap", "--quiet", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_simulate_predicts_with_a_calibrated_directory(exact, tmp_path):
    good, _ = exact
    runs = {}
    for name, pred in (("analytic", "analytic"), ("learned", good)):
        tel = tmp_path / f"{name}.jsonl"
        r = _simulate("--predictors", pred, "--telemetry", str(tel), "--out", str(tmp_path / name))
        assert r.returncode == 0, r.stderr
        runs[name] = {x["request_id"]: x for x in map(json.loads, tel.read_text().splitlines())}
    first = next(iter(runs["learned"]))
    # the same first request (an idle cluster: same state), other predicted terms
    assert runs["learned"][first]["predicted_prefill_s"] != runs["analytic"][first]["predicted_prefill_s"]
    learned = learned_predictors(good, online=False)
    learned.register("prefill-1", load_deployment(DEPLOYMENT), 10**6)
    rec = runs["learned"][first]
    assert rec["predicted_prefill_s"] == pytest.approx(
        learned.prefill.prefill_time("prefill-1", rec["prompt_tokens"], rec["hit_tokens"]))


@pytest.mark.parametrize("pred, message", [("learned", "give the model directory"), ("nothing", "unknown predictors")])
def test_simulate_refuses_unusable_predictors(tmp_path, pred, message):
    r = _simulate("--predictors", pred, "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and message in r.stderr


def test_simulate_refuses_a_broken_model_directory(tmp_path):
    bad = _write(str(tmp_path / "bad"), "{")
    r = _simulate("--predictors", bad, "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "not valid JSON" in r.stderr


def test_a_changed_model_file_is_picked_up_and_a_broken_one_refused(exact, tmp_path, caplog):
    good, _ = exact
    d = str(tmp_path / "watched")
    raw = json.load(open(os.path.join(good, MODELS_FILE)))
    _write(d, json.dumps(raw))
    p = learned_predictors(d, online=False)
    p.register("p-1", load_deployment(DEPLOYMENT), 400_000)
    before = p.prefill.prefill_time("p-1", 5000, 0)
    assert not p.reload_if_changed()  # nothing changed
    doubled = json.loads(json.dumps(raw))
    for t in doubled["terms"].values():
        for m in [t["pooled"], *t["groups"].values()]:
            m["coef"] = [2 * c for c in m["coef"]]
    path = _write(d, json.dumps(doubled))
    os.utime(os.path.join(path, MODELS_FILE), ns=(1, 10**18))
    assert p.reload_if_changed() and p.prefill.prefill_time("p-1", 5000, 0) == pytest.approx(2 * before)
    _write(d, "{broken")
    os.utime(os.path.join(d, MODELS_FILE), ns=(1, 2 * 10**18))
    with caplog.at_level("WARNING"):
        assert not p.reload_if_changed()
    assert "refused" in caplog.text and p.prefill.prefill_time("p-1", 5000, 0) == pytest.approx(2 * before)
    caplog.clear()
    assert not p.reload_if_changed() and "refused" not in caplog.text  # refused once, not every poll


def test_compiled_closed_forms_equal_the_models_over_their_features(exact):
    """Serving folds the weights into each deployment's constants: the same answers as the
    models' dot products over the documented features."""
    import random

    from predictors.learned_features import physics, prefill_features, tbt_features, transfer_features

    good, _ = exact
    models = load_models(good)
    p = learned_predictors(good, online=False)
    d = load_deployment(DEPLOYMENT)
    for i in ("a", "b"):
        p.register(i, d, 400_000)
    r = physics(d)
    rng = random.Random(5)
    for _ in range(300):
        prompt = rng.randrange(1, 131_000)
        cached = rng.randrange(0, prompt + 5)
        running, kv, mt = rng.randrange(0, 300), rng.randrange(0, 10**6), rng.randrange(0, 2000)
        want = models.terms["prefill"].pooled.predict(prefill_features(r, 1.0, prompt, cached))
        assert p.prefill.prefill_time("a", prompt, cached) == pytest.approx(want, rel=1e-9)
        load = rng.choice((0.0, rng.uniform(0.0, 60.0)))
        p.decode_load(load)  # type: ignore[misc]
        want = models.terms["tbt"].pooled.predict(tbt_features(r, 1.0, running, kv, prompt, mt, load))
        assert p.tbt.tbt(DecodeState("a", running, kv), prompt, mt) == pytest.approx(want, rel=1e-9)
        want = models.terms["transfer"].pooled.predict(transfer_features(r, 1.0, prompt, d.net_bytes_per_s))
        assert p.transfer.transfer_time(prompt, "a", "b") == pytest.approx(want, rel=1e-9)


def test_a_prefill_sharing_its_instance_from_the_same_instant_or_under_an_earlier_leg_is_not_lone():
    """A lone prefill is one the instance ran alone: neither a leg started at the same instant
    (a chunked step runs both) nor one started earlier and still running counts as lone."""
    recs = synth_records(6, seed=11)
    a, b, c = recs[0], recs[1], recs[2]
    # b starts with a (same instant) and finishes first: both shared the instance
    b.prefill_start_s = b.decided_s = b.arrival_s = a.prefill_start_s
    b.prefill_end_s = a.prefill_start_s + 0.5 * (a.prefill_end_s - a.prefill_start_s)
    # c starts under a long leg started before it, and finishes before that leg
    long_start, c_len = c.prefill_start_s, c.prefill_end_s - c.prefill_start_s
    recs[3].prefill_start_s = recs[3].decided_s = recs[3].arrival_s = long_start - 0.001
    recs[3].prefill_end_s = long_start + 3 * c_len
    by_id = {}
    for row in build_dataset(recs).prefill:
        for rid in row.request_ids:
            by_id[rid] = row.clean
    assert by_id[a.request_id] is False and by_id[b.request_id] is False
    assert by_id[c.request_id] is False
    assert by_id[recs[5].request_id] is True  # untouched and alone


def test_conformal_scale_recovers_the_coverage_of_a_miscalibrated_quantile():
    """A quantile that is really the p75 (or the p97) of lognormal noise is scaled, on a
    calibration sample, to cover 90% of fresh data (the scale known in closed form)."""
    import numpy as np

    from predictors.fit import conformal_scale

    rng = np.random.default_rng(3)
    sigma = 0.2
    z75, z90, z97 = 0.6745, 1.2816, 1.8808
    for z_fit in (z75, z97):
        point = rng.uniform(0.01, 2.0, 4000)
        actual = point * np.exp(sigma * rng.standard_normal(4000))
        upper = point * math.exp(sigma * z_fit)
        s = conformal_scale(actual[:2000], point[:2000], upper[:2000], 0.9)
        assert s == pytest.approx(math.exp(sigma * (z90 - z_fit)), rel=0.03)
        fresh = np.mean(actual[2000:] <= np.maximum(point[2000:], s * upper[2000:]))
        assert 0.875 <= fresh <= 0.925, fresh
    # too few calibration rows: no scale
    assert conformal_scale(np.ones(5), np.ones(5), np.ones(5), 0.9) is None


def test_calibrate_holds_out_a_calibration_split_and_its_p90s_cover_held_out_rows(tmp_path):
    """Noise of known sigma on every term: each term's held-out p90 coverage lands near 90%, the
    TTFT's too (its upper is the sum of the terms' scaled by its own conformal factor), and the
    scales are in models.json and survive a reload."""
    m = calibrate(synth_records(1500, seed=12, noise=0.08), str(tmp_path), draw=False)
    h = m["holdout_metrics"]
    for term in ("prefill", "tbt", "handover", "ttft"):
        assert 0.84 <= h[term]["learned"]["p90_coverage"] <= 0.96, (term, h[term]["learned"])
    raw = json.load(open(tmp_path / MODELS_FILE))
    cal = raw["meta"]["p90_calibration"]
    # cross-conformal over contiguous stretches of time (the hold-out is the latest part): every training row calibrates
    assert cal["split"] == "blocked" and cal["prefill"]["n"] >= 600
    assert raw["calibration"]["ttft_p90_scale"] == pytest.approx(cal["ttft"]["scale"])
    models = load_models(str(tmp_path))
    assert models.terms["prefill"].pooled.p90_scale == pytest.approx(cal["prefill"]["scale"])
    assert models.ttft_p90_scale == pytest.approx(cal["ttft"]["scale"])
    bad = dict(raw, calibration={"ttft_p90_scale": -1})
    with pytest.raises(ModelError, match="ttft_p90_scale"):
        parse_models(bad)
    bad = _set(raw, "tbt", "p90_scale", float("inf"))
    with pytest.raises(ModelError, match="p90_scale"):
        parse_models(bad)


def test_calibrate_learns_the_store_load_inside_the_prefill_leg_and_serves_it(tmp_path):
    """Prefill legs that load part of their prefix from the store first: the store term's weights
    are recovered from the legs (the learned prefill as their offset), scored held out against the
    prior's load, and served for store transfers; host-tier loads, never observed, stay analytic."""
    m = calibrate(synth_records(600, seed=13, store_share=0.5), str(tmp_path), draw=False)
    models = load_models(str(tmp_path))
    assert models.terms["store"].pooled.coef == pytest.approx(TRUE["store"], rel=1e-6)
    assert "host" not in models.terms and "host" in m["missing"]
    h = m["holdout_metrics"]
    assert h["store"]["learned"]["n"] > 20 and h["store"]["learned"]["mape"] < 1e-6
    assert h["store_load"]["learned"]["mape"] < 1e-6 < h["store_load"]["analytic"]["mape"]
    p = learned_predictors(str(tmp_path), online=False)
    d = load_deployment(DEPLOYMENT)
    p.register("p-1", d, 400_000)
    from predictors.learned_features import load_features, physics
    from predictors.types import Tier
    want = sum(w * x for w, x in zip(TRUE["store"], load_features(physics(d), 1.0, Tier.STORE, 4096), strict=True))
    assert p.transfer.transfer_time(4096, Tier.STORE, "p-1") == pytest.approx(want, rel=1e-9)
    analytic = make_predictors("analytic")
    analytic.register("p-1", d, 400_000)
    assert p.transfer.transfer_time(4096, Tier.HOST, "p-1") == pytest.approx(
        analytic.transfer.transfer_time(4096, Tier.HOST, "p-1"))


def test_a_term_worse_than_the_prior_held_out_is_left_to_the_prior():
    from predictors.calibrate import _worse_than_prior

    def m(n, learned, analytic):
        return {"learned": {"n": n, "mape": learned}, "analytic": {"n": n, "mape": analytic}}

    worse = _worse_than_prior({"prefill": m(200, 0.03, 0.09), "tbt": m(800, 0.05, 0.2),
                               "store_load": m(21, 0.48, 0.33), "handover": m(5, 0.9, 0.1)})
    assert set(worse) == {"store"} and "worse than the analytic prior" in worse["store"]  # 5 rows judge nothing


def test_the_served_store_term_waits_for_the_links_the_gateway_sees_busy(tmp_path):
    """Telemetry whose store loads waited for links busy with write-through (``store_busy_s``):
    calibration recovers the wait's weight (TRUE["store"][2]) and serves it, reading the busy time
    from the scheduler's StoreTraffic at decision; a load longer than the wait does not wait."""
    from predictors.learned_features import load_features, physics
    from predictors.store_traffic import StoreTraffic
    from predictors.types import Tier
    calibrate(synth_records(600, seed=21, store_share=0.5), str(tmp_path), draw=False)
    assert load_models(str(tmp_path)).terms["store"].pooled.coef[2] == pytest.approx(TRUE["store"][2], rel=1e-6)
    p = learned_predictors(str(tmp_path), online=False)
    d = load_deployment(DEPLOYMENT)
    p.register("p-1", d, 400_000)
    traffic = StoreTraffic()
    p.transfer.attach_store_traffic(traffic)
    idle = p.transfer.transfer_time(1024, Tier.STORE, "p-1")
    traffic.placed("other", 0.0, 1 << 30, False, 0.25, 0.25, 1000)  # a prefill on another instance ends at 0.25
    traffic.advance(0.05)
    busy = p.transfer.transfer_time(1024, Tier.STORE, "p-1")
    own = load_features(physics(d), 1.0, Tier.STORE, 1024)[1]
    assert busy - idle == pytest.approx(TRUE["store"][2] * (0.2 - own), rel=1e-6) and busy > idle
    long_load = 400_000  # its own transfer outlasts the busy links: no wait added
    assert load_features(physics(d), 1.0, Tier.STORE, long_load)[1] > 0.2
    traffic.advance(0.05)
    with_busy = p.transfer.transfer_time(long_load, Tier.STORE, "p-1")
    traffic.done("other", 0.06)
    traffic.advance(0.06)
    assert p.transfer.transfer_time(long_load, Tier.STORE, "p-1") == pytest.approx(with_busy)


def test_a_model_file_with_the_earlier_two_feature_store_term_still_serves(tmp_path):
    from predictors.learned_features import TRANSFER_FEATURES
    calibrate(synth_records(400, seed=3, store_share=0.3), str(tmp_path), draw=False)
    raw = json.loads((tmp_path / "models.json").read_text())
    st = raw["terms"]["store"]
    st["features"] = list(TRANSFER_FEATURES)
    for m in [st["pooled"], *st["groups"].values()]:
        m["coef"] = m["coef"][:2]
        m["p90_coef"] = None if m["p90_coef"] is None else m["p90_coef"][:2]
    models = parse_models(raw)
    assert models.terms["store"].pooled.coef[2] == 0.0 and len(models.terms["store"].pooled.coef) == 3
    st["features"] = ["latency_s"]
    with pytest.raises(ModelError, match="recalibrate"):
        parse_models(raw)


def test_a_store_load_is_not_corrected_online_only_its_live_error_is_tracked(tmp_path):
    """A store load observed at its end (its leg minus the prefill, which prefills joining the
    instance later can stretch) updates the live error, judged at the busy time recorded at its
    decision, but never the served factor: a leg stretched 3x leaves the store term as fitted."""
    from predictors.learned_features import load_features, physics
    from predictors.store_traffic import StoreTraffic
    from predictors.types import Tier
    calibrate(synth_records(600, seed=21, store_share=0.5), str(tmp_path), draw=False)
    p = learned_predictors(str(tmp_path), online=True)
    d = load_deployment(DEPLOYMENT)
    p.register("p-1", d, 400_000)
    p.register("d-1", d, 400_000)
    traffic = StoreTraffic()
    p.transfer.attach_store_traffic(traffic)
    traffic.placed("other", 0.0, 1 << 30, False, 0.6, 0.6, 1000)
    traffic.advance(0.05)  # busy now: 0.55 s
    tokens, busy = 2048, 0.15
    load = sum(w * x for w, x in zip(TRUE["store"], load_features(physics(d), 1.0, Tier.STORE, tokens, 1, busy),
                                     strict=True))
    served = p.transfer.transfer_time(tokens, Tier.STORE, "p-1")
    prefill = p.prefill.prefill_time("p-1", 8192, 4096)
    b = p.bundle
    key = b.correction_key("store", "p-1")
    for i, stretch in enumerate((1.0, 3.0)):
        rec = RequestRecord(f"s{i}", 0.0, prompt_tokens=8192, max_tokens=4, status="ok", decided_s=0.0,
                            prefill_instance="p-1", decode_instance="d-1", hit_tokens=4096, local_hit_tokens=2048,
                            transfer_tokens=tokens, transfer_from=Tier.STORE, store_busy_s=busy,
                            predicted_transfer_s=load, prefill_start_s=0.0,
                            prefill_end_s=(load + prefill) * stretch)
        b.observe(rec)
        if i == 0:  # judged at the decision's busy time: an exact prediction
            assert b.ewma["store"].abs_err[key] == pytest.approx(0.0, abs=1e-6)
    assert b.ewma["store"].count[key] == 2 and b.ewma["store"].abs_err[key] > 0
    assert b.ewma["store"].get(key) == 1.0
    assert p.transfer.transfer_time(tokens, Tier.STORE, "p-1") == served


def test_a_term_fitted_to_all_zero_weights_is_left_to_the_prior_and_the_file_still_loads(tmp_path):
    """Hand-over gaps shorter than the learned first decode step leave the shipment nothing to
    explain: its fit is all zeros, which predicts 0 s and which every reader of a model file refuses.
    Calibration must leave that term to the prior (saying why) and write a file that serves."""
    recs = synth_records(300, seed=2)
    for r in recs:
        r.first_token_s = r.prefill_end_s + 1e-4
    m = calibrate(recs, str(tmp_path), draw=False)
    assert "transfer" in m["missing"] and "all-zero weights" in m["missing"]["transfer"]
    models = load_models(str(tmp_path))
    assert "transfer" not in models.terms and {"prefill", "tbt"} <= set(models.terms)


def test_the_rebuilt_ttft_holds_the_decode_wait_the_decision_predicted(tmp_path):
    """A third of the requests waited 2 s for room on their decode instance, and their decisions
    predicted it: the held-out TTFT (rebuilt from the terms) must count that wait for both the
    learned terms and the prior, or on a decode-bound cluster it scores a TTFT neither predicts."""
    recs = synth_records(300, seed=5)
    for r in recs[::3]:
        r.predicted_decode_wait_s = 2.0
        r.first_token_s += 2.0
        r.token_times = [t + 2.0 for t in r.token_times]
        r.end_s += 2.0
    m = calibrate(recs, str(tmp_path), draw=False)
    ttft = m["holdout_metrics"]["ttft"]
    assert ttft["learned"]["mape"] < 0.02 and ttft["analytic"]["mape"] < 0.5
    assert load_models(str(tmp_path)).ttft_p90_scale < 1.2
