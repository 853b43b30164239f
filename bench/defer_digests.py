"""Deferred-dispatch digests: every decision the wait room makes, to compare two versions of the
room (or of the scheduler under it) that must decide alike (a speed-up of the pump).

bench/decision_digests.py never turns the wait room on; this does, at ``defer_scan`` 4 and 64:

* ``sim``: virtual-time runs (``loadgen.simulate.run.simulate``, what ``conductor simulate`` runs)
  with ``defer=on`` on a synthetic multi-turn workload (2P+2D, overloaded), the conversation trace
  and the Azure code trace (4P+4D, sped up), plus ``defer_spill``, ``defer_last_chance``, ``defer_wait_holder``
  and fairness-floor (``defer_floor_every``, ``defer_slack_aging``) variants. One line per decision the
  room hands out (``offer`` and each ``pump``): request id,
  prefill, decode, predicted TTFT and TBT, refusal reason, a digest of the whole explanation
  record (with its ``deferred`` note: cost, floor, evaluations); then one line per request record
  (digest of ``RequestRecord.to_dict()``) and the room's counts;
* ``world``: bench/defer_latency.py's 64P+64D world (100k blocks), offers and a pump after each,
  one line per decision and, after each pump, a digest of every waiter's state (its cost, floor,
  chosen instance, last chance, evaluations): the views the next pump orders and expires by.

Run: ``.venv/bin/python bench/defer_digests.py OUT [--quick]`` at each version, then ``cmp`` the files.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import decision_latency as dl  # noqa: E402

from loadgen.arrivals import sped_up  # noqa: E402
from loadgen.simulate.cluster import ClusterSpec, SchedulerSpec  # noqa: E402
from loadgen.simulate.oracle import predictors_factory  # noqa: E402
from loadgen.simulate.run import simulate  # noqa: E402
from loadgen.synthetic import parse_dist, synthetic_workload  # noqa: E402
from loadgen.workload import bundled_trace, read_trace  # noqa: E402
from predictors.telemetry import SLO, RequestRecord  # noqa: E402
from scheduler.deferral import DeferParams, WaitRoom  # noqa: E402
from scheduler.lifecycle import RequestLifecycle  # noqa: E402


def digest(rec: object) -> str:
    return hashlib.sha1(json.dumps(rec, sort_keys=True, default=repr).encode()).hexdigest()[:16]


def line(*fields: object) -> str:
    return json.dumps(fields, default=repr) + "\n"


def decision_line(label: str, where: str, rid: str, d: Any) -> str:
    return line(label, where, rid, type(d).__name__, getattr(d, "prefill", None), getattr(d, "decode", None),
                getattr(d, "ttft_s", None), getattr(d, "tbt_s", None), getattr(d, "reason", None),
                digest(getattr(d, "explanation", None)))


def waiters_line(label: str, room: WaitRoom) -> str:
    st = [(rid, w.cost_s, w.floor_s, w.instance, w.due_s, w.evaluations, w.seq)
          for rid, w in sorted(room._waiting.items())]
    return line(label, "waiters", len(st), digest(st))


class _Tap:
    """Wraps ``WaitRoom.offer`` and ``WaitRoom.pump`` to write every decision they hand out."""

    def __init__(self, out: TextIO):
        self.out, self.label = out, ""
        self.offer, self.pump = WaitRoom.offer, WaitRoom.pump

    def __enter__(self) -> _Tap:
        tap = self

        def offer(room: WaitRoom, lc: RequestLifecycle, facts: Any) -> Any:
            d = tap.offer(room, lc, facts)
            tap.out.write(decision_line(tap.label, "offer", lc.request_id, d))
            return d

        def pump(room: WaitRoom) -> Any:
            out = tap.pump(room)
            for lc, d in out:
                tap.out.write(decision_line(tap.label, "pump", lc.request_id, d))
            if room._waiting:
                tap.out.write(waiters_line(tap.label, room))
            return out

        WaitRoom.offer, WaitRoom.pump = offer, pump  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        WaitRoom.offer, WaitRoom.pump = self.offer, self.pump  # type: ignore[method-assign]


LEARNED = str(Path(__file__).resolve().parents[1] / "docs/runs/learned-8b-gap-conversation")


def sim_runs(quick: bool) -> list[tuple[str, Any, ClusterSpec, SLO, dict[str, Any]]]:
    n = 150 if quick else 400
    synth = synthetic_workload(n, 60.0, input_tokens=parse_dist("lognormal:1500:0.6"),
                               output_tokens=parse_dist("lognormal:64:0.5"), turns=3, turn_gap_s=2.0,
                               shared_prefix_blocks=1, seed=1)
    m = 150 if quick else 500
    conv = sped_up(read_trace(str(bundled_trace("mooncake_conversation_trace.jsonl")), limit=m), 40.0)
    azure = sped_up(read_trace(str(bundled_trace("azure_code_2023.csv")), limit=m), 60.0)
    small = ClusterSpec(prefill=2, decode=2, seed=3)
    four = ClusterSpec(prefill=4, decode=4, seed=3)
    tuned = {"defer": True, "defer_horizon_s": 1.0, "defer_aging": 0.05}
    runs: list[tuple[str, Any, ClusterSpec, SLO, dict[str, Any]]] = []
    for scan in (4, 64):
        runs += [
            (f"synthetic scan {scan}", synth, small, SLO(0.5, 0.2),
             {"defer": True, "defer_horizon_s": 0.05, "defer_aging": 0.05, "defer_scan": scan}),
            (f"conversation scan {scan}", conv, four, SLO(5.0, 0.2), {**tuned, "defer_scan": scan}),
            (f"azure_code scan {scan}", azure, four, SLO(5.0, 0.2), {**tuned, "defer_scan": scan}),
        ]
    runs += [("synthetic spill scan 64", synth, small, SLO(0.5, 0.2),
              {"defer": True, "defer_horizon_s": 0.05, "defer_aging": 0.05, "defer_scan": 64, "defer_spill": True,
               "defer_spill_ratio": 1.5}),
             ("conversation last_chance scan 64", conv, four, SLO(5.0, 0.2),
              {**tuned, "defer_scan": 64, "defer_last_chance": True}),
             ("synthetic wait_holder scan 64", synth, small, SLO(0.5, 0.2),
              {"defer": True, "defer_horizon_s": 0.05, "defer_aging": 0.05, "defer_scan": 64,
               "defer_wait_holder": True, "defer_holder_ratio": 1.5}),
             ("conversation wait_holder scan 64", conv, four, SLO(5.0, 0.2),
              {**tuned, "defer_scan": 64, "defer_wait_holder": True, "defer_holder_ratio": 1.5}),
             # learned predictors with online correction: predictions move as requests finish
             ("conversation learned scan 64", conv, four, SLO(5.0, 0.2),
              {**tuned, "defer_scan": 64, "models": LEARNED}),
             # the fairness floor and slack aging (on the tuned setting with wait holder)
             ("conversation floor 4 scan 64", conv, four, SLO(5.0, 0.2),
              {**tuned, "defer_scan": 64, "defer_wait_holder": True, "defer_floor_every": 4}),
             ("azure_code floor 2 slack aging scan 64", azure, four, SLO(5.0, 0.2),
              {**tuned, "defer_scan": 64, "defer_floor_every": 2, "defer_floor_quantile": 0.5,
               "defer_slack_aging": True})]
    return runs


def run_sim(out: TextIO, tap: _Tap, quick: bool) -> None:
    for label, w, cluster, slo, params in sim_runs(quick):
        tap.label = label
        params = dict(params)
        models = params.pop("models", "analytic")
        r = simulate(w, cluster, SchedulerSpec(policy="conductor", policy_params=params, slo=slo), progress=None,
                     predictors=predictors_factory(models, cluster))
        for rec in r.records:
            out.write(line(label, "record", rec.request_id, digest(rec.to_dict())))
        out.write(line(label, "counts", r.scheduler_counts))
        print(label, r.scheduler_counts, file=sys.stderr)


def run_world(out: TextIO, tap: _Tap, quick: bool) -> None:
    """bench/defer_latency.py's scenario, decisions only (no timing)."""
    n = 600 if quick else 1500
    for scan in (4, 64):
        tap.label = f"world 64P scan {scan}"
        sched, world = dl.build("conductor", 1, True)
        sched.slo = SLO(ttft_s=30.0)
        room = WaitRoom(sched, DeferParams(enabled=True, horizon_s=0.02, aging=0.05, scan=scan))
        clock, rng, live = world["clock"], world["rng"], world.setdefault("live", [])
        for f in dl.requests(world, n):
            clock[0] += 0.01
            lc = RequestLifecycle(sched, RequestRecord(f.request_id, clock[0]), sched.clock)
            d = room.offer(lc, f)
            dl.advance(sched, rng, live, f.request_id if hasattr(d, "prefill") else None, 256)
            if len(room):
                for lc2, d2 in room.pump():
                    dl.advance(sched, rng, live, lc2.request_id if hasattr(d2, "prefill") else None, 256)
                for rid in list(room._waiting)[:-64]:  # bound the room (clients time out)
                    c = room.cancel(rid)
                    if c is not None:
                        c.finish("aborted")
        out.write(line(tap.label, "counts", room.counts, digest(list(sched.decisions))))
        print(tap.label, room.counts, file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="file to write the digest lines to")
    ap.add_argument("--quick", action="store_true", help="fewer requests per run (a smoke check)")
    ap.add_argument("--only", choices=("sim", "world"), help="one part only")
    a = ap.parse_args()
    with open(a.out, "w") as out, _Tap(out) as tap:
        if a.only in (None, "sim"):
            run_sim(out, tap, a.quick)
        if a.only in (None, "world"):
            run_world(out, tap, a.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
