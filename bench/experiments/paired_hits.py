"""Prefix hit on the *same* requests: conductor against each baseline of a goodput_curves.py run.

    .venv/bin/python bench/experiments/paired_hits.py [--workloads conversation,synthetic]

A run's prefix-hit ratio is over the requests it completed, and policies complete different
requests (a cache-greedy policy refuses more of the long, little-reused prompts). This reads the
same run's out/experiments/goodput-curves/<workload>/ttft<S>-<load>/{all,affinity0.1s}/requests.jsonl
and compares hit ratios over the requests *both* policies completed, so what differs is placement.
Prints one markdown table.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import _common as C

ROOT = C.OUT / "goodput-curves"


def load(path: Path) -> dict[str, dict[str, dict]]:
    """target -> request id (without the run prefix) -> record."""
    out: dict[str, dict[str, dict]] = {}
    if not path.exists():
        return out
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            rid = r["request_id"].rsplit("-", 1)[-1]
            out.setdefault(r["extra"]["target"], {})[rid] = r
    return out


def hit(recs: list[dict]) -> float:
    return sum(r["cached_tokens"] or 0 for r in recs) / max(1, sum(r["prompt_tokens"] for r in recs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="conversation,synthetic")
    a = p.parse_args()
    rows = []
    for name in a.workloads.split(","):
        for d in sorted((ROOT / name).glob("ttft*"), key=lambda x: [float(v) for v in x.name[4:].split("-")]):
            runs = load(d / "all" / "requests.jsonl")
            aff = load(d / "affinity0.1s" / "requests.jsonl")
            if aff:
                runs["conductor (affinity 0.1 s)"] = next(iter(aff.values()))
            ttft, lo = d.name[4:].split("-")
            for mine in ("conductor", "conductor (affinity 0.1 s)"):
                if mine not in runs:
                    continue
                for other in sorted(k for k in runs if not k.startswith("conductor")):
                    both = [k for k, r in runs[mine].items()
                            if r["status"] == "ok" and runs[other][k]["status"] == "ok"]
                    rows.append([name, f"{ttft} s", lo, mine, other, len(both),
                                 C.pct(hit([runs[mine][k] for k in both])), C.pct(hit([runs[other][k] for k in both])),
                                 C.pct(hit([r for r in runs[mine].values() if r["status"] == "ok"])),
                                 C.pct(hit([r for r in runs[other].values() if r["status"] == "ok"]))])
    print(C.md_table(["workload", "TTFT SLO", "load", "conductor run", "baseline", "completed by both",
                      "conductor hit (both)", "baseline hit (both)", "conductor hit (own)", "baseline hit (own)"],
                     rows))


if __name__ == "__main__":
    main()
