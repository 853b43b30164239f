"""bench/experiments/oracle_gap.py: the verdict is learned >= 0.9 x oracle, read from the runs."""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "experiments"))  # oracle_gap imports _common and friends by name

import oracle_gap as G  # noqa: E402


def _row(text: str, workload: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"| {workload} |"))


def test_within_ten_percent_of_the_oracle_is_read_from_the_runs():
    rows = [{"workload": "synthetic", "ttft_s": 30.0, "load": 2.5, "setting": "tuned, pools",
             "learned": 0.72, "oracle": 0.8},
            {"workload": "conversation", "ttft_s": 5.0, "load": 8.0, "setting": "horizon 1 s",
             "learned": 0.71, "oracle": 0.8}]
    text = G.render(rows, "cmd")
    ok, short = _row(text, "synthetic"), _row(text, "conversation")
    assert "**0.90**" in ok and "| yes |" in ok and "75 req/s" in ok and "| pools |" in ok
    assert "**0.89**" in short and "**no**" in short
