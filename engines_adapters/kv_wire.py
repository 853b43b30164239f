"""KV-cache event wire format of vLLM 0.33 (``vllm/distributed/kv_events.py``), both directions.

A ZMQ message is three frames ``[topic, seq (u64 big-endian), payload]``; the payload is a msgpack
array ``[ts, [event, ...], data_parallel_rank]``. Events are msgpack maps tagged by ``"type"``
(the class name); fields equal to their default are omitted. ``lora_id``, ``medium`` and
``lora_name`` have no default in vLLM 0.33, so they are always sent (``null`` when unset);
``extra_keys`` (one entry per block: the keys its hash folded in, e.g. LoRA name and cache salt)
and ``group_idx`` (the KV-cache group; hybrid models have several) are sent when not null.
Block hashes are u64 ints, or the raw digests (``bytes``) with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``: :func:`int_hash` maps those onto the int form.

Older vLLM sent each event as a positional array (``["BlockStored", block_hashes, ...]``) and a
newer one may send the batch itself as a map; :func:`decode_batch` accepts all three shapes so
the gateway's subscriber keeps working across versions (upstream wins where this file and a newer
vLLM disagree).
"""
from __future__ import annotations

from typing import Any, Union

import msgspec

#: ``medium`` values used by vLLM for device and host-memory blocks.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
#: ``medium`` of blocks vLLM's MooncakeStoreConnector announces as written to the store (its
#: worker's BlockStored events, lower case, as the Mooncake master's own events name memory
#: replicas); the OffloadingConnector's host tier is the upper-case ``CPU``.
MEDIUM_STORE = "cpu"

#: Replay end-of-sequence marker (the seq frame of the last replay reply).
END_SEQ = (-1).to_bytes(8, "big", signed=True)

BlockHash = Union[int, bytes]


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule: the PUB socket binds for ``*``/``::`` hosts and ipc/inproc, otherwise it
    connects (so with ``tcp://127.0.0.1:P`` the subscriber must bind). Both sides use this."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVWireError(ValueError):
    """A payload that is not a KV event batch in any known shape."""


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of the tagged union: encoded as a map with ``"type": <class name>``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]
_EVENT_TYPES: dict[str, type[Event]] = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
                                        "AllBlocksCleared": AllBlocksCleared}
# positional order of the legacy array form (after the tag)
_FIELDS = {name: cls.__struct_fields__ for name, cls in _EVENT_TYPES.items()}


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_fast_decoder = msgspec.msgpack.Decoder(_Batch)


def encode_batch(ts: float, events: list[Event], dp_rank: int | None = 0) -> bytes:
    """The msgpack payload frame of one event batch (vLLM 0.33 shape)."""
    return _encoder.encode(_Batch(float(ts), events, dp_rank))


def _event(raw: Any) -> Event:
    if isinstance(raw, dict):
        tag = raw.get("type")
        cls = _EVENT_TYPES.get(tag) if isinstance(tag, str) else None  # (a list tag: unhashable, no TypeError)
        if cls is None:
            raise KVWireError(f"unknown KV event type {raw.get('type')!r}")
        fields = {f: raw.get(f) for f in cls.__struct_fields__}
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        cls = _EVENT_TYPES.get(raw[0])
        if cls is None:
            raise KVWireError(f"unknown KV event type {raw[0]!r}")
        values = list(raw[1:])
        fields = {f: (values[i] if i < len(values) else None) for i, f in enumerate(cls.__struct_fields__)}
    else:
        raise KVWireError(f"a KV event must be a map or an array, got {type(raw).__name__}")
    try:
        return msgspec.convert(fields, cls)
    except msgspec.ValidationError as e:
        raise KVWireError(f"bad {cls.__name__} event: {e}") from None


def decode_batch(payload: bytes) -> tuple[float, list[Event], int | None]:
    """``(ts, events, data_parallel_rank)`` from a payload frame, map- or array-encoded events."""
    try:
        b = _fast_decoder.decode(payload)
        return b.ts, b.events, b.data_parallel_rank
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise KVWireError(f"payload is not msgpack: {e}") from None
    if isinstance(raw, dict):
        ts, events, dp = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, dp = raw[0], raw[1], (raw[2] if len(raw) > 2 else None)
    else:
        raise KVWireError("payload is not an event batch [ts, events, dp_rank]")
    if not isinstance(ts, (int, float)) or not isinstance(events, list):
        raise KVWireError("event batch needs a numeric ts and a list of events")
    return float(ts), [_event(e) for e in events], dp


def int_hash(h: BlockHash) -> int:
    """A block hash in vLLM's int form: bytes digests (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``)
    become what vLLM would have sent as an int, their low 64 bits read big-endian."""
    return int.from_bytes(h[-8:], "big") if isinstance(h, bytes) else h


def int_hashes(hashes: list[BlockHash]) -> list[int]:
    """``int_hash`` over an event's list (a copy; int lists cost one type check)."""
    if hashes and type(hashes[0]) is bytes:
        return [int_hash(h) for h in hashes]
    return list(hashes)  # type: ignore[arg-type]  # ints, or junk the index refuses


def seq_bytes(seq: int) -> bytes:
    """The sequence frame: 8-byte big-endian unsigned."""
    return seq.to_bytes(8, "big")
