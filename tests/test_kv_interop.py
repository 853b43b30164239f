"""Interop with real vLLM KV events (issue 13): contract tests built from vLLM's own formats.

Payloads are encoded here with the independent ``msgpack`` package, field by field in the order
of vLLM's event dataclasses (``vllm/distributed/kv_events.py``)::

    BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
                extra_keys=None, group_idx=None, kv_cache_spec_kind=None, kv_cache_spec_sliding_window=None)
    BlockRemoved(block_hashes, medium, group_idx=None)

as maps tagged by ``"type"`` (defaults omitted) or as positional arrays (``array_like``), with
int block hashes or raw digests (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``). Block ids come from
vLLM's recipe (checked against golden vectors in test_hashing.py); the index must then answer the
gateway's own hash of the same request, salt and adapter included.
"""
from __future__ import annotations

import asyncio
import struct
import time

import msgpack
import pytest
import zmq
import zmq.asyncio

from engines_adapters.kv_events import KVEventSubscriber, apply_events
from engines_adapters.kv_wire import decode_batch
from engines_adapters.net import free_port
from scheduler.hashing import block_hashes, namespace_parent, vllm_block_digests, vllm_extra_keys
from scheduler.hit_index import HitIndex

BS = 4
TOKENS = list(range(100, 116))  # 4 blocks
N = len(TOKENS) // BS


def digests(tokens=TOKENS, lora=None, salt=None, algo="sha256"):
    return vllm_block_digests(tokens, BS, seed_text="0", lora_name=lora, cache_salt=salt, algo=algo)


def ints(ds):
    return [int.from_bytes(d, "big") & (2**64 - 1) for d in ds]  # vLLM's maybe_convert_block_hash


def stored_map(hashes, tokens=TOKENS, parent=None, *, lora=None, salt=None, group=None, extra=True, **more):
    """A BlockStored as vLLM's msgspec encoder writes it (map, ``omit_defaults``)."""
    ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
          "block_size": BS, "lora_id": 1 if lora else None, "medium": "GPU", "lora_name": lora}
    if extra:  # one entry per block, as BlockPool.cache_full_blocks builds them
        ev["extra_keys"] = [vllm_extra_keys(parent is None and i == 0, lora, salt) for i in range(len(hashes))]
    if group is not None:
        ev["group_idx"] = group
    ev.update(more)
    return ev


def removed_map(hashes, group=None):
    ev = {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}
    if group is not None:
        ev["group_idx"] = group
    return ev


def batch(events, *, as_map=False):
    if as_map:
        return msgpack.packb({"ts": time.time(), "events": events, "data_parallel_rank": 0}, use_bin_type=True)
    return msgpack.packb([time.time(), events, 0], use_bin_type=True)


def feed(index, payload, instance="e"):
    _, events, _ = decode_batch(payload)
    return apply_events(index, instance, events)


def held(index, lora=None, salt=None, instance="e"):
    return index.match(block_hashes(TOKENS, BS, parent=namespace_parent(salt, lora))).device.get(instance, 0)


def fresh(*ids):
    index = HitIndex(BS)
    for i in ids or ("e",):
        index.register(i)
    return index


# --- block hashes as ints or as bytes --------------------------------------------------------

@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
@pytest.mark.parametrize("as_bytes", [False, True], ids=["int-hashes", "bytes-hashes"])
@pytest.mark.parametrize("as_map", [False, True], ids=["array-batch", "map-batch"])
def test_stored_then_removed_one_per_hash(as_bytes, as_map, algo):
    """Every prefix-caching algorithm (32- or 16-byte digests), either id form, either batch shape."""
    ds = digests(algo=algo)
    hs = ds if as_bytes else ints(ds)
    index = fresh()
    # vLLM 0.33 chains a request's blocks over two events: the second names the first's last block
    assert feed(index, batch([stored_map(hs[:2], TOKENS[:2 * BS])], as_map=as_map)) == 0
    assert feed(index, batch([stored_map(hs[2:], TOKENS[2 * BS:], parent=hs[1])], as_map=as_map)) == 0
    assert held(index) == N
    # vLLM sends one BlockRemoved per evicted block
    assert feed(index, batch([removed_map([h]) for h in hs[2:]], as_map=as_map)) == 0
    assert held(index) == 2 and index.cached_blocks("e")["device"] == 2


def test_bytes_and_int_forms_name_the_same_block():
    """A removal by int id takes out a block stored by its digest (one engine, either setting)."""
    ds = digests()
    index = fresh()
    feed(index, batch([stored_map(ds)]))
    assert feed(index, batch([removed_map(ints(ds)[1:])])) == 0
    assert held(index) == 1


def test_positional_events_with_every_field():
    """array_like events, every field in dataclass order (extra_keys, group_idx, spec fields)."""
    hs = ints(digests(salt="t1"))
    keys = [list(vllm_extra_keys(i == 0, None, "t1") or []) or None for i in range(N)]
    ev = ["BlockStored", hs, None, TOKENS, BS, None, "GPU", None, keys, 0, "full_attention", None]
    index = fresh()
    assert feed(index, batch([ev])) == 0
    assert held(index, salt="t1") == N and held(index) == 0
    assert feed(index, batch([["BlockRemoved", [hs[-1]], "GPU", 0]])) == 0
    assert held(index, salt="t1") == N - 1


