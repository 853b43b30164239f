"""bench/experiments/tight_overload.py: the bound's verdict per point follows the ceiling over the best
other's mean, and the training table marks the setting chosen. Pure rendering, no simulation."""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "experiments"))  # the driver imports _common and friends by name

import seeds as S  # noqa: E402
import tight_overload as T  # noqa: E402


def _result(bound: float, noisy: float) -> dict:
    runs = {S.DEFERRED: [0.50, 0.52], "a": [0.40, 0.42], "b": [0.43, 0.38]}
    pt = {"ttft_s": 5.0, "load": 16.0, "runs": runs, **S.point_summary(runs)}
    return {"workload": "conversation", "setting": "tuned, join", "points": [pt],
            "bounds": {"5@16": {"mean": bound, "noisy": noisy}},
            "tuning": {"5@16": {"tuned, pools": 0.47, "tuned, join": 0.49}}}


def _row(table: str) -> list[str]:
    return [c.strip() for c in next(x for x in table.splitlines() if x.startswith("| conversation")).split("|")[1:-1]]


def test_the_verdict_follows_the_ceiling_over_the_best_others_mean():
    # the best mean of another is "a" at 41%: 1.2x needs 49.2%
    row = _row(T.bound_table([_result(0.60, 0.64)], 4.0))
    assert "a 41.0%" in row and "**1.46x** (1.56x)" in row and "not excluded" in row
    assert row[-2] == f"{0.51 / 0.60:.2f}" and row[-1] == f"{1.2 * 0.41 / 0.60:.2f}"
    assert "impossible at mean step times" in _row(T.bound_table([_result(0.48, 0.50)], 4.0))
    assert "**impossible**" in _row(T.bound_table([_result(0.45, 0.48)], 4.0))


def test_the_training_table_marks_the_chosen_setting():
    row = _row(T.tuning_table([_result(0.6, 0.64)]))
    assert row[3:5] == ["47.0%", "**49.0%**"]
    assert "join" in T.tuning_table([_result(0.6, 0.64)]).splitlines()[0]
