"""bench/experiments/attainment_bound.py: the bound for a `conductor simulate` command line, with
and without the decode pool, and the ceiling over a measured run."""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "experiments"))  # it imports _common by name

import attainment_bound as A  # noqa: E402

# decode-heavy: 6000-token prompts, 1500-token outputs at TBT <= 10 ms on one decode instance
FLAGS = ["--synthetic", "--requests", "80", "--rate", "40", "--input-tokens", "lognormal:6000:0.2",
         "--output-tokens", "lognormal:1500:0.2", "--prefill", "4", "--decode", "1", "--slo-ttft-ms", "5000",
         "--slo-tbt-ms", "10"]


def _bounds(text: str) -> dict[tuple[str, str], float]:
    found = re.findall(r"^\s*(prefill(?: \+ decode)?), steps at -(\S+) sigma: bound ([0-9.]+)", text, re.M)
    return {(pools, z): float(b) for pools, z, b in found}


def test_the_decode_pool_lowers_the_bound_of_a_decode_heavy_slice(tmp_path, capsys):
    measured = tmp_path / "summary.json"
    measured.write_text(json.dumps({"slo_attainment": 0.4}))
    assert A.main(["--measured", str(measured), "--", *FLAGS]) == 0
    out = capsys.readouterr().out
    b = _bounds(out)
    assert set(b) == {("prefill", "0"), ("prefill", "4"), ("prefill + decode", "0"), ("prefill + decode", "4")}
    assert b[("prefill + decode", "0")] < b[("prefill", "0")]
    assert b[("prefill + decode", "0")] <= b[("prefill + decode", "4")]  # faster steps only raise it
    ceiling = float(re.search(r"prefill \+ decode, steps at -0 sigma: .*ceiling ([0-9.]+)x", out).group(1))
    assert ceiling == pytest.approx(b[("prefill + decode", "0")] / 0.4, abs=1e-3)


def test_without_a_ttft_slo_it_says_so(capsys):
    with pytest.raises(SystemExit) as e:
        A.main(["--", *[f for f in FLAGS if f not in ("--slo-ttft-ms", "5000")]])
    assert e.value.code == 2 and "--slo-ttft-ms" in capsys.readouterr().err
