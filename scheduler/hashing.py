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
from collections.abc import Callable, Mapping, Sequence
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


def namespace_parent(cache_salt: str | None = None, lora_name: str | None = None,
                     other: tuple[Any, ...] = ()) -> int | None:
    """Where a namespaced chain starts in the gateway's index: ``None`` (the plain root, so an
    unsalted request hashes exactly as before) when there is no salt, adapter or other key; else
    a 64-bit value standing in for the root's parent. Folding the namespace into the root is
    enough: every later block chains from it, as vLLM's salt on the first block is (and its LoRA
    name on every block adds nothing a chain does not already carry). Empty strings count as absent."""
    if not cache_salt and not lora_name and not other:
        return None
    key = repr(("ns", lora_name or None, cache_salt or None, other)).encode("utf-8", "surrogatepass")
    return _xxh3(key, INDEX_ROOT_SEED)


def keyed_block_hashes(tokens: Sequence[int], block_size: int, parent: int | None, keys: Sequence[int]) -> list[int]:
    """:func:`block_hashes` with a per-block key XORed into each block's seed (0: none), for blocks
    whose engine extra keys (multimodal ids, say) the gateway cannot know: they never match a
    text request, and neither does anything chained after them."""
    out = block_hashes(tokens, block_size, parent)
    h = INDEX_ROOT_SEED if parent is None else parent
    data = _token_bytes(tokens[: len(out) * block_size])
    step = len(data) // len(out) if out else 0
    for i, k in enumerate(keys[: len(out)]):
        h = _xxh3(data[i * step : (i + 1) * step], h ^ k if k else h)
        out[i] = h
    return out


def _split_keys(keys: Any, lora_name: str | None, first: bool) -> tuple[str | None, tuple[Any, ...]]:
    """(cache salt, other keys) of one block's engine extra keys, read both as vLLM writes them
    (untagged: the LoRA name, then the salt on the first block) and in the domain-tagged form
    proposed upstream (``("lora", name, ...)``, ``("cache_salt", salt)``); LoRA keys are dropped
    (the event's ``lora_name`` names the adapter), anything else is kept opaque."""
    salt: str | None = None
    other: list[Any] = []
    lora_seen = False
    for k in keys or ():
        if isinstance(k, str):
            if lora_name and not lora_seen and k == lora_name:
                lora_seen = True
                continue
            if first and salt is None:
                salt = k
                continue
        elif isinstance(k, (list, tuple)) and len(k) >= 2 and k[0] in ("lora", "cache_salt") and isinstance(k[1], str):
            if k[0] == "lora":
                continue
            if first and salt is None:
                salt = k[1]
                continue
        other.append(tuple(k) if isinstance(k, list) else k)
    return salt, tuple(other)


def event_chain_keys(extra_keys: Sequence[Any] | None, n_blocks: int, lora_name: str | None,
                     root: bool) -> tuple[int | None, list[int] | None]:
    """How a BlockStored's blocks enter the index: (root parent override, per-block seed keys).

    ``extra_keys``: the event's list, one entry per block; ``root``: the event starts a chain (no
    parent), so its first block carries the request's salt. The gateway computes the same root
    with :func:`namespace_parent` from the request's ``cache_salt`` and adapter."""
    entries = list(extra_keys or ())[:n_blocks]
    entries += [None] * (n_blocks - len(entries))
    parent = None
    keys = [0] * n_blocks
    for i, ek in enumerate(entries):
        first = root and i == 0
        if ek is None and not (first and lora_name):
            continue
        salt, other = _split_keys(ek, lora_name, first)
        if first:
            parent = namespace_parent(salt, lora_name, other)
        elif other:
            keys[i] = namespace_parent(None, None, other) or 0
    return parent, (keys if any(keys) else None)


# --- vLLM 0.33 recipe -----------------------------------------------------------------------
# Read from vLLM's source (vllm/utils/hashing.py, vllm/v1/core/kv_cache_utils.py: hash_block_tokens,
# init_none_hash / resolve_none_hash_seed, generate_block_hash_extra_keys); docs/protocols.md §3.

#: ``--prefix-caching-hash-algo`` values: serialiser + digest (sha256: 32 bytes, xxhash: XXH3-128, 16).
VLLM_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
VLLM_DEFAULT_SEED_TEXT = "vllm-none-hash"  # the NONE_HASH seed when PYTHONHASHSEED is unset (crypto algos)
_NON_CRYPTO = frozenset({"xxhash", "xxhash_cbor"})  # vLLM seeds these randomly per process when unset


