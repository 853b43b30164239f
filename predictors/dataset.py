"""Training rows per term from RequestRecord telemetry (what ``conductor calibrate`` fits on).

A record has the features known at decision time and the outcomes measured after; the terms are
separated like this, with nothing but the records themselves:

Instances are told apart per run (:func:`run_of`): one telemetry file, one simulated load.

* **prefill**: a prefill instance serves its queue first come, first served, so a request's own
  prefill is its *service time*: from when it could start (its leg began and the request ahead
  of it on that instance finished) to its end. A prefix the decision expected the engine to load
  first (from the shared store, or the instance's host tier: ``transfer_from``,
  ``host_load_tokens``) is inside that time: the row carries the tokens loaded, so the store and
  host-tier load terms are fitted on top of the prefill (rows pulling from a peer are skipped).
  Requests finishing in the same engine step are one row (their features add up: the model is
  linear). ``clean`` rows (the instance was idle and nobody joined before the end) are lone
  prefills, the ones accuracy is reported on.
* **queue**: the wait before that start, and the Mooncake queue it implies (the requests ahead,
  as the ledger held them) for any prefill predictor: reconstructed per row.
* **transfer** (prefill -> decode KV shipment): the hand-over gap, from the prefill leg's end to
  the client's first token, minus the decode instance's first step; rows whose decode instance
  had no room at decision (a predicted decode wait) are left out.
* **TBT**: the request's Mooncake TBT (mean of its slowest 10% token gaps) against the decode
  instance's state when it was placed.
"""
from __future__ import annotations

import re
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Callable, Iterable

from predictors.facts import Deployment, load_deployment
from predictors.telemetry import RequestRecord
from predictors.types import Tier

#: Token gaps a TBT row needs (a Mooncake TBT over fewer is mostly noise).
MIN_TBT_INTERVALS = 8

class DataError(ValueError):
    """Telemetry a calibration cannot use (one line saying what is missing)."""


@dataclass
class PrefillRow:
    t: float  # position of the row's (first) request in its run, 0..1 by decision time (see pos)
    deployment: str
    items: list[tuple[int, int]]  # (prompt, cached) per request in the row
    service_s: float
    clean: bool
    request_ids: list[str] = field(default_factory=list)
    store_tokens: int = 0  # loaded from the shared store before the prefill (all requests of the row)
    store_loads: int = 0
    host_tokens: int = 0  # loaded from the instance's host tier before the prefill
    host_loads: int = 0
    # the store's traffic at the (first) request's decision (predictors/store_traffic.py)
    store_write_recent_bytes: int = 0
    store_busy_s: float = 0.0
    store_loads_inflight: int = 0
    # the run, and when the row's (first) request was decided and its outcome was known to the
    # gateway (its end: the predictors' observer sees a record when it finishes)
    run: str = ""
    decided_s: float = 0.0
    known_s: float = 0.0

    @property
    def loads(self) -> bool:
        return bool(self.store_loads or self.host_loads)

    @property
    def prompt_tokens(self) -> int:
        return max(p for p, _ in self.items)


@dataclass
class TBTRow:
    t: float
    deployment: str
    instance: str
    running: int
    kv_tokens: int
    prompt_tokens: int
    max_tokens: int
    tbt_s: float
    cluster_running: float = 0.0  # the cluster's decode load at decision (0: not recorded)
    kv_share: float = 1.0  # the decode instance's device KV per context token at decision
    # the run, and when the row's (first) request was decided and its outcome was known to the
    # gateway (its end: the predictors' observer sees a record when it finishes)
    run: str = ""
    decided_s: float = 0.0
    known_s: float = 0.0


@dataclass
class HandoverRow:
    t: float
    source: str
    destination: str
    src_deployment: str
    dst_deployment: str
    tokens: int
    running: int
    kv_tokens: int
    max_tokens: int
    handover_s: float
    cluster_running: float = 0.0
    kv_share: float = 1.0
    # the run, and when the row's (first) request was decided and its outcome was known to the
    # gateway (its end: the predictors' observer sees a record when it finishes)
    run: str = ""
    decided_s: float = 0.0
    known_s: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return self.tokens


@dataclass
class QueueRow:
    """What the ledger held ahead of a request (for any prefill predictor's queue) and the outcome."""

    t: float
    deployment: str
    record: RequestRecord
    ahead: list[tuple[RequestRecord, float]]  # (request ahead, when it became able to start)
    wait_s: float  # observed: from the leg's start to the request's own start
    ttft_s: float

    @property
    def prompt_tokens(self) -> int:
        return self.record.prompt_tokens


@dataclass
class Dataset:
    prefill: list[PrefillRow]
    tbt: list[TBTRow]
    handover: list[HandoverRow]
    queue: list[QueueRow]
    records: int
    used: int
    skipped: dict[str, int]
    deployments: dict[str, Deployment]
    kv_share_recorded: bool = False  # the records carry their decode instance's KV share


