"""Which requests a run left unserved, and whether a prefix shared with another request would have
made them cheap: the analysis behind ``defer_share`` (docs/experiments/deferral.md's discussion).

    .venv/bin/python bench/experiments/siblings.py out/experiments/deferral/conversation/ttft30-8/conductor-defer \
        [--workload conversation] [--load 8] [--ttft 30] [--train 1000] [--eval 1500]

Reads a deferral.py run's requests.jsonl and its evaluation slice (the trace's block ids). Prints the
requests served within the TTFT SLO by uncached prompt tokens (the prompt less the predicted hit),
each prefill instance's busy share from the first arrival to the last deadline, and of the requests
not served: how many share at least half their prompt with another request arriving within one SLO,
and whether any such sibling was served.
"""
from __future__ import annotations

import argparse
import collections
import itertools
import json
from pathlib import Path
from typing import Any

import _common as C  # noqa: F401  (puts the project on the path)
import baselines as B

from loadgen.workload import TRACE_BLOCK_TOKENS  # noqa: E402

BINS = [0, 2000, 4000, 8000, 16000, 32000, 64000, float("inf")]


def met(r: dict[str, Any] | None, ttft: float) -> bool:
    return bool(r) and r["status"] == "ok" and r["ttft_s"] is not None and r["ttft_s"] <= ttft


def by_uncached(recs: list[dict[str, Any]], ttft: float) -> list[tuple[float, float, int, int]]:
    """(low, high, requests, served within the SLO) per bin of uncached prompt tokens."""
    out = []
    for lo, hi in itertools.pairwise(BINS):
        sel = [r for r in recs if lo <= r["prompt_tokens"] - (r.get("hit_tokens") or 0) < hi]
        out.append((lo, hi, len(sel), sum(met(r, ttft) for r in sel)))
    return out


def busy(recs: list[dict[str, Any]], ttft: float) -> dict[str, float]:
    """Each prefill instance's share of [0, last arrival + SLO] with a prefill running."""
    end = max(r["arrival_s"] for r in recs) + ttft
    spans: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for r in recs:
        if r.get("prefill_start_s") is not None and r.get("prefill_end_s") is not None:
            spans[r["prefill_instance"]].append((min(r["prefill_start_s"], end), min(r["prefill_end_s"], end)))
    out = {}
    for inst, v in sorted(spans.items()):
        total = cur_s = cur_e = 0.0
        for s, e in sorted(v):
            if s > cur_e:  # a gap: close the busy run so far
                total, cur_s = total + cur_e - cur_s, s
            cur_e = max(cur_e, e)
        total += cur_e - cur_s
        out[inst] = total / end
    return out


def siblings(requests: list[Any], recs: dict[int, dict[str, Any]], load: float, ttft: float,
             block: int = TRACE_BLOCK_TOKENS) -> collections.Counter:
    """Of the unserved requests: those sharing at least half their prompt (in whole blocks) with
    another arriving within one SLO, split by whether any such sibling was served."""
    by_prefix: dict[tuple[int, ...], list[Any]] = collections.defaultdict(list)
    for q in requests:
        for k in range(1, len(q.hash_ids) + 1):
            by_prefix[tuple(q.hash_ids[:k])].append(q)
    out: collections.Counter = collections.Counter()
    for q in requests:
        if q.index not in recs or met(recs[q.index], ttft):
            continue
        t, hs = q.arrival_s / load, tuple(q.hash_ids)
        for k in range(len(hs), 1, -1):
            near = [o for o in by_prefix[hs[:k]] if o is not q and abs(o.arrival_s / load - t) <= ttft]
            if near:
                break
        else:
            out["shares no prefix"] += 1
            continue
        if 2 * k * block < q.input_length:
            out["shares under half its prompt"] += 1
        elif any(met(recs.get(o.index), ttft) for o in near):
            out["shares half or more, a sibling served"] += 1
        else:
            out["shares half or more, no sibling served"] += 1
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a run's output directory (with requests.jsonl)")
    p.add_argument("--workload", default="conversation", choices=["conversation", "azure_code"])
    p.add_argument("--load", type=float, default=8.0, help="the run's trace speed-up")
    p.add_argument("--ttft", type=float, default=30.0, help="the TTFT SLO (s)")
    p.add_argument("--train", type=int, default=1000)
    p.add_argument("--eval", type=int, default=1500)
    a = p.parse_args()
    path = a.run / "requests.jsonl"
    if not path.exists():
        p.error(f"no requests.jsonl in {a.run}")
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    print(f"{len(recs)} requests, {sum(met(r, a.ttft) for r in recs)} within TTFT {a.ttft:g} s")
    for lo, hi, n, served in by_uncached(recs, a.ttft):
        print(f"  uncached tokens {lo:>6g}-{hi:<6g}: {served:4d} of {n:4d} served")
    print("prefill busy, first arrival to last deadline: "
          + " ".join(f"{k} {v:.2f}" for k, v in busy(recs, a.ttft).items()))
    _, w = B.slices(a.workload, a.train, a.eval)
    by_index = {r["extra"]["trace_index"]: r for r in recs}
    for k, v in sorted(siblings(w.requests, by_index, a.load, a.ttft, w.block_tokens).items()):
        print(f"  unserved, {k}: {v}")


if __name__ == "__main__":
    main()
