"""The learned TBT's decision-time features (the slowest-10% statistic of the request's gaps, the
cluster's decode load) from the scheduler to the record to the fit and back, and conformal
calibration over contiguous stretches of time."""
import dataclasses
import json
import math
import os

import pytest
from learned_helpers import DEPLOYMENT, TRUE, synth_records

from predictors.base import DecodeState
from predictors.calibrate import calibrate
from predictors.dataset import build_dataset
from predictors.facts import load_deployment
from predictors.fit import calibration_folds
from predictors.learned import MODELS_FILE, learned_predictors, load_models
from predictors.learned_features import TBT_FEATURES_V1, physics, slowest_share, tbt_features
from predictors.learned_models import TBT_KV_SHARE
from scheduler import Instance, Placement, RequestFacts, Scheduler
from scheduler.hashing import block_hashes
from tests.sched_helpers import Clock, toks


@pytest.fixture(scope="module")
def exact(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("exact-tbt"))
    calibrate(synth_records(400, seed=1), d, draw=False)
    return d


def test_slowest_share_is_the_expected_top_tenth_of_normal_draws():
    assert slowest_share(1) == 0.0 and slowest_share(0) == 0.0
    # the mean of the top 10% of a standard normal: phi(z_0.9) / 0.1 = 1.7550
    assert slowest_share(10**6) == pytest.approx(1.755, abs=0.01)
    values = [slowest_share(n) for n in (2, 9, 10, 50, 200, 1000)]
    assert values == sorted(values) and all(0 < v < 1.76 for v in values)
    assert slowest_share(9) == pytest.approx(1.485, abs=0.03)  # the largest of 9 draws


def test_calibrate_recovers_the_tbt_weights_of_the_new_features(exact):
    """Generated telemetry whose TBT depends on the cluster's load and the gaps' slowest share:
    the fit finds their weights exactly, and serving with the load the scheduler sets answers
    the model over the documented features."""
    tbt = load_models(exact).terms["tbt"].pooled
    assert tbt.coef == pytest.approx(TRUE["tbt"], rel=1e-6)
    p = learned_predictors(exact, online=False)
    d = load_deployment(DEPLOYMENT)
    p.register("d-1", d, 400_000)
    r = physics(d)
    for load in (0.0, 3.5, 30.0):
        p.decode_load(load)  # type: ignore[misc]
        want = sum(w * x for w, x in zip(TRUE["tbt"], tbt_features(r, 1.0, 4, 9000, 500, 300, load), strict=True))
        assert p.tbt.tbt(DecodeState("d-1", 4, 9000), 500, 300) == pytest.approx(want, rel=1e-6)
    p.decode_load(0.0)  # type: ignore[misc]
    light = p.tbt.tbt(DecodeState("d-1", 4, 9000), 500, 300)
    p.decode_load(30.0)  # type: ignore[misc]
    assert p.tbt.tbt(DecodeState("d-1", 4, 9000), 500, 300) - light == pytest.approx(
        TRUE["tbt"][4] * 30.0 * 2.0 * r.params / r.flops_per_s, rel=1e-6)


def test_kv_reserved_past_the_capacity_reads_a_full_cache_with_the_batch_that_fits(exact):
    """Past the deployment's capacity the excess waits for room (the ledger's decode wait, its own
    term), so the features, and the served closed form with them, stop growing with it: ten
    times the capacity reserved costs a step of a full cache, not ten times its KV read."""
    d = load_deployment(DEPLOYMENT)
    r = physics(d)
    cap = r.kv_capacity_tokens
    full = tbt_features(r, 1.0, 9, cap - 800, 500, 300)
    over = tbt_features(r, 1.0, 99, 10 * cap, 500, 300)
    assert over[1] == pytest.approx(full[1], rel=1e-3)  # a full cache's KV read
    fits = int(100 * cap / (10 * cap + 800))  # the batch's share that fits: 9 of 100
    assert fits == 9 and over[2] == pytest.approx(fits * 2.0 * r.params / r.flops_per_s)
    p = learned_predictors(exact, online=False)
    p.register("d-1", d, cap)
    states = [DecodeState("d-1", 9, cap - 800), DecodeState("d-1", 99, 10 * cap), DecodeState("d-1", 4, 9000)]
    served = [p.tbt.tbt(s, 500, 300) for s in states]
    for s, t in zip(states, served, strict=True):
        x = tbt_features(r, 1.0, s.running, s.kv_tokens, 500, 300)
        want = sum(w * v for w, v in zip(TRUE["tbt"], x, strict=True))
        assert t == pytest.approx(want, rel=1e-6)
    assert served[1] < served[0] * 1.2
    assert p.tbt.tbt_many(states, 500, 300) == pytest.approx(served, rel=1e-12)  # type: ignore[attr-defined]


