"""The plain records the engine model takes and returns (see docs/sim_engine.md, section 1)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SimRequest:
    """What the engine needs to know about a request.

    ``output_len``: exact output length (``ignore_eos`` / trace replay); ``None`` draws one.
    ``hold_kv``: prefill side of PD: emit one token, then hold the KV until released or expired.
    ``remote_kv``: decode side of PD: the prompt's KV is pulled from a prefill instance (the
    transfer is modelled at the network bandwidth) instead of computed.
    ``block_hashes``: the prompt's chained block hashes at the engine's block size
    (``scheduler.hashing.block_hashes(prompt, block_size, parent=namespace_parent(cache_salt,
    lora_name))``) when the caller has them already (the simulator: the gateway hashed the prompt
    to place it); ``None``: the engine hashes it.
    ``cache_salt`` / ``lora_name``: the request's prefix-cache namespace, as vLLM's (the salt
    enters the first block's hash, the adapter every block's): only the same salt and adapter hit.
    """

    request_id: str
    prompt: list[int]
    max_tokens: int
    output_len: int | None = None
    hold_kv: bool = False
    remote_kv: bool = False
    block_hashes: list[int] | None = None
    cache_salt: str | None = None
    lora_name: str | None = None
    # the live engine's store connector asked the store before queueing the request: the store
    # holds the prompt's first ``store_blocks`` blocks, and loading the ``store_fetched`` of them
    # beyond this engine's own prefix takes ``store_load_s`` (modelled) seconds
    store_blocks: int = 0
    store_fetched: int = 0
    store_load_s: float = 0.0


@dataclass(slots=True)
class Finished:
    """A request's outcome; times are modelled seconds on the driver's clock."""

    request_id: str
    reason: str  # "stop" | "length"
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int  # prompt tokens this engine did not compute (prefix hits, host or remote KV)
    arrival: float
    scheduled: float  # left the waiting queue (first chunk scheduled or KV load started)
    first_token: float
    finished: float
    transfer_s: float  # KV load time (remote pull or host-tier reload)
    preemptions: int
    kv_held: bool  # KV kept for a decode instance to pull (prefill side of PD)
    store_tokens: int = field(default=0, repr=False)  # of cached_tokens, loaded from the shared store


@dataclass(slots=True)
class FirstToken:
    """A request's first output token was produced (TTFT and its parts, modelled seconds)."""

    request_id: str
    arrival: float
    scheduled: float
    first_token: float
    transfer_s: float
    cached_tokens: int


@dataclass(slots=True)
class StepResult:
    start: float
    duration: float = 0.0
    prefill_tokens: int = 0
    decode_seqs: int = 0
    emitted: list[tuple[str, int]] = field(default_factory=list)  # (request id, token id), one per request
    first_tokens: list[FirstToken] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)
    kv_loaded: list[str] = field(default_factory=list)  # remote KV pulled: the prefill side may release
    expired: list[str] = field(default_factory=list)  # held KV freed by the hold timeout
    preempted: list[str] = field(default_factory=list)
    events: list = field(default_factory=list)  # kv_wire events, in order
    # prompts just prefilled, for a live store connector: (request id, tokens, block hashes, cache
    # salt, LoRA adapter); and, with write-back, blocks the device evicted: (block hash, event id,
    # parent event id, extra keys, LoRA adapter), ids None when events are off
    store_writes: list[tuple[str, list[int], list[int], str | None, str | None]] = field(default_factory=list)
    store_evicted: list[tuple] = field(default_factory=list)

    @property
    def end(self) -> float:
        return self.start + self.duration

    @property
    def idle(self) -> bool:
        """Nothing was computed and nothing is pending (the driver should wait for new work or the
        next timer). A step that only preempted skipped admissions: the next one must run now."""
        return self.prefill_tokens == 0 and self.decode_seqs == 0 and not self.preempted


@dataclass(slots=True)
class HeldKV:
    request_id: str
    num_tokens: int
    num_blocks: int
    block_size: int
    expires_at: float


@dataclass(slots=True)
class EngineStats:
    running: int
    waiting: int  # includes requests waiting for a KV load
    loading: int
    held: int
    kv_usage: float
    kv_capacity_blocks: int
    kv_free_blocks: int
    queued_prefill_tokens: int
    prefix_queries: int
    prefix_hits: int
    host_hits: int
    preemptions: int
    host_blocks: int
    # the shared store (out of the repr, which golden runs pin): prefix tokens loaded from it, loads,
    # and modelled seconds spent loading (summed per load)
    store_hits: int = field(default=0, repr=False)
    store_loads: int = field(default=0, repr=False)
    store_load_s: float = field(default=0.0, repr=False)
