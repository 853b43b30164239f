"""KV event wire format: what we encode is vLLM 0.33's shape (read back with the independent
``msgpack`` package), and what we decode covers map-, array- and map-batch-encoded events."""
from __future__ import annotations

import msgpack
import pytest

from engines_adapters.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVWireError,
    decode_batch,
    encode_batch,
)

BIG = 12472515041799373675  # > 2**63: must survive as an unsigned 64-bit int


def stored(**kw):
    args = dict(block_hashes=[10362225831949560093, BIG], parent_block_hash=None, token_ids=list(range(1, 9)),
                block_size=4, lora_id=None, medium="GPU", lora_name=None)
    args.update(kw)
    return BlockStored(**args)


def test_encoded_batch_is_vllm_033_shape():
    payload = encode_batch(1712.5, [stored(), BlockRemoved(block_hashes=[BIG], medium="CPU"), AllBlocksCleared()], 0)
    ts, events, dp = msgpack.unpackb(payload)
    assert ts == 1712.5 and dp == 0
    assert events[0] == {"type": "BlockStored", "block_hashes": [10362225831949560093, BIG],
                         "parent_block_hash": None, "token_ids": list(range(1, 9)), "block_size": 4,
                         "lora_id": None, "medium": "GPU", "lora_name": None}  # extra_keys omitted (default)
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [BIG], "medium": "CPU"}
    assert events[2] == {"type": "AllBlocksCleared"}


def test_roundtrip():
    evs = [stored(parent_block_hash=7), BlockRemoved(block_hashes=[1, 2], medium="GPU"), AllBlocksCleared()]
    ts, out, dp = decode_batch(encode_batch(3.0, evs, 2))
    assert (ts, out, dp) == (3.0, evs, 2)


def test_decodes_legacy_positional_events():
    payload = msgpack.packb([2.0, [["BlockStored", [5, 6], 4, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "CPU"],
                                   ["BlockRemoved", [5], "GPU"], ["AllBlocksCleared"]], 1])
    ts, events, dp = decode_batch(payload)
    assert ts == 2.0 and dp == 1
    assert events[0] == stored(block_hashes=[5, 6], parent_block_hash=4, medium="CPU")  # lora_name absent -> None
    assert events[1] == BlockRemoved(block_hashes=[5], medium="GPU")
    assert isinstance(events[2], AllBlocksCleared)


def test_decodes_map_batches_and_ignores_unknown_fields():
    payload = msgpack.packb({"ts": 1.0, "data_parallel_rank": 0, "events": [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [9, 9],
         "block_size": 2, "medium": "GPU", "group_idx": 3, "extra_keys": [None]}]})
    ts, events, dp = decode_batch(payload)
    assert events[0].block_hashes == [1] and events[0].lora_name is None and events[0].extra_keys == [None]


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb("nope"), msgpack.packb([1.0, [{"type": "Nope"}], 0]),
                                     msgpack.packb([1.0, [{"type": ["BlockStored"]}], 0]),  # an unhashable tag
                                     msgpack.packb([1.0, [["BlockRemoved", "not-a-list", "GPU"]], 0])])
def test_garbage_is_a_clear_error(payload):
    with pytest.raises(KVWireError):
        decode_batch(payload)
