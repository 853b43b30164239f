"""Online quantile tracking of the served p90 (predictors/online_quantile.py) and its use in
serving (LearnedBundle) and in conductor calibrate's held-out replay."""
from __future__ import annotations

import json
import math
import os
import random

import numpy as np
import pytest
from learned_helpers import DEPLOYMENT, synth_records

from predictors.calibrate import calibrate
from predictors.facts import load_deployment
from predictors.learned import MODELS_FILE, learned_predictors
from predictors.online_quantile import DEFAULT_ETA, QuantileTracker, replay, tune_eta

Q = 0.9


def _shifted_stream(n: int, seed: int = 0, shift: float = 1.3, delay: int = 5):
    """One run, one key: lognormal outcomes whose calibrated p90 is exact for the first half; the
    second half runs ``shift`` x slower. Each outcome is known ``delay`` decisions later."""
    rng = random.Random(seed)
    sigma = 0.1
    z90 = 1.2815515655446004
    actual = np.array([math.exp(rng.gauss(0.0, sigma)) * (shift if i >= n // 2 else 1.0) for i in range(n)])
    upper = np.full(n, math.exp(z90 * sigma))
    decided = np.arange(n, dtype=float)
    known = decided + delay + 0.5
    return ["run"] * n, decided, known, ["g"] * n, actual, upper


def test_tracker_recovers_90pct_coverage_after_a_mid_stream_shift_where_a_static_scale_does_not():
    run, decided, known, key, actual, upper = _shifted_stream(8000)
    late = slice(5000, 8000)  # after the shift, once the tracker had time to follow
    static = float(np.mean(actual[late] <= upper[late]))
    assert static < 0.5  # 1.3x slower: the static p90 covers ~40%
    served = replay(run, decided, known, key, actual, upper, Q, 0.05)
    assert abs(float(np.mean(actual[late] <= served[late])) - Q) < 0.02
    assert abs(float(np.mean(actual <= served)) - Q) < 0.02  # and over the whole stream
    # before the shift the calibrated p90 was right, and the tracker kept it there
    assert abs(float(np.mean(actual[:4000] <= served[:4000])) - Q) < 0.02
    assert np.all(served[:6] == upper[:6])  # nothing known yet: the calibrated quantile as is


def test_tracker_judges_an_outcome_against_the_quantile_served_at_its_decision():
    t = QuantileTracker(Q, eta=0.5)
    t.update("g", 2.0, 1.0, decided=0.0, now=1.0)  # a miss: the scale rises to e^0.45 (1.57)
    assert t.get("g") == pytest.approx(math.exp(0.45))
    # decided before that update: served at scale 1, so 1.5 missed, though today's scale covers it
    t.update("g", 1.5, 1.0, decided=0.5, now=2.0)
    assert t.coverage("g") == 0.0
    assert t.get("g") == pytest.approx(math.exp(0.9))
    # decided after the first update (before the second): served at e^0.45 > 1.5, covered
    t.update("g", 1.5, 1.0, decided=1.5, now=3.0)
    assert t.coverage("g") == pytest.approx(1 / 3)


def test_replay_applies_an_outcome_only_once_known():
    # a: decided at 0, a big miss known only at 10; b: decided at 5, just above its quantile;
    # c: decided at 11, the same. A leaked update (a's miss before b's decision) would cover b.
    run = ["r"] * 3
    decided = np.array([0.0, 5.0, 11.0])
    known = np.array([10.0, 12.0, 13.0])
    actual = np.array([5.0, 1.2, 1.2])
    upper = np.ones(3)
    served = replay(run, decided, known, ["g"] * 3, actual, upper, Q, eta=1.0)
    assert served[1] == 1.0  # a's outcome came after b's decision
    assert served[2] == pytest.approx(math.exp(0.9))  # and before c's
    assert float(np.mean(actual <= served)) == pytest.approx(1 / 3)
    leaked = replay(run, decided, decided, ["g"] * 3, actual, upper, Q, eta=1.0)  # outcomes known at decision
    assert float(np.mean(actual <= leaked)) > 1 / 3
    # runs are apart: another run's outcomes never reach this one
    other = replay(["r", "s", "s"], decided, known, ["g"] * 3, actual, upper, Q, eta=1.0)
    assert other[2] == 1.0


def test_tune_eta_prefers_tracking_when_a_run_drifts_and_none_when_it_does_not():
    drifting = _shifted_stream(4000, seed=1)
    eta, errors = tune_eta([drifting], Q, blocks=4)
    assert eta > 0 and errors[eta] < errors[0.0]
    steady = _shifted_stream(4000, seed=2, shift=1.0)
    eta, _ = tune_eta([steady], Q, blocks=4)
    assert eta <= 0.01  # nothing to follow: the smallest step that is as good


def test_tracker_ignores_broken_outcomes_and_stays_bounded():
    t = QuantileTracker(Q, eta=0.5)
    for bad in (float("nan"), float("inf"), -1.0, 0.0):
        t.update("g", bad, 1.0, 0.0, 0.0)
        t.update("g", 1.0, bad, 0.0, 0.0)
    assert t.get("g") == 1.0 and t.coverage("g") is None
    for k in range(200):
        t.update("g", 1e9, 1.0, float(k), float(k))
    assert t.get("g") == pytest.approx(4.0)  # LOG_BOUND
    with pytest.raises(ValueError):
        QuantileTracker(Q, eta=-0.1)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("oq") / "models")
    m = calibrate(synth_records(300, seed=21, noise=0.05), d, draw=False)
    return d, m


def _bundle(directory: str, **kw):
    p = learned_predictors(directory, **kw)
    for i in ("p-1", "d-1"):
        p.register(i, load_deployment(DEPLOYMENT), 400_000)
    assert p.bundle is not None
    return p, p.bundle


def test_calibrate_reports_static_and_served_coverage_and_writes_the_tuned_step(models_dir):
    d, m = models_dir
    oq = m["online_quantile"]
    assert oq["eta"] in (0.0, 0.005, 0.01, 0.02, 0.05, 0.1) and "training" in oq["tuned_on"]
    for term in ("prefill", "tbt", "handover", "ttft"):
        lm = m["holdout_metrics"][term]["learned"]
        assert 0.0 <= lm["p90_coverage_served"] <= 1.0 and "p90_coverage" in lm
    assert json.load(open(os.path.join(d, MODELS_FILE)))["meta"]["online_quantile"]["eta"] == oq["eta"]
    assert "served (tracked)" in open(os.path.join(d, "report.md")).read()


def test_serving_tracks_the_p90_of_a_slower_decode_and_shows_it(models_dir):
    d, _ = models_dir
    p, b = _bundle(d, quantile_eta=0.2)
    key = f"group:{DEPLOYMENT}"
    assert b.p90("tbt", key, 0.05) == 0.05  # nothing observed: the calibrated p90
    recs = synth_records(200, seed=22)
    for rec in recs:  # every decode 1.5x slower than at calibration
        t0 = rec.token_times[0]
        rec.token_times = [t0 + 1.5 * (x - t0) for x in rec.token_times]
        rec.end_s = rec.token_times[-1]
    for rec in sorted(recs, key=lambda r: r.end_s):  # as the gateway sees them: when each finishes
        p.observe(rec)
    tr = b.quantiles["tbt"]
    assert tr.n[key] == len(recs) and tr.get(key) > 1.3
    assert b.p90("tbt", key, 0.05) == pytest.approx(0.05 * tr.get(key))
    st = b.status(["p-1", "d-1"])
    row = st["terms"]["tbt"]["instances"]["d-1"]
    assert row["p90_observations"] == len(recs) and row["p90_scale"] > 1.3 and row["p90_live_coverage"] < 0.9
    assert st["terms"]["prefill"]["instances"]["p-1"]["p90_observations"] == len(recs)  # idle instance: lone
    assert st["ttft"]["p90_observations"] == len(recs) and st["p90_tracking"]["eta"] == 0.2
    # a reload starts the trackers afresh (a new model has its own calibration)
    p.reload(d)
    assert b.quantiles["tbt"].get(key) == 1.0 and not b.quantiles["tbt"].n


def test_serving_without_online_correction_or_with_broken_settings_falls_back(models_dir, tmp_path, caplog):
    d, _ = models_dir
    p, b = _bundle(d, online=False)
    for rec in synth_records(20, seed=23):
        p.observe(rec)
    assert not b.quantiles["tbt"].n and b.p90("tbt", "group:x", 0.1) == 0.1
    # the step from models.json, or the default when it says nothing or nonsense
    raw = json.load(open(os.path.join(d, MODELS_FILE)))
    assert _bundle(d)[1].quantiles["prefill"].eta == raw["meta"]["online_quantile"]["eta"]
    for meta, want in (({}, DEFAULT_ETA), ({"online_quantile": {"eta": "fast"}}, DEFAULT_ETA),
                       ({"online_quantile": {"eta": -1}}, DEFAULT_ETA), ({"online_quantile": 3}, DEFAULT_ETA)):
        raw2 = dict(raw, meta={k: v for k, v in raw["meta"].items() if k != "online_quantile"} | meta)
        sub = tmp_path / f"m{len(os.listdir(tmp_path))}"
        sub.mkdir()
        (sub / MODELS_FILE).write_text(json.dumps(raw2))
        with caplog.at_level("WARNING"):
            p2, b2 = _bundle(str(sub))
        assert b2.quantiles["tbt"].eta == want
        rec = synth_records(1, seed=24)[0]
        rec.end_s = None  # an unfinished record: no observation, no error
        p2.observe(rec)
        assert not b2.quantiles["tbt"].n
    assert "online quantile settings refused" in caplog.text
