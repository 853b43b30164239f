"""The KV events a simulated engine publishes for the blocks it caches: BlockStored, with each
block named as the configured engine names it (vLLM's block hashes by its hash algo, SGLang's
page ids, or the engine's own chained hash, "index"), and the per-block metadata a later
removal or offload names again. Functions of the :class:`~engines_adapters.sim.model.EngineModel`
whose hashing settings they read; the model calls them as it commits blocks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, cast

from scheduler.hashing import digest_to_int, vllm_block_digests, vllm_extra_keys

from ..kv_wire import MEDIUM_GPU, BlockHash, BlockStored
from ..sglang_wire import digest_to_event_id, page_digests, salt_seed
from .kv_cache import Block, lora_int_id
from .sequence import Seq

if TYPE_CHECKING:
    from .model import EngineModel


def event_extra_keys(e: EngineModel, a: int, b: int, lora: str | None, salt: str | None) -> list:
    """The ``extra_keys`` of a BlockStored for blocks ``a..b`` of a request's chain: as vLLM's
    BlockPool, one entry per block (LoRA name, salt on block 0); SGLang names the salt on
    every event of a salted chain."""
    if e._sglang_ids and salt:
        return [(salt,)] * (b - a)
    if lora or salt:
        return [vllm_extra_keys(a + off == 0, lora, salt) for off in range(b - a)]
    return [None] * (b - a)

def event_ids(e: EngineModel, tokens: list[int], hashes: list[int], salt: str | None, lora: str | None) -> list:
    """The KV-event ids of a request's first ``len(tokens) // block_size`` blocks, from its
    tokens (what :func:`stored` names them, without needing them cached here)."""
    bs = e.block_size
    if e._index_ids:
        return list(hashes[:len(tokens) // bs])
    if e._sglang_ids:
        return [digest_to_event_id(d) for d in page_digests(tokens, bs, salt_seed(salt))]
    ds = vllm_block_digests(tokens, bs, parent=e._none_digest, algo=e.hash_algo, lora_name=lora,
                            cache_salt=salt, first=True)
    return [digest_to_int(d) for d in ds] if e._int_ids else ds

def stored(e: EngineModel, s: Seq, idxs: list[int]) -> None:
    """BlockStored events for newly cached blocks (offsets ``idxs`` of the sequence's chain),
    one per contiguous run; named by vLLM sha256 ids, or by the chained hash ("index")."""
    bs = e.block_size
    kv = e.kv
    meta = kv.meta
    keep_tokens = kv.host_capacity > 0
    hashes_all = s.hashes
    events = kv.events
    assert events is not None
    lora, salt = s.lora, s.salt
    lora_id = lora_int_id(lora)
    for a, b in runs(idxs):
        tokens = e._tokens(s, a * bs, b * bs)
        keys = event_extra_keys(e, a, b, lora, salt)
        if meta is None:  # index ids, no host tier: a block's id is its hash
            events.append(BlockStored(
                block_hashes=cast("list[BlockHash]", hashes_all[a:b]),  # a fresh slice: no alias sees it as ints
                parent_block_hash=hashes_all[a - 1] if a else None,
                token_ids=tokens, block_size=bs, lora_id=lora_id, medium=MEDIUM_GPU, lora_name=lora,
                extra_keys=keys, group_idx=0))
            continue
        parent = meta[hashes_all[a - 1]] if a else None
        parent_vh = parent.vh if parent else None
        hashes: list[BlockHash] = []
        if e._index_ids:
            for off in range(b - a):
                h = hashes_all[a + off]
                meta[h] = Block(h, None, parent_vh if off == 0 else hashes[-1],
                                tuple(tokens[off * bs:(off + 1) * bs]) if keep_tokens else None, keys[off], lora)
                hashes.append(h)
        else:
            if e._sglang_ids:  # a page chains from its parent page's digest (the root: none, or the salt's)
                digests = page_digests(tokens, bs, parent.vdigest if parent else salt_seed(salt))
            else:
                digests = vllm_block_digests(tokens, bs, parent=parent.vdigest if parent else e._none_digest,
                                             algo=e.hash_algo, lora_name=lora, cache_salt=salt, first=a == 0)
            for off, d in enumerate(digests):
                vh: BlockHash
                if e._sglang_ids:
                    vh = digest_to_event_id(d)
                else:
                    vh = digest_to_int(d) if e._int_ids else d
                meta[hashes_all[a + off]] = Block(vh, d, parent_vh if off == 0 else hashes[-1],
                                                  tuple(tokens[off * bs:(off + 1) * bs]) if keep_tokens else None,
                                                  keys[off], lora)
                hashes.append(vh)
        events.append(BlockStored(
            block_hashes=hashes, parent_block_hash=parent_vh, token_ids=tokens, block_size=bs,
            lora_id=lora_id, medium=MEDIUM_GPU, lora_name=lora, extra_keys=keys, group_idx=0))


def runs(idxs: list[int]) -> list[tuple[int, int]]:
    """Contiguous runs ``[a, b)`` of sorted offsets."""
    if idxs[-1] - idxs[0] + 1 == len(idxs):
        return [(idxs[0], idxs[-1] + 1)]
    out = []
    a = prev = idxs[0]
    for i in idxs[1:]:
        if i != prev + 1:
            out.append((a, prev + 1))
            a = i
        prev = i
    out.append((a, prev + 1))
    return out