def _ser_pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)  # 5 on every Python vLLM supports


def _ser_cbor(obj: Any) -> bytes:
    import cbor2  # imported lazily: only the *_cbor recipes need it

    return cbor2.dumps(obj, canonical=True)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_RECIPES: dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], bytes]]] = {
    "sha256": (_ser_pickle, _sha256),
    "sha256_cbor": (_ser_cbor, _sha256),
    "xxhash": (_ser_pickle, xxhash.xxh3_128_digest),
    "xxhash_cbor": (_ser_cbor, xxhash.xxh3_128_digest),
}


def vllm_hash_fn(algo: str = "sha256") -> Callable[[Any], bytes]:
    """vLLM's ``get_hash_fn_by_name(algo)``: object -> digest."""
    try:
        ser, digest = _RECIPES[algo]
    except KeyError:
        raise ValueError(f"unknown prefix-caching hash algo {algo!r}; "
                         f"expected one of {list(VLLM_HASH_ALGOS)}") from None
    return lambda obj: digest(ser(obj))


def vllm_seed_text(algo: str = "sha256", env: Mapping[str, str] | None = None) -> str:
    """The text vLLM derives NONE_HASH from: ``PYTHONHASHSEED`` whenever it is *set* (the empty
    string included: vLLM tests ``is None``, not truthiness), else "vllm-none-hash" for the sha256
    algorithms. For the xxhash ones vLLM then draws a random seed per process, which nobody else
    can reproduce: that is refused here with the fix in the message."""
    seed = (os.environ if env is None else env).get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    vllm_hash_fn(algo)  # an unknown algo is reported as such
    if algo in _NON_CRYPTO:
        raise ValueError(f"vLLM seeds {algo} block hashes randomly per process when PYTHONHASHSEED is unset; "
                         "set the same PYTHONHASHSEED on the engines and the gateway")
    return VLLM_DEFAULT_SEED_TEXT


def vllm_none_hash(seed_text: str | None = None, algo: str = "sha256") -> bytes:
    """vLLM's NONE_HASH (the digest every chain starts from): ``hash_fn(seed_text)``; a ``None``
    seed is read from the environment as vLLM does (:func:`vllm_seed_text`)."""
    return vllm_hash_fn(algo)(vllm_seed_text(algo) if seed_text is None else seed_text)


def vllm_extra_keys(first_block: bool, lora_name: str | None = None,
                    cache_salt: str | None = None) -> tuple[str, ...] | None:
    """A text block's ``extra_keys`` as vLLM's ``generate_block_hash_extra_keys`` builds them: the
    LoRA name on every block, then ``cache_salt`` on the request's first block only (untagged
    strings, in that order); ``None`` when there are none. Empty names and salts count as absent."""
    keys = ([lora_name] if lora_name else []) + ([cache_salt] if first_block and cache_salt else [])
    return tuple(keys) if keys else None


def vllm_block_digests(
    tokens: Sequence[int],
    block_size: int,
    *,
    seed_text: str | None = None,
    algo: str = "sha256",
    extra_keys: Any = None,
    parent: bytes | None = None,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    first: bool | None = None,
) -> list[bytes]:
    """Digests of every complete block, chained from ``parent`` (default NONE_HASH).

    ``lora_name`` / ``cache_salt`` build each block's extra keys as vLLM does (the salt only on the
    request's first block: ``tokens[0]`` is the request's first token when ``first``, by default
    when ``parent`` is None); ``extra_keys`` instead gives every block the same keys verbatim
    (multimodal or other keys the caller built itself)."""
    fn = vllm_hash_fn(algo)
    starts = parent is None if first is None else first
    prev = parent if parent is not None else vllm_none_hash(seed_text, algo)
    per_block = lora_name or cache_salt
    out = []
    for i in range(len(tokens) // block_size):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        keys = vllm_extra_keys(i == 0 and starts, lora_name, cache_salt) if per_block else extra_keys
        prev = fn((prev, block, keys))
        out.append(prev)
    return out


def digest_to_int(digest: bytes) -> int:
    """The integer form used in vLLM KV events (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, the
    default): the low 64 bits of the digest read big-endian, i.e. its last 8 bytes, unsigned."""
    return int.from_bytes(digest[-8:], "big")


def vllm_block_hashes(tokens: Sequence[int], block_size: int, **kw: Any) -> list[int]:
    """vLLM KV-event block ids (u64) of every complete block."""
    return [digest_to_int(d) for d in vllm_block_digests(tokens, block_size, **kw)]
