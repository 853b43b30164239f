"""A request's life inside the simulated engine (engines_adapters/sim/model.py): its state and
the per-sequence bookkeeping the step machine reads and updates (no logic of its own)."""
from __future__ import annotations

from scheduler.hashing import namespace_parent

from .records import SimRequest

# request states
WAITING, RUNNING, LOADING, HELD, DONE = range(5)
#: where a sequence's KV load comes from
LOAD_REMOTE, LOAD_HOST = 0, 1


class Seq:
    """One request inside the engine: its prompt, its blocks (hashes, held, allocated), how far it
    has computed and sampled, its state, and the times and counts its Finished record reports."""

    __slots__ = ("rid", "prompt", "P", "max_tokens", "target", "hold_kv", "remote_kv", "remote_done",
                 "hashes", "nb", "n_alloc", "cap", "computed", "num_out", "out_off", "state",
                 "looked_up", "arrival", "scheduled", "first_token", "cached_tokens", "transfer_s",
                 "preemptions", "load_kind", "load_hits", "load_start", "hold_expires", "decoding", "loaded",
                 "lookup_hits", "root", "salt", "lora", "store_blocks", "store_fetched", "store_load_s",
                 "store_loaded")

    def __init__(self, req: SimRequest, now: float, hashes: list[int], out_off: int, target: int):
        self.rid = req.request_id
        self.prompt = req.prompt
        self.P = len(req.prompt)
        self.max_tokens = req.max_tokens
        self.target = target
        self.hold_kv = req.hold_kv
        self.remote_kv = req.remote_kv
        self.remote_done = False
        self.hashes = hashes
        self.nb = 0  # full blocks held: the first nb of hashes (cached, referenced)
        self.n_alloc = 0
        self.cap = 0
        self.computed = 0
        self.num_out = 0
        self.out_off = out_off
        self.state = WAITING
        self.looked_up = False
        self.arrival = now
        self.scheduled: float | None = None
        self.first_token: float | None = None
        self.cached_tokens = -1
        self.transfer_s = 0.0
        self.preemptions = 0
        self.load_kind = LOAD_REMOTE
        self.load_hits = (0, 0)
        self.load_start = 0.0
        self.hold_expires = 0.0
        self.decoding = False  # sampled at the end of its prefill: one token per step from now on
        self.loaded = False  # holds KV loaded from a remote instance or the host tier
        self.lookup_hits = 0  # prefix tokens found by the pending lookup (counted on admission)
        self.salt = req.cache_salt or None
        self.lora = req.lora_name or None
        self.root = namespace_parent(self.salt, self.lora)  # the chain's root: its prefix-cache namespace
        self.store_blocks, self.store_fetched, self.store_load_s = req.store_blocks, req.store_fetched, req.store_load_s
        self.store_loaded = 0  # blocks loaded from the shared store

    @property
    def num_tokens(self) -> int:
        return self.P + self.num_out
