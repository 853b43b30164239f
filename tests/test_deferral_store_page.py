"""bench/experiments/deferral_store.py (deferral.py --store) renders deferral-store.md from its
results: the best other policy is picked from the store-on runs (with and without deferral), the
ratios are taken against it, and each run's store share and store-off figures land on its row.
No simulation is run."""
from __future__ import annotations

import argparse
import os
import sys

from predictors.telemetry import RequestRecord

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "experiments"))  # the drivers import _common by name

import deferral as D  # noqa: E402
import deferral_store as S  # noqa: E402


def _run(att: float, hit: float, store: int = 0, prompt: int = 1000) -> dict:
    return {"slo_attainment": att, "hit_ratio": hit,
            "transfers": {"prompt_tokens": prompt, "store_tokens": store, "peer_tokens": 0}}


def _results() -> list[dict]:
    runs = {"conductor": _run(0.60, 0.30, 100), "conductor + defer": _run(0.66, 0.32, 160),
            "prefix_only": _run(0.50, 0.28, 80), "sglang_cache_aware": _run(0.55, 0.31, 90),
            "sglang_cache_aware + defer": _run(0.60, 0.33, 120)}
    off = {"conductor": {"slo_attainment": 0.58, "hit_ratio": 0.28},
           "conductor + defer": {"slo_attainment": 0.62, "hit_ratio": 0.29},
           "prefix_only": {"slo_attainment": 0.56, "hit_ratio": 0.27},
           "prefix_only + defer": {"slo_attainment": 0.60, "hit_ratio": 0.30}}
    # reruns without the store: what deferral.md lacks (sglang_cache_aware) and, here, conductor's again
    rerun = {"conductor": _run(0.57, 0.27), "conductor + defer": _run(0.61, 0.29),
             "sglang_cache_aware": _run(0.52, 0.28)}
    return [{"workload": "conversation", "eval": 1500,
             "points": [{"ttft_s": 5.0, "load": 8.0, "runs": runs, "store_off": off, "rerun_off": rerun}]}]


def _args() -> argparse.Namespace:
    return argparse.Namespace(prefill=8, decode=8, slo_tbt_ms=200.0, train=1000)


def _row(page: str, first_cells: str) -> list[str]:
    line = next(x for x in page.splitlines() if x.startswith(first_cells))
    return [c.strip() for c in line.strip("|").split("|")]


def test_best_other_is_taken_from_the_store_runs_without_deferral_unless_asked():
    runs = _results()[0]["points"][0]["runs"]
    assert S.best_other(runs) == "sglang_cache_aware"
    assert S.best_other(runs, defer=True) == "sglang_cache_aware + defer"


def test_the_page_shows_ratios_store_shares_and_the_store_off_figures():
    page = S.render(_results(), _args(), "cmd")
    summary = _row(page, "| conversation | 5 s | 8x | sglang_cache_aware 55.0%")
    assert summary[3:] == ["sglang_cache_aware 55.0%", "sglang_cache_aware + defer 60.0%", "60.0%", "**66.0%**",
                           "1.09x", "**1.20x**", "1.10x", "1.02x (prefix_only)", "1.09x (prefix_only)",
                           "1.02x (prefix_only + defer)"]
    row = _row(page, "| conversation | 5 s | 8x | **conductor + defer**")
    # 160 of 1000 prompt tokens from the store, half of the 32% hit; +5 points over the rerun without it (61%)
    assert row[4:] == ["66.0%", "32.0%", "16.0%", "50%", "0", "61.0%", "29.0%", "0 (rerun)", "+5.0"]
    # run neither off here nor in deferral.md: no store-off figure, no gain
    assert _row(page, "| conversation | 5 s | 8x | sglang_cache_aware + defer | ")[-4:] == ["-"] * 4


def test_without_a_rerun_the_store_gain_is_against_deferral_md():
    res = _results()
    del res[0]["points"][0]["rerun_off"]["conductor"]
    row = _row(S.render(res, _args(), "cmd"), "| conversation | 5 s | 8x | **conductor** |")
    assert row[-4:] == ["58.0%", "28.0%", "- (deferral.md)", "+2.0"]


def test_labels_put_the_best_other_and_its_deferral_before_the_rest():
    runs = S.labels("synthetic", ["prefix_only", "sglang_cache_aware"])
    assert [x[0] for x in runs] == ["conductor", "conductor + defer", "sglang_cache_aware",
                                    "sglang_cache_aware + defer", "prefix_only", "dynamo_cost", "prefix_only + defer"]
    assert dict((x[0], x[2]) for x in runs)["prefix_only + defer"] == S.DEFER


def test_transfers_split_the_pulled_tokens_by_source_over_completed_requests():
    recs = [RequestRecord("a", 0.0, prompt_tokens=100, status="ok", transfer_tokens=40, transfer_from="store"),
            RequestRecord("b", 0.0, prompt_tokens=100, status="ok", transfer_tokens=30, transfer_from="p1"),
            RequestRecord("c", 0.0, prompt_tokens=100, status="rejected", transfer_tokens=50, transfer_from="store"),
            RequestRecord("d", 0.0, prompt_tokens=100, status="ok")]
    assert D.transfers(recs) == {"prompt_tokens": 300, "store_tokens": 40, "peer_tokens": 30}


def test_follow_up_rows_name_the_store_mode_and_the_loads_from_the_store():
    res = _results()
    f = {"follow_ups": 10, "follow_met": 0.7, "follow_refused": 0.2, "new": 90, "new_met": 0.8,
         "same_instance": 0.5, "pairs": 8, "pulled": 12}
    res[0]["points"][0]["follow"] = {"on conductor + defer": f, "off prefix_only": {**f, "pulled": 0}}
    page = S.render(res, _args(), "cmd")
    assert _row(page, "| conversation | 5 s | 8x | **on conductor + defer**")[4:] == [
        "70.0% (n 10)", "20.0%", "80.0% (n 90)", "50.0% (n 8)", "12"]
    assert _row(page, "| conversation | 5 s | 8x | off prefix_only")[-1] == "0"
    assert "**Follow-ups**" not in S.render(_results(), _args(), "cmd")
