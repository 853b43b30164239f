"""Decision latency of the scheduler on a 64 prefill + 64 decode cluster with ~1M indexed blocks.

Prints one JSON line:
  instances; index_blocks (blocks held, all instances and tiers) and index_distinct_hashes;
  hash_ms_128k (block hashes of a 131072-token prompt at block size 16, median of 30);
  decide_p50_ms / decide_p99_ms / decide_max_ms (one ``decide`` given the hashes, conductor
  policy, ledger holding ~256 requests in flight, 5000 timed decisions after 500 warm-up);
  decide_128k_ms (a 127k-token prompt whose first 120k tokens sit on one instance);
  index_mb (the index's own estimate, as ``snapshot()`` reports it) and index_mb_walk (a full
  walk of every dict and int object it holds); p50/p99 per policy on a 100k-block index.

Workload: every prefill instance holds ~15.6k blocks: six shared documents (2k-8k tokens) from a
pool of 256, some also written to the shared store, plus its own conversation sessions (1k-8k
tokens, a fifth offloaded to host memory). Requests continue a session (50%), ask about a
document (30%) or are fresh (20%), 1k-9k tokens, 64-1024 output tokens. Events carry the
instance's own (salted) block hashes, as an engine with its own hash seed would send them.
Token ids live in ``array``s and requests are built one at a time, so the garbage collector
walks only what a gateway process would hold. Timings are wall-clock on a shared machine.

Run: ``.venv/bin/python bench/decision_latency.py [--quick] [--predictors analytic | --predictors learned DIR]``
(``DIR``: learned predictors written by ``conductor calibrate``, online correction on). With
learned predictors the run builds two identical worlds (same seed), one scheduler with the
analytic predictors and one with the learned ones, and decides the same request stream on both,
alternating blocks of 100 decisions, so a busy moment of a shared machine lands on both alike;
it prints both (``compare``) and skips the per-policy table. ``--floor`` adds a third world whose
predictors do no work (constant answers): the scheduler's own cost.

Two clocks per decision: wall (``perf_counter_ns``) and the thread's CPU time
(``thread_time_ns``), which leaves out the time the OS gave other processes (on a shared 2-core
machine the wall p99 is mostly preemption). The garbage collector is handled as the gateway does
(gateway/app.py): after start-up ``gc.collect()`` then ``gc.freeze()``; collections during the
timed decisions are counted (``gc_collections``), not suppressed.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from predictors.analytic import AnalyticQueue  # noqa: E402
from predictors.base import DecodeState, Predictors  # noqa: E402
from predictors.learned import ModelError, learned_predictors  # noqa: E402
from scheduler import Instance, RequestFacts, Scheduler  # noqa: E402
from scheduler.hashing import block_hashes  # noqa: E402

BS = 16
N_PREFILL = N_DECODE = 64
VOCAB = 128_000


def tokens(rng: random.Random, n: int) -> array:
    """Token ids as an untracked array: the garbage collector never walks the workload."""
    return array("I", [rng.randrange(VOCAB) for _ in range(n)])


class Engine:
    """Emits KV events the way an engine would: chained blocks named by its own block hashes."""

    def __init__(self, sched: Scheduler, instance: str, salt: int):
        self.sched, self.instance, self.salt = sched, instance, salt

    def store(self, toks: array, medium: str = "GPU", chunk_blocks: int = 64) -> None:
        ours = block_hashes(toks, BS)
        engine = [h ^ self.salt for h in ours]
        for start in range(0, len(ours), chunk_blocks):
            end = min(len(ours), start + chunk_blocks)
            parent = engine[start - 1] if start else None
            ok = self.sched.index.block_stored(self.instance, engine[start:end], parent,
                                               toks[start * BS:end * BS].tolist(), BS, medium)
            assert ok, "bench events must be consistent"


class Constant:
    """Predictors that do no work (the floor: what a decision costs whatever the predictors)."""

    def prefill_time(self, instance: str, prompt_tokens: int, cached_tokens: int) -> float:
        return 1e-7 * (prompt_tokens - cached_tokens)

    def transfer_time(self, tokens: int, source: str, destination: str) -> float:
        return 1e-3

    def tbt(self, state: DecodeState, prompt_tokens: int, max_tokens: int) -> float:
        return 0.01


def constant_predictors() -> Predictors:
    c = Constant()
    return Predictors(queue=AnalyticQueue(), prefill=c, transfer=c, tbt=c, group=lambda instance: 0)


def build(policy: str, seed: int, quick: bool, models: str | None = None, **sched_kw: Any
          ) -> tuple[Scheduler, dict]:
    """``models``: None (analytic), a learned predictors directory, or ``"constant"`` (the floor);
    ``sched_kw``: more Scheduler arguments (bench/room_arrival.py: an SLO and the wait room's)."""
    rng = random.Random(seed)
    now = [0.0]
    insts = [Instance(f"p{i:02d}", "prefill") for i in range(N_PREFILL)]
    insts += [Instance(f"d{i:02d}", "decode") for i in range(N_DECODE)]
    predictors = None if models is None else (
        constant_predictors() if models == "constant" else learned_predictors(models))  # online: per-instance groups
    sched = Scheduler(insts, policy=policy, clock=lambda: now[0], keep_decisions=1000, seed=seed,
                      predictors=predictors, **sched_kw)
    docs = [tokens(rng, rng.randrange(2048, 8192)) for _ in range(64 if quick else 256)]
    sessions: dict[str, list[array]] = {}
    target = (100_000 if quick else 1_000_000) // N_PREFILL
    for i in range(N_PREFILL):
        iid = f"p{i:02d}"
        eng = Engine(sched, iid, salt=rng.getrandbits(64))
        held = 0
        for d in rng.sample(range(len(docs)), 6):
            eng.store(docs[d])
            held += len(docs[d]) // BS
            if rng.random() < 0.3:
                eng.store(docs[d], medium="EXTERNAL")
        sessions[iid] = []
        while held < target or not sessions[iid]:
            s = tokens(rng, rng.randrange(1024, 8192))
            eng.store(s, medium="GPU" if rng.random() < 0.8 else "CPU")
            sessions[iid].append(s)
            held += len(s) // BS
    return sched, {"docs": docs, "sessions": sessions, "clock": now, "rng": rng}


def requests(world: dict, n: int) -> Iterator[RequestFacts]:
    """Request facts built one at a time (their hashing happens outside the timed call)."""
    rng = world["rng"]
    for k in range(n):
        r = rng.random()
        if r < 0.5:
            inst = rng.choice(list(world["sessions"]))
            toks = rng.choice(world["sessions"][inst]) + tokens(rng, 512)
        elif r < 0.8:
            toks = rng.choice(world["docs"]) + tokens(rng, 256)
        else:
            toks = tokens(rng, rng.randrange(1024, 9216))
        yield RequestFacts(f"r{k}", len(toks), block_hashes(toks, BS), rng.randrange(64, 1024))


def run(sched: Scheduler, world: dict, reqs: Iterator[RequestFacts], warmup: int, in_flight: int = 256,
        cpu: list[float] | None = None) -> list[float]:
    """Decide each request, keeping ~``in_flight`` reservations; returns per-call wall milliseconds
    (and appends per-call thread CPU milliseconds to ``cpu``)."""
    clock, rng = world["clock"], world["rng"]
    live: list[str] = world.setdefault("live", [])
    lat = []
    for k, f in enumerate(reqs):
        clock[0] += 0.01
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        d = sched.decide(f)
        t1 = time.perf_counter_ns()
        c1 = time.thread_time_ns()
        if k >= warmup:
            lat.append((t1 - t0) / 1e6)
            if cpu is not None:
                cpu.append((c1 - c0) / 1e6)
        advance(sched, rng, live, f.request_id if hasattr(d, "prefill") else None, in_flight)
    return lat


def advance(sched: Scheduler, rng: random.Random, live: list[str], placed: str | None, in_flight: int) -> None:
    """The stream moves on after a decision: ``placed`` joins the live requests, one of the older
    half finishes once over ``in_flight``, and a few of the newest end their prefill."""
    if placed is not None:
        live.append(placed)
    if len(live) > in_flight:
        done = live.pop(rng.randrange(len(live) // 2))
        sched.prefill_done(done)
        sched.release(done)
    for rid in live[-4:]:
        if rng.random() < 0.1:
            sched.prefill_done(rid)


def interleaved(worlds: dict[str, tuple[Scheduler, dict]], n: int, warmup: int, block: int = 100
                ) -> dict[str, dict[str, list[float]]]:
    """The same request stream decided by each scheduler (identical worlds), alternating blocks
    of ``block`` decisions: wall and thread-CPU milliseconds per decision, per scheduler."""
    streams = {name: requests(w, n + warmup) for name, (_, w) in worlds.items()}
    out = {name: {"wall": [], "cpu": []} for name in worlds}
    done = 0
    while done < n + warmup:
        k = min(block, n + warmup - done)
        for name, (sched, w) in worlds.items():
            chunk = [next(streams[name]) for _ in range(k)]  # built outside the timed calls
            skip = max(0, min(k, warmup - done))
            out[name]["wall"] += run(sched, w, iter(chunk), warmup=skip, cpu=out[name]["cpu"])
        done += k
    return out


def summary(wall: list[float], cpu: list[float]) -> dict:
    return {"decisions": len(wall), "wall_p50_ms": round(pct(wall, 0.5), 4), "wall_p99_ms": round(pct(wall, 0.99), 4),
            "wall_max_ms": round(max(wall), 4), "cpu_p50_ms": round(pct(cpu, 0.5), 4),
            "cpu_p99_ms": round(pct(cpu, 0.99), 4), "cpu_max_ms": round(max(cpu), 4)}


def walk_bytes(index) -> int:
    """Every dict and every distinct int object the index holds (shared objects counted once)."""
    seen: set[int] = set()
    total = 0

    def add(o) -> None:
        nonlocal total
        if id(o) not in seen:
            seen.add(id(o))
            total += sys.getsizeof(o)

    for table in index._tiers:
        add(table)
        for k, v in table.items():
            add(k)
            add(v)
    for emap in index._engine.values():
        add(emap)
        for k, v in emap.items():
            add(k)
            add(v)
    return total


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="100k blocks and fewer decisions (smoke run)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--decisions", type=int, help="timed decisions per predictor bundle (default 20000; quick 1000)")
    ap.add_argument("--floor", action="store_true",
                    help="also decide the stream with predictors that do no work (constant answers): what the "
                         "scheduler costs whatever the predictors")
    ap.add_argument("--predictors", nargs="+", default=["analytic"], metavar="KIND",
                    help="analytic (default), or learned DIR (a conductor calibrate directory): learned and "
                         "analytic then decide the same stream in one run")
    args = ap.parse_args(argv)
    kind = args.predictors[0]
    if kind == "analytic" and len(args.predictors) == 1:
        models = None
    elif kind == "learned" and len(args.predictors) == 2:
        models = args.predictors[1]
    elif len(args.predictors) == 1 and kind not in ("analytic", "learned"):  # the old form: --predictors DIR
        models = kind
    else:
        ap.error("--predictors analytic | --predictors learned DIR")
    if models is not None:
        try:
            learned_predictors(models)  # a broken directory fails here, in one line, before the long build
        except ModelError as e:
            ap.error(str(e))

    rng = random.Random(args.seed)
    prompt = [rng.randrange(VOCAB) for _ in range(131072)]  # a list, as the gateway's tokenizer returns
    times = []
    for _ in range(30):
        t0 = time.perf_counter_ns()
        block_hashes(prompt, BS)
        times.append((time.perf_counter_ns() - t0) / 1e6)
    hash_ms = statistics.median(times)

    t0 = time.perf_counter()
    worlds = {"analytic": build("conductor", args.seed, args.quick)}
    if models is not None:
        worlds["learned"] = build("conductor", args.seed, args.quick, models)
    if args.floor:
        worlds["constant"] = build("conductor", args.seed, args.quick, "constant")
    build_s = time.perf_counter() - t0
    n = args.decisions or (1000 if args.quick else 20000)
    gcs = [0]

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            gcs[0] += 1

    gc.collect()
    gc.freeze()  # as the gateway does after start-up (gateway/app.py)
    gc.callbacks.append(count)
    timings = interleaved(worlds, n, warmup=500)
    gc.callbacks.remove(count)
    compare = {name: summary(t["wall"], t["cpu"]) for name, t in timings.items()}
    main_name = "learned" if models is not None else "analytic"
    sched, _ = worlds[main_name]
    lat = timings[main_name]["wall"]
    snap = sched.snapshot()

    # one 127k-token prompt (+256 output fits the 128k context) whose first 120k tokens sit on one instance
    long_prompt = array("I", prompt[:130048])
    Engine(sched, "p07", salt=7).store(long_prompt[:122880])
    facts = RequestFacts("long", len(long_prompt), block_hashes(long_prompt, BS), 256)
    long_ms = []
    for k in range(20):
        facts.request_id = f"long{k}"
        t0 = time.perf_counter_ns()
        d = sched.decide(facts)
        long_ms.append((time.perf_counter_ns() - t0) / 1e6)
        sched.release(facts.request_id)
    assert d.hit_tokens >= 120000, d

    per_policy = {}
    for name in ([] if models else Scheduler.policy_names()):  # the policies: analytic only
        s2, w2 = build(name, args.seed, quick=True)
        gc.collect()
        lp = run(s2, w2, requests(w2, 1200), warmup=200)
        per_policy[name] = {"p50_ms": round(pct(lp, 0.5), 4), "p99_ms": round(pct(lp, 0.99), 4)}

    out = {
        "instances": {"prefill": N_PREFILL, "decode": N_DECODE},
        "predictors": main_name if models is None else f"learned {models}",
        "index_blocks": sum(sum(r["cached_blocks"].values()) for r in snap["instances"]),
        "index_distinct_hashes": snap["totals"]["index_blocks"],
        "build_s": round(build_s, 2),
        "hash_ms_128k": round(hash_ms, 3),
        "decisions": len(lat),
        "placed": snap["totals"]["decisions"].get("placed", 0),
        "decide_p50_ms": round(pct(lat, 0.5), 4),
        "decide_p99_ms": round(pct(lat, 0.99), 4),
        "decide_max_ms": round(max(lat), 4),
        "decide_cpu_p99_ms": compare[main_name]["cpu_p99_ms"],
        "compare": compare,
        "gc_collections": gcs[0],
        "decide_128k_ms": round(statistics.median(long_ms), 4),
        "index_mb": round(snap["index_mb"], 1),
        "index_mb_walk": round(walk_bytes(sched.index) / 1e6, 1),
        "policies_100k_blocks": per_policy,
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "python": sys.version.split()[0],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