def test_a_tbt_model_from_before_the_new_features_serves_them_at_zero(exact, tmp_path):
    raw = json.load(open(os.path.join(exact, MODELS_FILE)))
    tr = raw["terms"]["tbt"]
    tr["features"] = list(TBT_FEATURES_V1)
    for m in [tr["pooled"], *tr["groups"].values()]:
        m["coef"], m["p90_coef"] = m["coef"][:3], m["p90_coef"][:3]
    os.makedirs(tmp_path / "old")
    with open(tmp_path / "old" / MODELS_FILE, "w") as f:
        json.dump(raw, f)
    old = load_models(str(tmp_path / "old")).terms["tbt"].pooled
    assert old.coef == pytest.approx(list(TRUE["tbt"][:3]) + [0.0, 0.0], rel=1e-6)
    p = learned_predictors(str(tmp_path / "old"), online=False)
    d = load_deployment(DEPLOYMENT)
    p.register("d-1", d, 400_000)
    p.decode_load(25.0)  # type: ignore[misc]
    want = sum(w * x for w, x in zip(TRUE["tbt"][:3], tbt_features(physics(d), 1.0, 2, 100, 50, 20)[:3], strict=True))
    assert p.tbt.tbt(DecodeState("d-1", 2, 100), 50, 20) == pytest.approx(want, rel=1e-6)


def test_the_scheduler_sets_the_cluster_decode_load_before_a_decision_and_records_it():
    clock = Clock(0.0)
    pred = learned_predictors(None, online=False)
    seen: list[float] = []
    hook = pred.decode_load
    assert hook is not None
    pred.decode_load = lambda v: (seen.append(v), hook(v))  # type: ignore[assignment]
    insts = [Instance("p0", "prefill"), Instance("p1", "prefill"), Instance("d0", "decode"), Instance("d1", "decode")]
    sched = Scheduler(insts, clock=clock, predictors=pred)

    def place(rid: str, seed: int) -> Placement:
        d = sched.decide(RequestFacts(rid, 800, block_hashes(toks(seed, 800), 16), 50, None))
        assert isinstance(d, Placement)
        return d

    burst = [place(f"b{k}", k) for k in range(4)]  # four in the same instant: one burst
    assert [d.decode_cluster_running for d in burst] == [0.0] * 4 and seen == [0.0] * 4
    clock.t = 1.0
    d = place("later", 99)
    want = 4 / 2 * (1 - math.exp(-1.0))  # 4 reservations over 2 decode instances, averaged over 1 s
    assert d.decode_cluster_running == pytest.approx(want) and seen[-1] == pytest.approx(want)
    assert pred.bundle is not None and pred.bundle.decode_cluster == pytest.approx(want)


def test_time_blocks_are_contiguous_and_forward_folds_see_only_the_past():
    ds = build_dataset(synth_records(300, seed=4))

    def train(t: float) -> bool:
        return t < 0.8

    blocked = calibration_folds(ds, train, "blocked", 0.2)
    assert len(blocked) == 5
    rows = [r for r in ds.tbt if train(r.t)]
    owner = [[k for k, (_, cal) in enumerate(blocked) if cal(r)] for r in rows]
    assert all(len(o) == 1 for o in owner)  # every training row calibrates exactly once
    by_t = [o[0] for _, o in sorted(zip([r.t for r in rows], owner, strict=True))]
    assert by_t == sorted(by_t)  # blocks are contiguous stretches of time
    for proper, cal in blocked:
        assert not any(proper(r.t) and cal(r) for r in rows)
        assert not any(cal(r) for r in ds.tbt if not train(r.t))
    forward = calibration_folds(ds, train, "forward", 0.2)
    assert len(forward) == 4
    for proper, cal in forward:
        first = min(r.t for r in rows if cal(r))
        assert all(t < first for t in (r.t for r in rows if proper(r.t)))


