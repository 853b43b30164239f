"""The Mooncake master's KV events (RFC kvcache-ai/Mooncake#1527 format), both directions.

Wire (master ``kv_event_publisher.cpp``, read from its source; see docs/store.md): a ZMQ PUB
message is ``[b"" (empty topic), seq (u64 big-endian, from 1), msgpack payload]``; the payload is
``[timestamp_ms, [event map, ...], 0]``. One event per object key on put end, removal and
eviction, with the keys (in order) ``event_id, timestamp, event_type ("stored"|"removed"),
type (legacy "BlockStored"|"BlockRemoved"), model_name, block_size, additional_salt, lora_name,
tenant_id, backend_id, group_id, medium ("cpu"|"disk"), dp_rank, object_key, seq_hashes,
block_hashes (legacy)``, then for ``stored`` ``base_block_idx=0, parent_hash, token_ids,
parent_block_hash`` and for ``removed`` ``base_block_idx=None``. ``seq_hashes`` carries the key
as a u64 when it parses as one (decimal or 0x hex), else ``[]``: engine keys (digest hex with a
model prefix) never do, so a router reads ``object_key``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


def _key_u64(key: str) -> int | None:
    try:
        v = int(key, 16) if key.lower().startswith("0x") else int(key, 10)
    except ValueError:
        return None
    return v if 0 <= v < 1 << 64 else None


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def event_map(event_id: int, ts_ms: int, kind: str, key: str, medium: str, backend_id: str,
              tenant_id: str = "default") -> dict[str, Any]:
    """One event as the master builds it (legacy fields and ``object_key`` on, its defaults)."""
    u = _key_u64(key)
    seq = [u] if u is not None else []
    ev: dict[str, Any] = {
        "event_id": event_id, "timestamp": ts_ms, "event_type": kind,
        "type": "BlockStored" if kind == "stored" else "BlockRemoved",
        "model_name": None, "block_size": None, "additional_salt": None, "lora_name": None,
        "tenant_id": tenant_id, "backend_id": backend_id, "group_id": None, "medium": medium, "dp_rank": None,
        "object_key": key, "seq_hashes": seq, "block_hashes": [_signed(x) for x in seq],
    }
    if kind == "stored":
        ev.update(base_block_idx=0, parent_hash=None, token_ids=None, parent_block_hash=None)
    else:
        ev["base_block_idx"] = None
    return ev


def encode_payload(ts_ms: int, events: list[dict[str, Any]]) -> bytes:
    return _enc.encode([ts_ms, events, 0])


@dataclass(slots=True)
class StoreEvent:
    kind: str  # stored | removed
    key: str | None
    medium: str | None
    seq_hashes: list[int]


class StoreEventError(ValueError):
    """A payload that is not a master KV-event batch."""


def decode_payload(payload: bytes) -> list[StoreEvent]:
    """The events of one message; unknown event kinds are skipped, a malformed batch raises."""
    try:
        batch = _dec.decode(payload)
    except msgspec.DecodeError as e:
        raise StoreEventError(f"not msgpack: {e}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise StoreEventError("expected [timestamp_ms, [events], dp_rank]")
    out = []
    for ev in batch[1]:
        if not isinstance(ev, dict):
            raise StoreEventError("an event is not a map")
        kind = ev.get("event_type") or {"BlockStored": "stored", "BlockRemoved": "removed"}.get(ev.get("type", ""))
        if kind not in ("stored", "removed"):
            continue
        key = ev.get("object_key")
        seq = ev.get("seq_hashes") or []
        out.append(StoreEvent(kind, key if isinstance(key, str) else None, ev.get("medium"),
                              [x for x in seq if isinstance(x, int)]))
    return out