def test_unknown_fields_of_newer_versions_are_ignored():
    index = fresh()
    ev = stored_map(ints(digests()), kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=None,
                    something_new={"x": 1})
    assert feed(index, batch([ev], as_map=True)) == 0 and held(index) == N


# --- cache_salt and LoRA -------------------------------------------------------------------

@pytest.mark.parametrize("lora", [None, "sql-lora"])
def test_salted_chains_never_match_another_tenant(lora):
    a, b = fresh("a"), fresh("b")
    feed(a, batch([stored_map(ints(digests(lora=lora, salt="tenant-a")), lora=lora, salt="tenant-a")]), "a")
    feed(b, batch([stored_map(ints(digests(lora=lora)), lora=lora)]), "b")
    assert held(a, lora, "tenant-a", "a") == N  # the same tenant hits
    assert held(a, lora, "tenant-b", "a") == 0 and held(a, lora, None, "a") == 0  # other tenants do not
    assert held(b, lora, None, "b") == N and held(b, lora, "tenant-a", "b") == 0
    if lora:
        assert held(b, None, None, "b") == 0 and held(b, "other-lora", None, "b") == 0


def test_adapter_without_extra_keys_field_is_still_namespaced():
    """Older vLLM sent no extra_keys: the lora_name field alone still separates the adapter's chain."""
    index = fresh()
    feed(index, batch([stored_map(ints(digests(lora="sql-lora")), lora="sql-lora", extra=False)]))
    assert held(index, "sql-lora") == N and held(index) == 0


def test_multimodal_keys_never_match_a_text_request():
    hs = ints(vllm_block_digests(TOKENS, BS, seed_text="0", extra_keys=(("img-sha", 0),)))
    index = fresh()
    feed(index, batch([stored_map(hs, extra=False, extra_keys=[[["img-sha", 0]]] * N)]))
    assert index.cached_blocks("e")["device"] == N and held(index) == 0


# --- KV-cache groups (hybrid models) ---------------------------------------------------------

def test_removal_in_one_group_keeps_the_other_groups_copy():
    hs = ints(digests())
    index = fresh()
    # full attention (group 0) and sliding window (group 1) cache the same blocks under the same ids
    feed(index, batch([stored_map(hs, group=0), stored_map(hs, group=1)]))
    assert held(index) == N
    feed(index, batch([removed_map([h], group=1) for h in hs]))  # the window slides: group 1 drops all
    assert held(index) == N
    feed(index, batch([removed_map([hs[-1]], group=0)]))
    assert held(index) == N - 1
    # a block held by group 1 only stays until group 1 drops it too
    feed(index, batch([stored_map([hs[-1]], TOKENS[-BS:], parent=hs[-2], group=1)]))
    feed(index, batch([removed_map([hs[-1]], group=0)]))
    assert held(index) == N
    feed(index, batch([removed_map([hs[-1]], group=1)]))
    assert held(index) == N - 1


def test_groups_seen_late_keep_earlier_blocks_as_group_0():
    hs = ints(digests())
    index = fresh()
    feed(index, batch([stored_map(hs)]))  # no group_idx: group 0
    feed(index, batch([stored_map(hs, group=1)]))
    feed(index, batch([removed_map(hs, group=1)]))
    assert held(index) == N
    feed(index, batch([removed_map(hs)]))
    assert held(index) == 0 and index.cached_blocks("e")["device"] == 0
    index.drop_instance("e")
    feed(index, batch([stored_map(hs, group=1)]))
    feed(index, batch([removed_map(hs, group=1)]))
    assert held(index) == 0


# --- replay framings on a late join ------------------------------------------------------------

async def _late_join(topic_frame: bool) -> HitIndex:
    """A publisher that published before anyone listened; its replay ROUTER answers in vLLM 0.33's
    framing ``[id, b"", topic, seq, payload]`` or vLLM <= 0.25's ``[id, b"", seq, payload]``."""
    ep, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    hs = ints(digests())
    history = [(0, batch([stored_map(hs[:2], TOKENS[:2 * BS])])),
               (1, batch([stored_map(hs[2:], TOKENS[2 * BS:], parent=hs[1])]))]
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(rep)
    index = fresh()
    sub = KVEventSubscriber(ctx, "e", ep, index, replay_endpoint=rep, replay_timeout_s=5.0)
    task = asyncio.create_task(sub.run())
    try:
        ident, empty, start = await asyncio.wait_for(router.recv_multipart(), 10)
        first = struct.unpack(">Q", start)[0]
        for seq, payload in history:
            if seq >= first:
                head = [ident, b"", b"kv"] if topic_frame else [ident, b""]
                await router.send_multipart(head + [seq.to_bytes(8, "big"), payload])
        end = (-1).to_bytes(8, "big", signed=True)
        await router.send_multipart(([ident, b"", b""] if topic_frame else [ident, b""]) + [end, b""])
        deadline = time.monotonic() + 10
        while held(index) < N and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return index
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        router.close(0)
        ctx.term()


@pytest.mark.parametrize("topic_frame", [True, False], ids=["vllm-0.33-with-topic", "vllm-0.25-no-topic"])
def test_late_join_recovers_history_in_both_replay_framings(topic_frame):
    index = asyncio.run(asyncio.wait_for(_late_join(topic_frame), 30))
    assert held(index) == N
