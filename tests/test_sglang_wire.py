"""SGLang's KV-event wire and page hashes (engines_adapters/sglang_wire.py) against an independent
reader (msgpack + hashlib) and SGLang's published vectors."""
from __future__ import annotations

import msgpack
import pytest

from engines_adapters import kv_wire, sglang_wire
from engines_adapters.drivers import kv_event_decoder
from tests.test_sim_sglang import sglang_page_ids


@pytest.mark.parametrize("tokens, page, salt", [
    (list(range(1, 9)), 4, None), ([1, 2], 1, None), (list(range(100)), 16, "tenant-a"), ([7] * 33, 8, "ünïcode"),
])
def test_page_hashes_follow_sglangs_recipe(tokens, page, salt):
    assert sglang_wire.page_hashes(tokens, page, cache_salt=salt) == sglang_page_ids(tokens, page, salt)


def test_a_salt_changes_every_page_id():
    plain, salted = sglang_wire.page_hashes(list(range(64)), 16), sglang_wire.page_hashes(list(range(64)), 16, "s")
    assert len(plain) == 4 and not set(plain) & set(salted)


def test_encoding_is_sglangs_and_decodes_to_the_normalised_events():
    events = [kv_wire.BlockStored([-3488128144981237669, 5674439469042975057], None, list(range(1, 9)), 4, None,
                                  "GPU", None, [["t"], None]),
              kv_wire.BlockRemoved([5674439469042975057], "CPU_PINNED"), kv_wire.AllBlocksCleared()]
    payload = sglang_wire.encode_batch(1700000000.0, events, 0)
    ts, raw, dp = msgpack.unpackb(payload)
    assert (ts, dp) == (1700000000.0, 0)
    assert raw == [{"type": "BlockStored", "block_hashes": [-3488128144981237669, 5674439469042975057],
                    "parent_block_hash": None, "token_ids": list(range(1, 9)), "block_size": 4, "lora_id": None,
                    "medium": "GPU", "cache_salt": "t"},
                   {"type": "BlockRemoved", "block_hashes": [5674439469042975057], "medium": "CPU_PINNED"},
                   {"type": "AllBlocksCleared"}]
    ts, decoded, dp = kv_event_decoder("sglang")(payload)
    assert decoded == events and dp == 0


def test_sglangs_published_batch_decodes():
    """The batch SGLang 0.5.23 itself produced for tokens 1..8 at page size 4 (written here with
    msgpack, not with our encoder)."""
    batch = [1700000000.0, [{"type": "BlockStored", "block_hashes": [-3488128144981237669, 5674439469042975057],
                             "parent_block_hash": None, "token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "block_size": 4,
                             "lora_id": None, "medium": "GPU"},
                            {"type": "BlockRemoved", "block_hashes": [5674439469042975057], "medium": "GPU"},
                            {"type": "AllBlocksCleared"}], 0]
    ts, events, dp = sglang_wire.decode_batch(msgpack.packb(batch))
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert events[0].block_hashes == [-3488128144981237669, 5674439469042975057] and events[0].medium == "GPU"
    assert events[0].lora_name is None and events[0].extra_keys is None
    with pytest.raises(kv_wire.KVWireError):
        sglang_wire.decode_batch(msgpack.packb([1.0, [{"type": "Nope"}], 0]))
