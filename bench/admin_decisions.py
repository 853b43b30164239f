"""What ``GET /admin/decisions`` costs the event loop, before and after paging.

Fills a conductor scheduler's decision log (1,000 records, the default ``keep_decisions``) on a
8 prefill + 8 decode cluster, then times, on one thread as the gateway's event loop would run it:
  old_full_ms: the former answer to ``limit=10000``: every record through FastAPI's
               ``jsonable_encoder`` and a JSON response (its bytes in old_full_kb);
  new_page_ms: today's largest page (``limit=100``, capped) through ``decisions_page``
               (its bytes in new_page_kb); median of 20 runs each.
Timings are wall-clock on a shared machine: read the ratio.

Run: ``.venv/bin/python bench/admin_decisions.py``.
"""
from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastapi.encoders import jsonable_encoder  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402

from gateway.admin import NumberedLog, decisions_page, number_decisions  # noqa: E402
from predictors.telemetry import SLO  # noqa: E402
from scheduler import Instance, RequestFacts, Scheduler  # noqa: E402
from scheduler.hashing import block_hashes  # noqa: E402


def filled_log(n: int = 1000) -> NumberedLog:
    t = [0.0]
    instances = [Instance(f"p{i}", "prefill") for i in range(8)] + [Instance(f"d{i}", "decode") for i in range(8)]
    sched = Scheduler(instances, policy="conductor", slo=SLO(ttft_s=30.0, tbt_s=0.2), block_size=16,
                      clock=lambda: t[0], keep_decisions=n)
    for inst in list(sched.snapshot()["instances"]):
        sched.set_healthy(inst["id"], True)
    log = number_decisions(sched)
    rng = random.Random(1)
    for i in range(n):
        toks = [rng.randrange(32000) for _ in range(rng.randrange(500, 4000))]
        sched.decide(RequestFacts(f"req-{i}", len(toks), block_hashes(toks, 16), 128))
        sched.release(f"req-{i}")
        t[0] += 0.01
    return log


def median_ms(fn, runs: int = 20) -> tuple[float, int]:
    times, size = [], 0
    for _ in range(runs):
        t0 = time.perf_counter()
        size = len(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, size


def main() -> None:
    log = filled_log()
    old_ms, old_bytes = median_ms(lambda: JSONResponse(jsonable_encoder({"decisions": list(log)[-10_000:]})).body)
    new_ms, new_bytes = median_ms(lambda: decisions_page(log, {"limit": "10000"}).body)
    assert len(json.loads(decisions_page(log, {"limit": "10000"}).body)["decisions"]) == 100
    print(json.dumps({"records": len(log), "old_full_ms": round(old_ms, 2), "old_full_kb": round(old_bytes / 1024),
                      "new_page_ms": round(new_ms, 2), "new_page_kb": round(new_bytes / 1024),
                      "ratio": round(old_ms / new_ms, 1)}))


if __name__ == "__main__":
    main()
