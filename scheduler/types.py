"""The plain data a decision reads and returns: instances, request facts, placement, rejection."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from predictors.telemetry import SLO
from predictors.types import Role, Tier, parse_role

# Rejection statuses (HTTP): over SLO, nothing healthy to run on, malformed request, our bug.
OVER_SLO, UNAVAILABLE, BAD_REQUEST, INTERNAL = 429, 503, 400, 500


@dataclass(frozen=True, slots=True)
class Instance:
    """One engine the scheduler may place work on. ``both`` prefills and decodes (aggregated).

    ``deployment`` names its public facts (:mod:`predictors.facts`: model, GPUs, NIC), what the
    analytic predictors read. ``kv_capacity_tokens`` / ``max_model_len`` None mean "estimate from
    the deployment" (the model card's context length; vLLM's default 0.9 of HBM minus weights
    minus an activation reserve) until the engine reports its own (``Scheduler.set_capacity``).
    ``host_capacity_tokens``: KV tokens its host-memory tier holds (0: none).
    ``protocol``: the PD protocol it speaks (e.g. ``vllm``, ``sglang``): a prefill instance is
    paired only with decode instances of the same protocol (KV cannot cross engine families).
    """

    id: str
    role: Role
    deployment: str = "llama3-8b-h200"
    healthy: bool = True
    kv_capacity_tokens: int | None = None
    host_capacity_tokens: int = 0
    max_model_len: int | None = None
    protocol: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id or self.id in (Tier.STORE, Tier.HOST):
            raise ValueError(f"instance id must be a non-empty string other than 'store' or 'host', got {self.id!r}")
        try:
            object.__setattr__(self, "role", parse_role(self.role))
        except ValueError as e:
            raise ValueError(f"instance {self.id!r}: {e}") from None
        for name in ("kv_capacity_tokens", "max_model_len"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"instance {self.id!r}: {name} must be a positive integer or None, got {v!r}")
        h = self.host_capacity_tokens
        if not isinstance(h, int) or isinstance(h, bool) or h < 0:
            raise ValueError(f"instance {self.id!r}: host_capacity_tokens must be >= 0, got {h!r}")

    @property
    def prefills(self) -> bool:
        return self.role.prefills

    @property
    def decodes(self) -> bool:
        return self.role.decodes


@dataclass(slots=True)
class RequestFacts:
    """What the gateway knows about a request before placing it (all a policy may read)."""

    request_id: str
    prompt_tokens: int
    block_hashes: list[int]  # scheduler.hashing.block_hashes(prompt_token_ids, block_size)
    max_tokens: int  # expected output tokens
    slo: SLO | None = None  # per-request override; a None field means "use the configured one"
    # who asked and for what (recorded in the explanation; a priority class tightens admission)
    tenant: str | None = None
    model: str | None = None
    adapter: str | None = None
    priority: str | None = None  # a class of the scheduler's ``priority_headroom``; None: full SLO
    # leading prompt blocks the shared store holds, as the gateway's store tier learned it (from the
    # store's KV events or its /batch_query_keys); None: only what the prefix index knows
    store_blocks: int | None = None


@dataclass(slots=True)
class Placement:
    """A (prefill, decode) pair with every predicted term; the ledger holds a reservation for it.

    ``ttft_s = transfer_s + queue_s + prefill_s + decode_wait_s + kv_transfer_s + decode_first_step_s``:
    pulling the prefix onto the prefill instance (remote holder, store or its own host memory),
    waiting for its queue, prefilling the uncached tokens, then, on a separate decode instance,
    waiting for room for the KV, shipping it and running the decode step that makes the client's
    first token.
    """

    request_id: str
    prefill: str
    decode: str
    hit_tokens: int  # prefix tokens the prefill instance will not recompute (local + pulled)
    local_hit_tokens: int  # of those, already held by the prefill instance (device or host)
    transfer_tokens: int  # of those, pulled from another holder or the store
    transfer_from: str | None  # instance id or "store"; None when nothing is pulled
    queue_s: float
    prefill_s: float
    transfer_s: float
    ttft_s: float
    tbt_s: float
    queue_tokens: int  # ledger state on the prefill instance before this request
    queue_requests: int
    decode_running: int  # ledger state on the decode instance before this request
    decode_kv_tokens: int
    decode_cluster_running: float = 0.0  # the ledger's reservations per eligible decode instance
    decode_kv_share: float = 1.0  # the decode instance's device KV per context token (DecodeState.kv_share)
    explanation: dict[str, Any] = field(default_factory=dict)
    kv_transfer_s: float = 0.0  # prefill -> decode KV shipment (0 on a "both" instance)
    decode_first_step_s: float = 0.0  # the decode instance's step making the first token (0 on "both")
    decode_wait_s: float = 0.0  # after the prefill, waiting for room for the KV on the decode instance
    policy: str = ""
    host_tokens: int = 0  # of local_hit_tokens, loaded from the prefill instance's host tier first
    # the shared store's traffic at decision (predictors/store_traffic.py): what a store load queues behind
    store_write_recent_bytes: int = 0  # written through in the last window
    store_busy_s: float = 0.0  # until the latest predicted end of a placed prefill whose last chunk runs now
    store_loads_inflight: int = 0  # placed requests loading from the store, prefill not ended


@dataclass(slots=True)
class Rejection:
    """Why a request was not placed. ``reason`` is machine-readable, ``message`` is for people."""

    request_id: str
    status: int
    reason: str
    message: str
    retry_after_s: float | None = None
    explanation: dict[str, Any] = field(default_factory=dict)


Decision = Placement | Rejection
