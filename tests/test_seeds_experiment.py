"""bench/experiments/seeds.py: the best other is taken per seed, the ratios and their summary follow
from the runs, and a seed reaches the simulation (another seed, another run; the same seed, the
same run). One small simulation, no server."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "experiments"))  # seeds imports _common and friends by name

import _common as C  # noqa: E402
import overload_admission as O  # noqa: E402
import seeds as S  # noqa: E402

from loadgen.workload import read_trace  # noqa: E402
from predictors.telemetry import SLO  # noqa: E402
from scheduler.policies import POLICIES  # noqa: E402


def test_the_best_other_is_taken_per_seed_and_the_ratios_follow():
    runs = {S.DEFERRED: [0.9, 0.8, 0.6], "a": [0.75, 0.5, 0.6], "b": [0.6, 0.64, 0.3]}
    s = S.point_summary(runs)
    assert s["best"] == ["a", "b", "a"]
    assert s["ratios"] == pytest.approx([1.2, 1.25, 1.0])
    assert s["ratio_mean"] == pytest.approx(3.45 / 3)
    assert (s["ratio_min"], s["ratio_max"]) == (pytest.approx(1.0), pytest.approx(1.25))
    # the best mean of another ("a", 0.6167) is not every seed's best
    assert s["best_mean"] == "a" and s["ratio_of_means"] == pytest.approx((2.3 / 3) / (1.85 / 3))


def test_a_seed_reaches_the_simulation():
    w = read_trace(os.path.join(ROOT, "data", "traces", "mooncake_conversation_trace.jsonl"), limit=40)
    slo = SLO(5.0, 0.2)

    def ttfts(seed: int) -> list[float | None]:
        spec = C.cluster(2, 2, seed=seed)
        _, recs = O.sweep(w, spec, ["round_robin"], 4.0, slo, "analytic", {}, 1, None, seed=seed)["round_robin"]
        return [r.ttft_s for r in sorted(recs, key=lambda r: r.arrival_s)]

    first = ttfts(0)
    assert ttfts(0) == first
    assert ttfts(1) != first


def test_each_workload_takes_the_setting_its_own_training_slice_prefers():
    # two points; "b" has the better mean here (0.85 vs 0.80) though "a" wins one point
    r = {"tuning": {"30@8": {"off": 0.5, "a": 0.9, "b": 0.8}, "5@8": {"off": 0.4, "a": 0.7, "b": 0.9}}}
    assert S.D.per_workload(r, ["a", "b"]) == "b"
    tied = {"tuning": {"30@8": {"a": 0.6, "b": 0.6}}}
    assert S.D.per_workload(tied, ["a", "b"]) == "a" and S.D.per_workload(tied, ["b", "a"]) == "b"


def test_all_others_are_every_built_in_policy_but_conductor():
    every = S.others("synthetic", True)
    assert set(every) == {p for p in POLICIES if not p.startswith("conductor")}
    assert S.others("synthetic", False) == S.G.BASELINES["synthetic"] and len(every) > len(S.others("synthetic", False))


def test_the_hit_table_names_the_other_with_the_most_and_says_when_conductor_has_less(monkeypatch):
    monkeypatch.setattr(S, "reuse_bounds", lambda: {"synthetic": 0.5})
    pt = {"ttft_s": 30.0, "load": 2.5, "hits": {S.DEFERRED: [0.40, 0.44], "a": [0.45, 0.45], "b": [0.1, 0.1]}}
    table = S.hits_table([{"workload": "synthetic", "points": [pt]}])
    row = next(line for line in table.splitlines() if line.startswith("| synthetic"))
    assert "a 45.0%" in row and "**no**" in row and "**42.0%**" in row and "0.84" in row
    pt["hits"]["a"] = [0.3, 0.3]
    row = next(line for line in S.hits_table([{"workload": "synthetic", "points": [pt]}]).splitlines()
               if line.startswith("| synthetic"))
    assert "| yes |" in row and "a 30.0%" in row
    assert S.hits_table([{"workload": "synthetic", "points": [{"ttft_s": 30.0, "load": 2.5}]}]) == ""


def test_a_trace_without_reuse_has_no_hit_verdict(monkeypatch):
    monkeypatch.setattr(S, "reuse_bounds", lambda: {"azure_code": 0.00002})
    pt = {"ttft_s": 5.0, "load": 4.0, "hits": {S.DEFERRED: [0.00001], "a": [0.00003]}}
    row = next(line for line in S.hits_table([{"workload": "azure_code", "points": [pt]}]).splitlines()
               if line.startswith("| azure_code"))
    assert "- (no reuse)" in row and "**no**" not in row


def test_the_figure_is_drawn_from_the_results_and_the_page_shows_it(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "reuse_bounds", lambda: {"synthetic": 0.5})
    runs = {S.DEFERRED: [0.9, 0.8], "a": [0.75, 0.5], "b": [0.6, 0.64]}
    pt = {"ttft_s": 30.0, "load": 2.5, "runs": runs, **S.point_summary(runs)}
    results = [{"workload": "synthetic", "points": [pt, {**pt, "load": 3.5}]}]
    path = tmp_path / "seeds" / "ratios.png"
    S.plot(results, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = S.render(results, "cmd", "some setting")
    assert f"]({S.FIGURE})" in page and S.FIGURE.endswith("ratios.png")