def _deployment(name: str | None, default: str | None, cache: dict[str, Deployment], column: str) -> str:
    n = name or default
    if n is None:
        raise DataError(f"records lack {column} (telemetry from before it was recorded): pass --deployment NAME")
    if n not in cache:
        try:
            cache[n] = load_deployment(n)
        except KeyError as e:
            raise DataError(str(e.args[0])) from None
    return n


#: ``conductor simulate`` names a request ``s{load}-t{policy}-r{index}``: one run per (load, policy).
_SIM_RUN = re.compile(r"^(s\d+-t\d+)-r\d+$")


def run_of(r: RequestRecord) -> str:
    """Which run (one clock, one set of instances) a record belongs to: the telemetry file it was
    read from (``extra["source"]``) and, for a simulation of several loads or policies, its
    (load, policy); instance names and times repeat across runs."""
    m = _SIM_RUN.match(r.request_id)
    return f"{r.extra.get('source', '')}|{m.group(1) if m else ''}"


def known_at(r: RequestRecord) -> float:
    """When the gateway's predictors observe ``r``: at its end (the lifecycle's observers run at
    finish), else its last token."""
    if r.end_s is not None:
        return r.end_s
    return r.token_times[-1] if r.token_times else (r.first_token_s or r.decided_s or 0.0)