def test_blocked_conformal_covers_the_latest_rows_of_a_drifting_run(tmp_path):
    """The cluster's load climbs through the run (the latest rows are the busiest, as a time
    hold-out has them) and the gaps are noisy: calibrated on contiguous stretches of the earlier
    rows, the TBT's p90 covers near 90% of the latest 20%, and so does every other term."""
    recs = synth_records(1500, seed=21, noise=0.08, cluster_of=lambda x: 60.0 * x)
    m = calibrate(recs, str(tmp_path), draw=False)
    assert m["holdout"] == "time"
    h = m["holdout_metrics"]
    for term in ("prefill", "tbt", "handover", "ttft"):
        assert 0.86 <= h[term]["learned"]["p90_coverage"] <= 0.94, (term, h[term]["learned"])
    assert json.load(open(tmp_path / MODELS_FILE))["meta"]["p90_calibration"]["split"] == "blocked"


def test_the_relative_median_is_the_best_non_negative_fit_not_a_clipped_unconstrained_one():
    """Two nearly collinear features (the TBT's weight read and its spread term are, for long
    decodes) whose exact unconstrained fit is w = (-1, 2): the median must be the best fit with
    w >= 0, not that fit with its negative weight clipped to 0 (which predicted 3.7x the actual
    TBT on a live synthetic slice's telemetry)."""
    import numpy as np

    from predictors.fit_weights import median_weights

    t = np.linspace(0.0, 1.0, 41)
    x = np.column_stack([np.ones_like(t), 1.0 + t])
    y = 1.0 + 2.0 * t  # = -1 * x0 + 2 * x1

    def rel_err(w):
        return float(np.mean(np.abs(x @ w - y) / y))

    w = median_weights(x, y, np.zeros_like(y))
    assert (w >= 0).all()
    clipped = np.array([0.0, 2.0])
    assert rel_err(w) < 0.5 * rel_err(clipped)
    grid = [np.array([a, b]) for a in np.linspace(0, 2, 41) for b in np.linspace(0, 2, 41)]
    assert rel_err(w) <= min(rel_err(g) for g in grid) + 1e-9  # no non-negative point does better
    # a non-negative truth is recovered exactly
    y2 = 0.5 * x[:, 0] + 1.5 * x[:, 1]
    assert median_weights(x, y2, np.zeros_like(y2)) == pytest.approx([0.5, 1.5], abs=1e-6)


def test_the_upper_quantile_is_the_best_non_negative_fit_and_covers_its_share():
    """The same collinear features with noise whose unconstrained 0.9-quantile has a negative
    weight: the upper quantile is the least relative pinball loss over w >= 0 (the live synthetic
    run's TBT p90 had come out as [65.5, 8.9, -81.0, -35.1, 20.4]), and it still lies above about
    90% of the rows."""
    import numpy as np

    from predictors.fit_weights import quantile_weights

    rng = np.random.default_rng(1)
    t = rng.uniform(0.0, 1.0, 400)
    x = np.column_stack([np.ones_like(t), 1.0 + t])
    y = (1.0 + 2.0 * t) * rng.uniform(0.9, 1.3, t.size)  # = (-1 * x0 + 2 * x1) x noise

    def loss(w):
        r = (y - x @ w) / y
        return float(np.mean(np.maximum(0.9 * r, -0.1 * r)))

    w = np.array(quantile_weights(x, y, y, 0.9))
    assert (w >= 0).all()
    grid = [np.array([a, b]) for a in np.linspace(0, 3, 61) for b in np.linspace(0, 3, 61)]
    assert loss(w) <= min(loss(g) for g in grid) + 1e-9  # no non-negative point does better
    assert 0.85 <= float(np.mean(y <= x @ w + 1e-9)) <= 0.95
    # a non-negative truth's quantile is found: y = line x U(0.9, 1.3) has its 0.9-quantile at 1.26 x
    # the line (which of the two collinear features carries it, the noise decides)
    line = 0.5 * x[:, 0] + 1.5 * x[:, 1]
    y2 = line * rng.uniform(0.9, 1.3, t.size)
    assert x @ np.array(quantile_weights(x, y2, y2, 0.9)) == pytest.approx(1.26 * line, rel=0.04)


