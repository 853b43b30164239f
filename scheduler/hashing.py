"""Chained prefix block hashes.

Two families live here:

* ``block_hashes`` is the gateway's own index hash (XXH3-64 seeded with the previous block's
  hash, as Dynamo's KV router does). The index re-hashes the ``token_ids`` carried by KV events
  with it, so it never depends on an engine's hash seed or algorithm. 128k tokens hash in ~2 ms.
* ``vllm_block_hashes`` reproduces vLLM 0.33's prefix-cache recipe (``sha256`` = pickle protocol 5,
  ``sha256_cbor`` = canonical CBOR), needed where an engine's or the Mooncake store's own keys
  must be addressed (KV event block ids, store keys).

Only complete blocks are hashed; a trailing partial block never is.
"""
from __future__ import annotations

import hashlib
import os
import pickle
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

_xxh3 = xxhash.xxh3_64_intdigest

#: Seed of the first block's chain (a fixed constant: hashes must agree across processes).
INDEX_ROOT_SEED = 0x6D6F6F6E  # "moon"


def _token_bytes(tokens: Sequence[int]) -> bytes:
    try:
        return array("I", tokens).tobytes()
    except OverflowError:  # token ids beyond uint32 (never seen in practice): widen
        return array("Q", tokens).tobytes()


def block_hashes(tokens: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """Index hashes of every complete block of ``tokens``; hash i names the whole prefix to i.

    ``parent`` continues a chain (the hash of the block before ``tokens[0]``).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_blocks = len(tokens) // block_size
    if n_blocks == 0:
        return []
    data = _token_bytes(tokens[: n_blocks * block_size])
    step = len(data) // n_blocks
    h = INDEX_ROOT_SEED if parent is None else parent
    out = [0] * n_blocks
    for i in range(n_blocks):
        h = _xxh3(data[i * step : (i + 1) * step], h)
        out[i] = h
    return out


# --- vLLM 0.33 recipe -----------------------------------------------------------------------

VLLM_DEFAULT_SEED_TEXT = "vllm-none-hash"  # used by vLLM 0.33 when PYTHONHASHSEED is unset


def _ser_pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=5)


def _ser_cbor(obj: Any) -> bytes:
    import cbor2  # imported lazily: only the sha256_cbor recipe needs it

    return cbor2.dumps(obj, canonical=True)


_SERIALISERS = {"sha256": _ser_pickle, "sha256_cbor": _ser_cbor}


def vllm_none_hash(seed_text: str | None = None, algo: str = "sha256") -> bytes:
    """vLLM's NONE_HASH: the digest that seeds every chain (from PYTHONHASHSEED when given)."""
    if seed_text is None:
        seed_text = os.environ.get("PYTHONHASHSEED") or VLLM_DEFAULT_SEED_TEXT
    return hashlib.sha256(_serialiser(algo)(seed_text)).digest()


def _serialiser(algo: str) -> Callable[[Any], bytes]:
    try:
        return _SERIALISERS[algo]
    except KeyError:
        raise ValueError(f"unknown prefix-caching hash algo {algo!r}; expected one of {sorted(_SERIALISERS)}") from None


def vllm_block_digests(
    tokens: Sequence[int],
    block_size: int,
    *,
    seed_text: str | None = None,
    algo: str = "sha256",
    extra_keys: Any = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """32-byte digests of every complete block, chained from ``parent`` (default NONE_HASH)."""
    ser = _serialiser(algo)
    prev = parent if parent is not None else vllm_none_hash(seed_text, algo)
    out = []
    for i in range(len(tokens) // block_size):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        prev = hashlib.sha256(ser((prev, block, extra_keys))).digest()
        out.append(prev)
    return out


def digest_to_int(digest: bytes) -> int:
    """The integer form used in vLLM KV events: last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(digest[-8:], "big")


def vllm_block_hashes(tokens: Sequence[int], block_size: int, **kw: Any) -> list[int]:
    """vLLM KV-event block ids (u64) of every complete block."""
    return [digest_to_int(d) for d in vllm_block_digests(tokens, block_size, **kw)]
