"""The request-lifecycle record: one representation of a request's life shared by gateway
telemetry, simulator output, load-generator results and the predictors' training data.

Times are seconds on one clock per producer (wall clock for live runs, virtual time in the
simulator). Fields known at decision time are the features; the rest are measured outcomes.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from itertools import pairwise
from typing import Any, Iterable, Iterator

#: Statuses a finished request can have.
STATUSES = ("ok", "rejected", "error", "timeout", "aborted")


def mooncake_tbt(intervals: list[float]) -> float:
    """Mooncake's TBT: the mean of the slowest 10% of a request's token intervals (0 if none)."""
    if not intervals:
        return 0.0
    k = max(1, math.ceil(0.1 * len(intervals)))
    slowest = sorted(intervals, reverse=True)[:k]
    return sum(slowest) / k


@dataclass(frozen=True)
class SLO:
    """Latency objectives; ``None`` means unconstrained."""

    ttft_s: float | None = None
    tbt_s: float | None = None


@dataclass
class RequestRecord:
    request_id: str
    arrival_s: float
    prompt_tokens: int = 0
    max_tokens: int | None = None
    status: str = "pending"
    # --- decision (features at decision time) ---
    policy: str | None = None
    decided_s: float | None = None
    prefill_instance: str | None = None
    decode_instance: str | None = None
    hit_tokens: int = 0  # prefix tokens the chosen prefill instance will not recompute
    local_hit_tokens: int = 0  # of those, held by the prefill instance itself
    transfer_tokens: int = 0  # of those, pulled from another holder or the store
    transfer_from: str | None = None  # where from: "store" or the holder's instance id (None: nothing pulled)
    host_load_tokens: int = 0  # of local_hit_tokens, loaded from the prefill instance's host tier first
    queue_tokens: int = 0  # prefill tokens queued ahead on the chosen prefill instance
    queue_requests: int = 0
    decode_running: int = 0  # sequences on the chosen decode instance before this one
    decode_kv_tokens: int = 0
    # the shared store's traffic at decision (predictors/store_traffic.py): what a store load queues behind
    store_write_recent_bytes: int = 0  # written through to the store in the last window (0.5 s)
    store_busy_s: float = 0.0  # until the latest predicted end of a placed prefill whose last chunk runs now
    store_loads_inflight: int = 0  # placed requests loading from the store, their prefill not ended
    # the whole cluster's decode load at decision: the ledger's reservations (decoding or about to)
    # per eligible decode instance (what the batch this request joins tends to); None: not recorded
    decode_cluster_running: float | None = None
    # the decode instance's device KV per context token at decision (DecodeState.kv_share: below 1
    # when its sequences share prefix blocks; what a full cache's TBT features need). None: not
    # recorded (telemetry from before 2026-12-03)
    decode_kv_share: float | None = None
    predicted_queue_s: float | None = None
    predicted_prefill_s: float | None = None
    predicted_transfer_s: float | None = None
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None
    # the rest of the predicted TTFT (Placement): after the prefill, waiting for room on the
    # decode instance, shipping the KV there, its first decode step; and the public deployments
    # of the chosen pair (what a learned predictor's features are computed from)
    predicted_decode_wait_s: float | None = None
    predicted_kv_transfer_s: float | None = None
    predicted_first_step_s: float | None = None
    prefill_deployment: str | None = None
    decode_deployment: str | None = None
    reject_reason: str | None = None
    retry_after_s: float | None = None
    # --- outcomes ---
    sent_s: float | None = None  # when the client actually sent it (load generator)
    prefill_start_s: float | None = None
    prefill_end_s: float | None = None
    decode_start_s: float | None = None
    first_token_s: float | None = None
    token_times: list[float] = field(default_factory=list)  # every token chunk, first included
    end_s: float | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None  # as reported by the engine (usage.prompt_tokens_details)
    http_status: int | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    # --- derived metrics (SCHEDULING.md §3) ---
    @property
    def start_s(self) -> float:
        return self.sent_s if self.sent_s is not None else self.arrival_s

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.start_s

    @property
    def intervals(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in pairwise(t)]

    @property
    def tpot_s(self) -> float:
        if self.output_tokens <= 1 or self.e2e_s is None or self.ttft_s is None:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def tbt_s(self) -> float:
        return mooncake_tbt(self.intervals)

    def meets(self, slo: SLO) -> bool:
        """Effective request: finished ok and within every given SLO."""
        if self.status != "ok" or self.ttft_s is None:
            return False
        if slo.ttft_s is not None and self.ttft_s > slo.ttft_s:
            return False
        return slo.tbt_s is None or self.tbt_s <= slo.tbt_s

    def to_dict(self, token_times: bool = True) -> dict[str, Any]:
        d = asdict(self)
        if not token_times:
            d.pop("token_times")
        d["ttft_s"], d["e2e_s"], d["tpot_s"], d["tbt_s"] = self.ttft_s, self.e2e_s, self.tpot_s, self.tbt_s
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RequestRecord":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def write_jsonl(path: str, records: Iterable[RequestRecord], token_times: bool = True) -> int:
    n = 0
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r.to_dict(token_times)) + "\n")
            n += 1
    return n


def read_jsonl(path: str) -> Iterator[RequestRecord]:
    with open(path) as f:
        for line in f:
            if line.strip():
                yield RequestRecord.from_dict(json.loads(line))