def test_the_share_recorded_at_decision_lets_calibration_fit_a_full_shared_cache_and_serving_use_it(tmp_path):
    """Half the requests join a cache reserved past its capacity whose sequences share prefix
    blocks (kv_share 0.3-1): their step reads capacity / share of context. With the share recorded
    in the telemetry, calibration recovers the true TBT weights, and the served TBT reads a full
    cache at the live share: slower the lower the share, as the truth is."""
    recs = synth_records(400, seed=3, full_share=0.5)
    assert sum(r.decode_kv_share < 1 for r in recs) > 150
    calibrate(recs, str(tmp_path), draw=False)
    got = load_models(str(tmp_path)).terms["tbt"].pooled.coef
    assert got == pytest.approx(TRUE["tbt"], rel=1e-3)
    d = load_deployment(DEPLOYMENT)
    r = physics(d)
    cap = r.kv_capacity_tokens
    p = learned_predictors(str(tmp_path), online=False)
    p.register("d-1", d, cap)
    p.decode_load(0.0)  # type: ignore[misc]
    served = []
    for share in (1.0, 0.8, 0.5):
        held = dataclasses.replace(r, kv_capacity_tokens=int(cap / share))
        want = sum(w * x for w, x in zip(TRUE["tbt"], tbt_features(held, 1.0, 40, 3 * cap, 500, 300), strict=True))
        state = DecodeState("d-1", 40, 3 * cap, share)
        served.append(p.tbt.tbt(state, 500, 300))
        assert served[-1] == pytest.approx(want, rel=1e-3)
        assert p.tbt.tbt_many([state], 500, 300) == [served[-1]]  # type: ignore[attr-defined]
    assert served[0] < served[1] < served[2]
    # a file fitted before the share was recorded read every full cache at share 1: served so
    raw = json.load(open(os.path.join(str(tmp_path), MODELS_FILE)))
    assert raw["meta"][TBT_KV_SHARE] is True
    del raw["meta"][TBT_KV_SHARE]
    os.makedirs(tmp_path / "old")
    with open(tmp_path / "old" / MODELS_FILE, "w") as f:
        json.dump(raw, f)
    old = learned_predictors(str(tmp_path / "old"), online=False)
    old.register("d-1", d, cap)
    old.decode_load(0.0)  # type: ignore[misc]
    assert old.tbt.tbt(DecodeState("d-1", 40, 3 * cap, 0.5), 500, 300) == pytest.approx(served[0], rel=1e-9)


def test_the_median_of_many_rows_is_fitted_on_a_seeded_sample(monkeypatch):
    """Past MEDIAN_ROWS the median is fitted on a seeded random sample (its LP grows faster than
    the rows): the same answer every time, a non-negative truth still recovered, offsets kept
    with their rows."""
    import numpy as np

    from predictors import fit_weights

    monkeypatch.setattr(fit_weights, "MEDIAN_ROWS", 50)
    rows: list[int] = []
    real = fit_weights.linprog

    def counted(c, **kw):
        rows.append(len(c))  # the dual program: one variable per row
        return real(c, **kw)

    monkeypatch.setattr(fit_weights, "linprog", counted)
    rng = np.random.default_rng(1)
    x = rng.uniform(0.1, 1.0, (500, 3))
    offset = rng.uniform(0.0, 0.5, 500)
    y = x @ np.array([0.5, 0.0, 2.0]) + offset
    w = fit_weights.median_weights(x, y, offset)
    assert w == pytest.approx([0.5, 0.0, 2.0], abs=1e-6)
    assert (fit_weights.median_weights(x, y, offset) == w).all()
    assert rows == [50, 50]
