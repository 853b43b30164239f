"""Pump cost of two checkouts of the scheduler, back to back: bench/defer_latency.py (this
checkout's script) run with ``--root OLD`` and with this checkout, alternating, ``--rounds`` times
per ``defer_scan``, so a busy moment of a shared machine lands on both. Both decide the very
same stream (bench/defer_digests.py checks they decide alike). Prints one JSON line per run and
a summary: per scan, the median over rounds of each figure, and old / new ratios. Thread CPU is
the fairer figure on a shared machine (wall time there is mostly other processes).

Run: ``.venv/bin/python bench/defer_pump_compare.py OLD_DIR [--rounds 2] [--decisions 600] [--scans 4 64]``
(``OLD_DIR``: e.g. ``git worktree add /tmp/old main``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "defer_latency.py"
FIGURES = ("pump_p50_ms", "pump_p99_ms", "pump_cpu_p50_ms", "pump_cpu_p99_ms", "pump_cpu_ms_per_evaluation",
           "offer_p50_ms", "decide_p50_ms")


def run(root: str | None, scan: int, decisions: int, horizon: float) -> dict:
    cmd = [sys.executable, str(SCRIPT), "--scan", str(scan), "--decisions", str(decisions), "--horizon", str(horizon)]
    if root is not None:
        cmd += ["--root", root]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", help="the other checkout's root (its scheduler is imported)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--decisions", type=int, default=600)
    ap.add_argument("--horizon", type=float, default=0.02)
    ap.add_argument("--scans", type=int, nargs="+", default=[4, 64])
    a = ap.parse_args()
    summary = {}
    for scan in a.scans:
        got: dict[str, list[dict]] = {"old": [], "new": []}
        for k in range(a.rounds):
            order = [("old", a.old), ("new", None)] if k % 2 == 0 else [("new", None), ("old", a.old)]
            for name, root in order:
                r = run(root, scan, a.decisions, a.horizon)
                got[name].append(r)
                print(json.dumps({"scan": scan, "round": k, "version": name, **{f: r[f] for f in FIGURES},
                                  "pump_evaluations": r["pump_evaluations"]}), flush=True)
        med = {name: {f: statistics.median(r[f] for r in rs) for f in FIGURES} for name, rs in got.items()}
        summary[scan] = {"old": med["old"], "new": med["new"],
                         "old_over_new": {f: round(med["old"][f] / med["new"][f], 2) for f in FIGURES if med["new"][f]}}
    print(json.dumps({"summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