def build_dataset(records: Iterable[RequestRecord], default_deployment: str | None = None) -> Dataset:
    """Rows per term from finished records; :class:`DataError` when a needed column is missing."""
    recs = list(records)
    deployments: dict[str, Deployment] = {}
    skipped: dict[str, int] = {}

    def skip(why: str) -> None:
        skipped[why] = skipped.get(why, 0) + 1

    placed = []
    for r in recs:
        if r.status != "ok":
            skip(f"status {r.status}")
            continue
        if r.decided_s is None or r.prefill_instance is None or r.decode_instance is None:
            raise DataError(f"record {r.request_id}: no decision features (decided_s, prefill_instance, "
                            "decode_instance): not gateway or simulator telemetry?")
        if r.first_token_s is None or not r.token_times:
            raise DataError(f"record {r.request_id}: no token times (first_token_s, token_times): write telemetry "
                            "with token times (gateway telemetry_path, conductor simulate --telemetry)")
        placed.append(r)
    if not placed:
        raise DataError(f"no finished requests among {len(recs)} records")

    # each row's t: its request's position in its run (runs have their own clocks), so a
    # time-ordered hold-out takes the latest part of every run
    by_run: dict[str, list[float]] = {}
    for r in placed:
        by_run.setdefault(run_of(r), []).append(r.decided_s)  # type: ignore[arg-type]
    for times in by_run.values():
        times.sort()

    def pos(r: RequestRecord) -> float:
        times = by_run[run_of(r)]
        return bisect_left(times, r.decided_s or 0.0) / len(times)

    # --- prefill service times and queues, per prefill instance in completion order ----------
    prefill: list[PrefillRow] = []
    queue: list[QueueRow] = []
    by_inst: dict[tuple[str, str], list[RequestRecord]] = {}
    for r in placed:
        if r.prefill_instance == r.decode_instance:
            skip("colocated (no prefill leg)")
            continue
        if r.prefill_start_s is None or r.prefill_end_s is None:
            raise DataError(f"record {r.request_id}: no prefill leg times (prefill_start_s, prefill_end_s)")
        by_inst.setdefault((run_of(r), r.prefill_instance), []).append(r)  # type: ignore[arg-type]
    for inst, rs in by_inst.items():
        rs.sort(key=lambda r: (r.prefill_end_s or 0.0, r.decided_s or 0.0))
        starts: list[float] = sorted(r.prefill_start_s or 0.0 for r in rs)
        # the latest end among the legs started up to each start: a leg started earlier and still
        # running (a long prefill a short one overtook in a shared chunked step, a prefix load)
        by_start = sorted(rs, key=lambda r: r.prefill_start_s or 0.0)
        running_until: list[float] = []
        for o in by_start:
            running_until.append(max(running_until[-1] if running_until else float("-inf"), o.prefill_end_s or 0.0))
        prev_end = float("-inf")
        current: PrefillRow | None = None
        start_eff: dict[str, float] = {}
        for r in rs:
            assert r.prefill_start_s is not None and r.prefill_end_s is not None and r.decided_s is not None
            dep = _deployment(r.prefill_deployment, default_deployment, deployments, "prefill_deployment")
            start = max(r.prefill_start_s, prev_end)
            start_eff[r.request_id] = start
            store = r.transfer_tokens if r.transfer_from == Tier.STORE else 0
            if r.transfer_tokens and not store:
                skip("prefix pulled from a peer before the prefill" if r.transfer_from else
                     "prefix pulled before the prefill (source not recorded)")
                prev_end = r.prefill_end_s
                current = None
                continue
            host = max(0, r.host_load_tokens)
            if current is not None and r.prefill_end_s - prev_end <= 1e-9:  # finished in the same step
                current.items.append((r.prompt_tokens, r.hit_tokens))
                current.request_ids.append(r.request_id)
                current.clean = False
                current.store_tokens += store
                current.store_loads += bool(store)
                current.host_tokens += host
                current.host_loads += bool(host)
                current.known_s = max(current.known_s, known_at(r))
                continue
            before = bisect_left(starts, r.prefill_start_s)  # legs started strictly before this one
            # another leg started while this one ran (its own start counted once: same-time starts join)
            joined = bisect_left(starts, r.prefill_end_s) - before > 1
            overlapped = before > 0 and running_until[before - 1] > r.prefill_start_s
            current = PrefillRow(pos(r), dep, [(r.prompt_tokens, r.hit_tokens)], r.prefill_end_s - start,
                                 clean=prev_end <= r.prefill_start_s and not joined and not overlapped,
                                 request_ids=[r.request_id], store_tokens=store, store_loads=int(bool(store)),
                                 host_tokens=host, host_loads=int(bool(host)),
                                 store_write_recent_bytes=r.store_write_recent_bytes,
                                 store_busy_s=r.store_busy_s,
                                 store_loads_inflight=r.store_loads_inflight, run=run_of(r),
                                 decided_s=r.decided_s, known_s=known_at(r))
            prefill.append(current)
            prev_end = r.prefill_end_s
        # the queue each request found: the requests decided before it and not yet prefilled
        order = sorted(rs, key=lambda r: r.decided_s or 0.0)
        pending: list[RequestRecord] = []  # decided earlier, not prefilled yet (in decision order)
        for r in order:
            assert r.decided_s is not None and r.prefill_start_s is not None and r.ttft_s is not None
            now = r.decided_s
            pending = [o for o in pending if (o.prefill_end_s or 0.0) > now]
            ahead = [(o, start_eff[o.request_id]) for o in pending]
            pending.append(r)
            queue.append(QueueRow(pos(r), _deployment(r.prefill_deployment, default_deployment, deployments,
                                                            "prefill_deployment"),
                                  r, ahead, max(0.0, start_eff[r.request_id] - r.prefill_start_s), r.ttft_s))
        del inst

    # --- TBT and the prefill -> decode hand-over ------------------------------------------------
    tbt: list[TBTRow] = []
    handover: list[HandoverRow] = []
    for r in placed:
        assert r.decided_s is not None and r.decode_instance is not None and r.prefill_instance is not None
        ddep = _deployment(r.decode_deployment, default_deployment, deployments, "decode_deployment")
        mt = r.max_tokens or r.output_tokens
        if len(r.token_times) > MIN_TBT_INTERVALS:
            tbt.append(TBTRow(pos(r), ddep, r.decode_instance, r.decode_running, r.decode_kv_tokens,
                              r.prompt_tokens, mt, r.tbt_s, r.decode_cluster_running or 0.0, r.decode_kv_share or 1.0,
                              run_of(r), r.decided_s, known_at(r)))
        else:
            skip("too few tokens for a TBT")
        if r.prefill_instance == r.decode_instance:
            continue
        if r.predicted_decode_wait_s:
            skip("decode instance full at decision (hand-over includes a wait)")
            continue
        assert r.first_token_s is not None and r.prefill_end_s is not None
        pdep = _deployment(r.prefill_deployment, default_deployment, deployments, "prefill_deployment")
        handover.append(HandoverRow(pos(r), r.prefill_instance, r.decode_instance, pdep, ddep, r.prompt_tokens,
                                    r.decode_running, r.decode_kv_tokens, mt, r.first_token_s - r.prefill_end_s,
                                    r.decode_cluster_running or 0.0, r.decode_kv_share or 1.0, run_of(r), r.decided_s,
                                    known_at(r)))
    return Dataset(prefill, tbt, handover, queue, len(recs), len(placed), skipped, deployments,
                   any(r.decode_kv_share is not None for r in placed))


def reconstructed_queue(row: QueueRow, prefill: Callable[[RequestRecord], float]) -> float:
    """The ledger's queue for ``row.record`` had ``prefill`` predicted every request: the
    predicted prefill seconds of the requests ahead, minus the head's elapsed part."""
    if not row.ahead:
        return 0.0
    total = sum(prefill(o) for o, _ in row.ahead)
    head, since = row.ahead[0]
    assert row.record.decided_s is not None
    return max(0.0, total - min(max(0.0, row.record.decided_s - since), prefill(head)))
