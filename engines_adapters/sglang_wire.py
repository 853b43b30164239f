"""SGLang 0.5.23's KV-event wire and page-hash recipe (``sglang/srt/disaggregation/kv_events.py``,
``sglang/srt/mem_cache``), both directions.

Transport and framing are vLLM's (``engines_adapters.kv_wire``): ZMQ PUB ``[topic, seq, payload]``,
replay over a ROUTER. The differences are in the payload:

* a batch is the positional array ``[ts, [event, ...], attn_dp_rank]``;
* events are msgpack maps tagged by ``"type"`` with *optional fields left out when unset*
  (``medium``, ``cache_salt``, ``lora_name``; ``lora_id`` has no default and is always sent,
  ``null``), unlike vLLM 0.33 which always sends ``medium`` and ``lora_name``;
* a block id is SGLang's own page hash: the SHA-256 chain
  ``d_i = SHA256(d_{i-1} || page tokens as u32 little-endian)`` (the first page has no prior, or
  the salt seed ``SHA256(b"sglang-cache-salt-v1\\0" + cache_salt)``), projected to the *signed*
  big-endian int64 of the digest's first 8 bytes; ``parent_block_hash`` is the previous page's;
* ``medium`` is ``"GPU"`` (device) or ``"CPU_PINNED"`` (host memory; SGLang's HiCache L2).

:func:`decode_batch` turns a payload into the normalised ``kv_wire`` event classes the gateway's
index consumes (the index re-hashes each event's token ids with its own hash, so a page id is
only used to link a page to its parent).
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Any

import msgspec

from engines_adapters import kv_wire

MEDIUM_GPU = "GPU"
MEDIUM_HOST = "CPU_PINNED"
#: ``StorageMedium.EXTERNAL`` (L4, e.g. Mooncake): what a HiCache storage backend's blocks are. SGLang
#: 0.5.23 defines it but emits no event for L3 writes; the sim engine announces them with it.
MEDIUM_STORE = "EXTERNAL"

_SALT_PREFIX = b"sglang-cache-salt-v1\0"


def _page_bytes(tokens: Sequence[int]) -> bytes:
    try:
        return array("I", tokens).tobytes()
    except OverflowError:  # SGLang tags ids beyond uint32 with 0xFF and widens them; not needed here
        raise ValueError("token ids beyond 2^32 are not supported") from None


def salt_seed(cache_salt: str | None) -> bytes | None:
    """The digest the first page of a salted request chains from (None: unsalted, no prior)."""
    if not cache_salt:
        return None
    return hashlib.sha256(_SALT_PREFIX + cache_salt.encode()).digest()


def page_digests(tokens: Sequence[int], page_size: int, parent: bytes | None = None) -> list[bytes]:
    """32-byte SHA-256 digests of every complete page of ``tokens``, chained from ``parent``."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    out = []
    prev = parent
    for i in range(len(tokens) // page_size):
        h = hashlib.sha256()
        if prev is not None:
            h.update(prev)
        h.update(_page_bytes(tokens[i * page_size:(i + 1) * page_size]))
        prev = h.digest()
        out.append(prev)
    return out


def digest_to_event_id(digest: bytes) -> int:
    """SGLang's ``hash_str_to_int64``: the first 8 digest bytes as a signed big-endian int64."""
    return int.from_bytes(digest[:8], "big", signed=True)


def page_hashes(tokens: Sequence[int], page_size: int, cache_salt: str | None = None) -> list[int]:
    """The KV-event ids SGLang gives the complete pages of ``tokens``."""
    return [digest_to_event_id(d) for d in page_digests(tokens, page_size, salt_seed(cache_salt))]


# --- events (SGLang's msgspec structs: tag=True, omit_defaults=True) -------------------------

class _Event(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(_Event):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Event]
    attn_dp_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Batch)


def to_sglang(ev: kv_wire.Event) -> Event:
    """One normalised event as SGLang writes it (the sim engine's publisher)."""
    if isinstance(ev, kv_wire.BlockStored):
        return BlockStored([int(h) for h in ev.block_hashes],
                           None if ev.parent_block_hash is None else int(ev.parent_block_hash),
                           list(ev.token_ids), ev.block_size, None, ev.medium, _salt_of(ev), None, ev.lora_name)
    if isinstance(ev, kv_wire.BlockRemoved):
        return BlockRemoved([int(h) for h in ev.block_hashes], ev.medium)
    return AllBlocksCleared()


def _salt_of(ev: kv_wire.BlockStored) -> str | None:
    """The request's salt from normalised per-block ``extra_keys`` (vLLM's untagged form: the LoRA
    name, then the salt; or tagged ``("cache_salt", salt)``)."""
    for entry in ev.extra_keys or ():
        for k in entry or ():
            if isinstance(k, (list, tuple)) and len(k) == 2 and k[0] == "cache_salt":
                return str(k[1])
            if isinstance(k, str) and k != ev.lora_name:
                return k
    return None


def encode_batch(ts: float, events: list[Any], dp_rank: int | None = 0) -> bytes:
    """The msgpack payload of one batch, SGLang's shape (events in normalised or SGLang classes)."""
    return _encoder.encode(_Batch(float(ts), [e if isinstance(e, Event) else to_sglang(e) for e in events], dp_rank))


def decode_batch(payload: bytes) -> tuple[float, list[kv_wire.Event], int | None]:
    """``(ts, events, attn_dp_rank)`` with the events normalised to ``kv_wire``'s classes; a
    payload that is not SGLang's exact shape falls back to the tolerant vLLM decoder."""
    try:
        b = _decoder.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return kv_wire.decode_batch(payload)
    out: list[kv_wire.Event] = []
    for e in b.events:
        if isinstance(e, BlockStored):
            # the salt in vLLM's per-block form, where the gateway's index reads a chain's namespace:
            # on the first block of a chain's root event (later blocks chain from it)
            extra = None
            if e.cache_salt and e.parent_block_hash is None:
                extra = [[e.cache_salt]] + [None] * (len(e.block_hashes) - 1)
            out.append(kv_wire.BlockStored(list(e.block_hashes), e.parent_block_hash, e.token_ids, e.block_size,
                                           e.lora_id, e.medium, e.lora_name, extra))
        elif isinstance(e, BlockRemoved):
            out.append(kv_wire.BlockRemoved(list(e.block_hashes), e.medium))
        else:
            out.append(kv_wire.AllBlocksCleared())
    return b.ts, out, b.attn_dp_rank
